"""HF transformers: run MoE experts (Mixtral, Qwen-MoE, OLMoE, Phi-MoE, ...) on ``fused_experts``.

Design record
-------------
* **transformers 5.x** has an extension point for exactly this: experts classes decorated with
  ``@use_experts_implementation`` dispatch their forward through ``ExpertsInterface`` by the
  config's ``_experts_implementation`` (``"eager"``, ``"grouped_mm"``, ...), and receive the
  routing already decided by the model's router: ``forward(hidden_states [T, H], top_k_index
  [T, K], top_k_weights [T, K])``. :func:`register` adds ``"moe_overlap"`` to that interface;
  ``model.set_experts_implementation("moe_overlap")`` or ``from_pretrained(...,
  experts_implementation="moe_overlap")`` (after ``register()``) then routes every experts
  module of the model through :func:`experts_forward`. Nothing else changes: the router
  module, its parameters and names, the router logits HF records from it, the load-balancing
  loss, and the weights (already in the v5 layout ``gate_up_proj [E, 2F, H]`` with gate rows
  first, ``down_proj [E, H, F]``, which is ``fused_experts``' own layout: no copy). Switching back
  is ``model.set_experts_implementation("grouped_mm")`` (or ``"eager"``).
* Supported experts (checked per module, ``ValueError`` naming the module and the feature
  otherwise): gated with a SiLU gate (SwiGLU; the ``_apply_gate`` default) or ungated
  (``has_gate=False``, ``up_proj``) with ReLU / SiLU / exact GELU, concatenated gate/up
  (``is_concatenated=True``), optionally transposed (``is_transposed=True``: passed as
  transposed views, the kernels read them through their strides, no copy) and biased (``has_bias``:
  ``*_proj_bias`` become ``b1`` / ``b2``). Not supported: interleaved gate/up, custom
  ``_apply_gate`` (e.g. gpt-oss's clamped SwiGLU), ``has_post_expert_norm``. Activations are
  identified by evaluating ``act_fn``, not by class name.
* HF's own expert parallelism (``_is_expert_parallel``) marks routes of other ranks with ids >=
  num_experts; they become -1 (dropped) here, as HF's kernels zero them.
* The experts of an HF model are all local to the process: they run on a shared single-rank
  world per device (see ``moe_overlap.integrations``), never the default world.
* **transformers 4.x** has no such interface: :func:`replace_mixtral_moe` gives each Mixtral
  ``MixtralSparseMoeBlock`` a subclass whose forward keeps HF's routing code path (router
  ``gate`` Linear, fp32 softmax, top-k, renormalisation, weights cast to the input dtype,
  jitter in training) and stacks the per-expert ``w1`` (gate) / ``w3`` (up) / ``w2`` (down)
  weights for ``fused_experts`` per forward. The instance keeps its identity, submodules and
  names, and stays an instance of ``MixtralSparseMoeBlock`` -- HF 4.x records router logits
  by patching the forward of instances of that class, so the load-balancing loss keeps
  working. Trap (found by the tests): after each call with ``output_router_logits`` that
  capture *restores* ``module.forward`` as an instance attribute holding the old class's
  bound forward, which would shadow a class swap and silently keep the eager experts; the
  swap removes it (and refuses an instance forward patched by anything else).
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import transformers as _hf
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "moe_overlap.integrations.transformers needs transformers: pip install 'transformers>=4.46'"
    ) from e

from . import activation_name, check_swappable, fused_experts, local_world_for, swap_class

try:  # transformers >= 5: the experts implementation interface
    from transformers.integrations.moe import ExpertsInterface as _ExpertsInterface
except ImportError:  # pragma: no cover - transformers 4.x
    _ExpertsInterface = None

__all__ = [
    "IMPLEMENTATION",
    "HAS_EXPERTS_INTERFACE",
    "register",
    "experts_forward",
    "check_experts",
    "replace_mixtral_moe",
]

IMPLEMENTATION = "moe_overlap"
HAS_EXPERTS_INTERFACE = _ExpertsInterface is not None
TRANSFORMERS_VERSION = _hf.__version__


def register() -> str:
    """Register ``"moe_overlap"`` as a transformers experts implementation (idempotent);
    returns the name. Needs transformers >= 5."""
    if _ExpertsInterface is None:
        raise RuntimeError(
            f"transformers {TRANSFORMERS_VERSION} has no experts implementation interface "
            "(added in 5.0); use replace_mixtral_moe(model) instead"
        )
    _ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    return IMPLEMENTATION


def _default_apply_gate():
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)


def check_experts(module: nn.Module, name: str = "experts") -> dict:
    """Validate a transformers 5.x experts module for ``fused_experts``; its layout.

    Returns ``{"activation", "transposed", "bias", "gated"}``; raises ``ValueError`` naming
    ``name`` and the unsupported feature.
    """
    cached = module.__dict__.get("_moe_overlap_layout")
    if cached is not None:
        return cached

    def bad(why: str) -> ValueError:
        return ValueError(
            f"{name} ({type(module).__name__}): {why} is not supported by the "
            f"{IMPLEMENTATION!r} experts implementation"
        )

    if not hasattr(module, "has_gate"):
        raise ValueError(
            f"{name} ({type(module).__name__}) is not a transformers experts module "
            "(no @use_experts_implementation)"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise bad("has_post_expert_norm=True (a norm after each expert)")
    if not getattr(module, "is_concatenated", True):
        raise bad("an interleaved gate/up layout (is_concatenated=False)")
    gated = bool(module.has_gate)
    if gated:
        default = _default_apply_gate()
        if default is None or getattr(type(module), "_apply_gate", default) is not default:
            raise bad("a custom gating function (_apply_gate)")
    act = activation_name(module.act_fn) if hasattr(module, "act_fn") else None
    if gated and act != "silu":
        raise bad(f"a gated activation other than SiLU ({type(module.act_fn).__name__})")
    if not gated and act is None:
        raise bad(
            f"the activation {type(getattr(module, 'act_fn', None)).__name__} (supported: "
            "ReLU, SiLU, exact GELU)"
        )
    w1 = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    w2 = getattr(module, "down_proj", None)
    if (
        not isinstance(w1, torch.Tensor)
        or not isinstance(w2, torch.Tensor)
        or w1.dim() != 3
        or w2.dim() != 3
    ):
        raise bad("expert weights that are not 3-D parameters")
    layout = {
        "activation": "swiglu" if gated else act,
        "gated": gated,
        "transposed": bool(getattr(module, "is_transposed", False)),
        "bias": bool(getattr(module, "has_bias", False)),
    }
    module.__dict__["_moe_overlap_layout"] = layout
    return layout


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"moe_overlap"`` experts implementation (transformers 5.x signature).

    hidden_states ``[T, H]``; top_k_index ``[T, K]`` int expert ids; top_k_weights ``[T, K]``
    (fp32 from HF routers); returns ``[T, H]`` in hidden_states' dtype.
    """
    layout = check_experts(self)
    gated, transposed = layout["gated"], layout["transposed"]
    w1 = self.gate_up_proj if gated else self.up_proj
    w2 = self.down_proj
    if transposed:  # [E, H, 2F] / [E, F, H]: views in the v5 layout (the kernels take strides)
        w1 = w1.transpose(1, 2)
        w2 = w2.transpose(1, 2)
    b1 = b2 = None
    if layout["bias"]:
        b1 = self.gate_up_proj_bias if gated else self.up_proj_bias
        b2 = self.down_proj_bias
    ids = top_k_index
    if getattr(self, "_is_expert_parallel", False):
        ids = torch.where(ids >= w1.shape[0], torch.full_like(ids, -1), ids)
    # The weights stay fp32 (fused_experts combines in fp32, as HF's grouped_mm path does).
    return fused_experts(
        hidden_states,
        ids,
        top_k_weights,
        w1,
        w2,
        world=local_world_for(hidden_states.device),
        activation=layout["activation"],
        b1=b1,
        b2=b2,
    )


# ----------------------------------------------------------------------------- transformers 4.x
_FUSED_CLASSES: dict = {}


def _mixtral4_forward(self, hidden_states: torch.Tensor):
    """transformers 4.x ``MixtralSparseMoeBlock.forward`` with the experts on fused_experts."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    if self.training and self.jitter_noise > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise
        )
    x_TH = hidden_states.view(-1, hidden_dim)
    router_logits = self.gate(x_TH)
    probs = torch.softmax(router_logits, dim=1, dtype=torch.float)
    weights, ids = torch.topk(probs, self.top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x_TH.dtype)
    experts = self.experts
    w1 = torch.cat(
        [torch.stack([e.w1.weight for e in experts]), torch.stack([e.w3.weight for e in experts])],
        dim=1,
    )
    w2 = torch.stack([e.w2.weight for e in experts])
    y_TH = fused_experts(
        x_TH, ids, weights, w1, w2, world=local_world_for(x_TH.device), activation="swiglu"
    )
    return y_TH.reshape(batch_size, sequence_length, hidden_dim), router_logits


def _check_mixtral4_block(block: nn.Module, name: str) -> None:
    for i, e in enumerate(block.experts):
        for w in ("w1", "w2", "w3"):
            lin = getattr(e, w, None)
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise ValueError(f"{name}.experts.{i}: expected bias-free nn.Linear {w}")
        if activation_name(e.act_fn) != "silu":
            raise ValueError(
                f"{name}.experts.{i}: activation {type(e.act_fn).__name__} is not "
                "SiLU (only SwiGLU Mixtral experts are supported)"
            )


def _replace_mixtral4(model: nn.Module) -> int:
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    blocks = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, MixtralSparseMoeBlock) and type(m) not in _FUSED_CLASSES.values()
    ]
    for n, m in blocks:
        _check_mixtral4_block(m, n or "<model>")
        check_swappable(m, n or "<model>")
    for _, m in blocks:
        cls = type(m)
        fused = _FUSED_CLASSES.get(cls)
        if fused is None:
            fused = type(
                f"Fused{cls.__name__}",
                (cls,),
                {"forward": _mixtral4_forward, "__module__": __name__},
            )
            _FUSED_CLASSES[cls] = fused
        swap_class(m, fused)
    return len(blocks)


# ----------------------------------------------------------------------------- both
def replace_mixtral_moe(model: nn.Module) -> int:
    """Run ``model``'s MoE experts on ``fused_experts``, in place, weights and names kept;
    returns how many experts modules (5.x) or sparse MoE blocks (4.x) now do.

    transformers 5.x: registers ``"moe_overlap"`` and sets it as the model's experts
    implementation (every ``@use_experts_implementation`` module with a supported layout --
    Mixtral, Qwen2/3-MoE, OLMoE, Phi-MoE, ...). Every experts module is checked first; an
    unsupported one raises ``ValueError`` with the model untouched. transformers 4.x: Mixtral
    sparse MoE blocks only.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not HAS_EXPERTS_INTERFACE:
        return _replace_mixtral4(model)
    experts = [
        (n or "<model>", m)
        for n, m in model.named_modules()
        if hasattr(m, "has_gate") and hasattr(m, "down_proj") and hasattr(m, "config")
    ]
    for n, m in experts:
        check_experts(m, n)
    if not experts:
        return 0
    register()
    set_impl = getattr(model, "set_experts_implementation", None)
    if set_impl is not None:
        set_impl(IMPLEMENTATION)
    for _, m in experts:
        # Standalone experts modules, or configs set_experts_implementation did not reach.
        if m.config._experts_implementation != IMPLEMENTATION:
            m.config._experts_implementation = IMPLEMENTATION
    return len(experts)
