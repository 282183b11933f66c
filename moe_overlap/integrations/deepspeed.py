"""DeepSpeed MoE drop-in: ``deepspeed.moe.layer.MoE`` with its experts on ``fused_experts``.

Design record
-------------
* **What stays DeepSpeed's.** The constructor (same arguments, same order), the module tree and
  so every checkpoint key (``deepspeed_moe.gate.wg.weight``,
  ``deepspeed_moe.experts.deepspeed_experts.<i>.*``), the expert parameters' markers
  (``allreduce=False``, ``group_name``), the gate (``TopKGate``: softmax, top-1/top-2/top-k,
  capacity, ``drop_tokens``, random token selection, 2nd-expert sampling, noise policies,
  ``used_token``), ``l_aux`` and ``exp_counts``, the residual-MoE mix, and
  ``set_deepspeed_parallelism``. The layer *is* a ``deepspeed.moe.layer.MoE`` (a subclass), so
  DeepSpeed's engine still finds it: MoE optimizer groups, expert checkpoint files, its EP
  process groups.
* **What changes.** DeepSpeed dispatches into a dense ``[E, capacity, H]`` buffer, runs two
  all-to-alls around a per-expert Python loop, and combines. Here the gate's per-route decision
  (expert id or -1 for a capacity drop, and the combine weight) goes straight into
  ``fused_experts``: dispatch, grouped GEMMs and combine in fused kernels, with no capacity
  padding computed. Dropped routes contribute zero exactly as DeepSpeed's zero padding rows
  do, so the outputs agree; capacity only ever decided *which* routes survive.
* **Routing.** DeepSpeed >= 0.19 gates return sparse routes (``sparse_routes=True``:
  ``indices [K, S]`` with -1 for drops, ``gates [K, S]``); older gates return the dense
  ``combine_weights [S, E, C]`` / ``dispatch_mask``, from which the same per-token ids and
  weights are read (the dense tensors cost O(S * E * C), as they do inside DeepSpeed). The gate
  draws its random numbers (RTS, 2nd-expert sampling, jitter) exactly as DeepSpeed's layer
  does, so under the same seed both layers route identically.
* **Weights.** The experts stay DeepSpeed's own modules; every forward stacks their Linear
  weights into the v5 layout ``w1 [El, 2F or F, H]`` (SwiGLU: gate rows, then up rows) and
  ``w2 [El, H, F]`` with ``torch.stack`` / ``torch.cat``, which autograd routes back to each
  expert's parameters. Cost: one copy of the local expert weights per forward (and its
  gradient in backward); nothing else is duplicated and checkpoints are interchangeable.
* **Supported experts.** ``nn.Sequential(Linear(H, F), act, Linear(F, H))`` or a module with
  exactly two ``nn.Linear`` children and one activation child (registration order = forward
  order), act one of ReLU, SiLU, exact GELU (judged by evaluating it, whatever its class); and
  SwiGLU MLPs ``w2(silu(w1(x)) * w3(x))`` with Linear children ``w1`` (gate), ``w3`` (up), ``w2``
  (down) or ``gate_proj`` / ``up_proj`` / ``down_proj``. Linear biases become ``b1`` / ``b2``.
  ``nn.Identity`` and ``nn.Dropout(p=0)`` children are allowed; ``Dropout(p>0)``, extra
  parameters or anything else raise ``ValueError`` listing what is supported. The parsed
  structure is then *verified*: the expert's own forward runs on a fixed random probe and must
  equal the fused math (a custom forward that scales, adds a residual or reorders layers is
  caught here instead of giving silently different results).
* **Unsupported options** raise ``ValueError`` naming them: ``use_tutel=True`` (Tutel replaces
  the dispatch this layer replaces) and ``enable_expert_tensor_parallelism=True`` (experts
  sharded over TP ranks need a TP reduction ``fused_experts`` does not do). ``use_residual``
  is supported (DeepSpeed's dense MLP + coefficient mix, after the fused experts).
* **Worlds.** ``ep_size == 1``: a shared single-rank local world on the input's device (never
  the default world: in a data-parallel job that would span replicas, not shards).
  ``ep_size > 1``: ``moe_overlap.init_world(group=<DeepSpeed's expert-parallel group>)``, one
  world per group shared by every layer of that group; global expert id = EP rank * El + local
  index, which is how DeepSpeed's all-to-all lays out experts too. The group exists once
  ``deepspeed.initialize`` (or ``set_deepspeed_parallelism()``) ran; before that a forward
  with ``ep_size > 1`` raises. With non-expert tensor parallelism (``groups.mpu``) every TP
  rank computes its own (identical) tokens: correct, without DeepSpeed's duplicate-token drop.
* **Traps.** ``top1gating`` asserts ``tokens >= min_capacity`` (DeepSpeed's rule, kept).
  ``exp_counts`` counts assignments *before* capacity drops (DeepSpeed's definition).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import torch
from torch import nn

try:
    from deepspeed.moe.layer import MoE as _DeepSpeedMoE
except ImportError as e:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError(
        "moe_overlap.integrations.deepspeed needs DeepSpeed: pip install 'deepspeed>=0.16' "
        "(on a machine without CUDA: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install ...)"
    ) from e

from . import (
    activation_name,
    check_swappable,
    fused_experts,
    local_world_for,
    relative_error,
    swap_class,
)

__all__ = ["MoE", "ExpertSpec", "parse_expert", "replace_moe_layers", "SUPPORTED_EXPERTS"]

SUPPORTED_EXPERTS = (
    "nn.Sequential(nn.Linear(H, F), act, nn.Linear(F, H)) or a module with exactly two nn.Linear "
    "children and one activation child (in forward order), act one of ReLU, SiLU, GELU (exact, "
    "not tanh); or a SwiGLU MLP with nn.Linear children w1 (gate), w3 (up), w2 (down) -- or "
    "gate_proj, up_proj, down_proj -- computing down(silu(gate(x)) * up(x)). Biases are allowed; "
    "nn.Identity and nn.Dropout(p=0) children are ignored"
)

_SWIGLU_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))

# Probe tolerances (relative Frobenius error) for verifying a parsed expert against its forward.
_PROBE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
_PROBE_RTOL_LOW = 3e-2

_GATE_SPARSE_ROUTES = None  # resolved on first use: does TopKGate.forward take sparse_routes?


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """How one expert module maps onto ``fused_experts``.

    ``up``: child names whose weights form the rows of ``w1`` in order (SwiGLU: gate, up);
    ``down``: the child name of ``w2``; ``activation``: the ``fused_experts`` activation.
    """

    activation: str
    up: tuple
    down: str
    hidden_size: int
    ffn_size: int
    has_b1: bool
    has_b2: bool

    def stack(self, experts) -> tuple:
        """``(w1 [El, 2F or F, H], w2 [El, H, F], b1 [El, 2F or F] | None, b2 [El, H] | None)``
        stacked from the expert modules with autograd-tracked copies."""
        w1 = torch.cat(
            [torch.stack([getattr(e, n).weight for e in experts]) for n in self.up], dim=1
        )
        w2 = torch.stack([getattr(e, self.down).weight for e in experts])
        b1 = b2 = None
        if self.has_b1:
            b1 = torch.cat(
                [torch.stack([_bias(getattr(e, n)) for e in experts]) for n in self.up], dim=1
            )
        if self.has_b2:
            b2 = torch.stack([_bias(getattr(e, self.down)) for e in experts])
        return w1, w2, b1, b2


def _bias(lin: nn.Linear) -> torch.Tensor:
    if lin.bias is not None:
        return lin.bias
    return torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)


def _unsupported(expert: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"expert: unsupported expert module {type(expert).__name__} ({why}). "
        f"Supported: {SUPPORTED_EXPERTS}"
    )


def _is_passthrough(m: nn.Module) -> bool:
    return isinstance(m, nn.Identity) or (isinstance(m, nn.Dropout) and m.p == 0)


def _check_own_params(expert: nn.Module, linears) -> None:
    known = {id(p) for lin in linears for p in lin.parameters()}
    extra = [n for n, p in expert.named_parameters() if id(p) not in known]
    if extra:
        raise _unsupported(expert, f"parameters outside the recognised Linear layers: {extra}")


def parse_expert(expert: nn.Module, hidden_size: int) -> ExpertSpec:
    """Recognise ``expert`` as one of :data:`SUPPORTED_EXPERTS` and verify it on a probe.

    Raises ``ValueError`` (naming the module and listing what is supported) otherwise.
    """
    if not isinstance(expert, nn.Module):
        raise TypeError(f"expert must be a torch.nn.Module, got {type(expert).__name__}")
    if isinstance(expert, nn.Linear):
        raise _unsupported(expert, "a single nn.Linear expert; fused_experts runs two-layer MLPs")
    children = dict(expert.named_children())
    spec = None
    for gate_n, up_n, down_n in _SWIGLU_NAMES:
        if gate_n in children and up_n in children and down_n in children:
            lins = [children[gate_n], children[up_n], children[down_n]]
            if not all(isinstance(m, nn.Linear) for m in lins):
                raise _unsupported(expert, f"{gate_n}/{up_n}/{down_n} must all be nn.Linear")
            others = {n: m for n, m in children.items() if n not in (gate_n, up_n, down_n)}
            for n, m in others.items():
                if _is_passthrough(m):
                    continue
                act = activation_name(m)
                if act != "silu":
                    raise _unsupported(
                        expert,
                        f"child {n!r} ({type(m).__name__}) is not SiLU: only SwiGLU "
                        "(silu gate) is supported for gated experts",
                    )
            _check_own_params(expert, lins)
            g, u, d = lins
            if g.out_features != u.out_features or d.in_features != g.out_features:
                raise _unsupported(
                    expert,
                    f"{gate_n} {tuple(g.weight.shape)}, {up_n} {tuple(u.weight.shape)}, "
                    f"{down_n} {tuple(d.weight.shape)} are not [F, H], [F, H], [H, F]",
                )
            spec = ExpertSpec(
                "swiglu",
                (gate_n, up_n),
                down_n,
                g.in_features,
                g.out_features,
                g.bias is not None or u.bias is not None,
                d.bias is not None,
            )
            break
    if spec is None:
        lins, acts = [], []
        for n, m in children.items():
            if isinstance(m, nn.Linear):
                lins.append((n, m))
            elif _is_passthrough(m):
                continue
            elif isinstance(m, nn.Dropout):
                raise _unsupported(
                    expert,
                    f"child {n!r} is Dropout(p={m.p}); fused experts have no dropout (use p=0)",
                )
            else:
                act = activation_name(m)
                if act is None:
                    raise _unsupported(
                        expert,
                        f"child {n!r} ({type(m).__name__}) is neither a "
                        "Linear nor a supported activation",
                    )
                acts.append(act)
        if len(lins) != 2 or len(acts) != 1:
            raise _unsupported(
                expert,
                f"found {len(lins)} nn.Linear and {len(acts)} activation "
                "children; need exactly 2 and 1",
            )
        (up_n, up), (down_n, down) = lins
        _check_own_params(expert, [up, down])
        if down.in_features != up.out_features:
            raise _unsupported(
                expert,
                f"{up_n} {tuple(up.weight.shape)} then {down_n} "
                f"{tuple(down.weight.shape)} are not [F, H] then [H, F]",
            )
        spec = ExpertSpec(
            acts[0],
            (up_n,),
            down_n,
            up.in_features,
            up.out_features,
            up.bias is not None,
            down.bias is not None,
        )
    up0 = getattr(expert, spec.up[0])
    down = getattr(expert, spec.down)
    if up0.in_features != hidden_size or down.out_features != hidden_size:
        raise ValueError(
            f"expert: maps {up0.in_features} -> {down.out_features} features but hidden_size is "
            f"{hidden_size}; an expert must map hidden_size -> hidden_size"
        )
    _verify(expert, spec)
    return spec


def _verify(expert: nn.Module, spec: ExpertSpec) -> None:
    """Run the expert's own forward on a probe and compare it with the fused math."""
    from ..reference import expert_mlp

    p = getattr(expert, spec.down).weight
    if p.device.type == "meta":
        return
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4, spec.hidden_size, generator=gen).to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        got = expert(x)
        if isinstance(got, tuple):  # DeepSpeed's Experts keeps only the first element too
            got = got[0]
        w1, w2, b1, b2 = spec.stack([expert])
        want = expert_mlp(
            x,
            w1[0],
            w2[0],
            spec.activation,
            None if b1 is None else b1[0],
            None if b2 is None else b2[0],
        )
    if not torch.isfinite(want).all():
        return  # uninitialised weights: nothing to compare
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise _unsupported(expert, "its forward does not return a [N, H] tensor")
    tol = _PROBE_RTOL.get(p.dtype, _PROBE_RTOL_LOW)
    err = relative_error(got, want)
    if not err <= tol:
        names = "/".join(spec.up + (spec.down,))
        raise _unsupported(
            expert,
            f"parsed as {spec.activation} over {names}, but its forward differs from "
            f"that by a relative {err:.2e} on a probe (a custom forward?)",
        )


def _check_options(use_tutel: bool, enable_expert_tensor_parallelism: bool) -> None:
    if use_tutel:
        raise ValueError(
            "use_tutel=True is not supported by moe_overlap's DeepSpeed MoE: the fused kernels "
            "replace the dispatch Tutel would optimise; pass use_tutel=False"
        )
    if enable_expert_tensor_parallelism:
        raise ValueError(
            "enable_expert_tensor_parallelism=True is not supported by moe_overlap's DeepSpeed "
            "MoE (experts sharded over tensor-parallel ranks); pass False"
        )


def _gate_takes_sparse_routes(gate) -> bool:
    global _GATE_SPARSE_ROUTES
    if _GATE_SPARSE_ROUTES is None:
        params = inspect.signature(type(gate).forward).parameters
        _GATE_SPARSE_ROUTES = "sparse_routes" in params
    return _GATE_SPARSE_ROUTES


def _routes_from_dense(combine_SEC: torch.Tensor, dispatch_SEC: torch.Tensor, k: int):
    """Per-token ``(ids [S, K], weights [S, K])`` from DeepSpeed's dense gate outputs."""
    kept_SE = dispatch_SEC.any(dim=-1)
    w_SE = combine_SEC.sum(dim=-1)
    k = min(k, kept_SE.shape[1])
    # Kept experts sort before the rest (a token keeps at most k of them).
    ids = torch.topk(kept_SE.to(torch.int32), k, dim=1).indices
    kept = kept_SE.gather(1, ids)
    w = w_SE.gather(1, ids) * kept
    ids = torch.where(kept, ids, torch.full_like(ids, -1))
    return ids, w


_EP_WORLDS: dict = {}
_EP_LOCK = threading.Lock()


def _ep_world(group, ep_size: int):
    from .. import init_world

    with _EP_LOCK:
        world = _EP_WORLDS.get(id(group))
        if world is None:
            world = init_world(group=group)
            _EP_WORLDS[id(group)] = world
    if world.world_size != ep_size:
        raise RuntimeError(
            f"DeepSpeed's expert-parallel group has {world.world_size} ranks but "
            f"the layer's ep_size is {ep_size}"
        )
    return world


class MoE(_DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with the dispatch, experts and combine on ``fused_experts``.

    Same constructor and ``forward(hidden_states, used_token=None) -> (output, l_aux,
    exp_counts)`` as DeepSpeed's layer; see the module docstring for what is kept and what
    is supported.

    hidden_states: ``[..., hidden_size]`` float tensor (fp32, fp16 or bf16) on the experts'
    device; used_token: optional ``[S]`` mask over the flattened tokens (top-1 gating only, as
    in DeepSpeed). output: same shape and dtype as hidden_states; l_aux: fp32 scalar;
    exp_counts: ``[num_experts]`` int64 (assignments before capacity drops).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        _check_options(use_tutel, enable_expert_tensor_parallelism)
        spec = parse_expert(expert, hidden_size)
        super().__init__(
            hidden_size,
            expert,
            num_experts,
            ep_size,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            use_residual,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            use_tutel,
            enable_expert_tensor_parallelism,
            top2_2nd_expert_sampling,
        )
        self._mo_init(spec)

    def _mo_init(self, spec: ExpertSpec) -> None:
        self._mo_spec = spec
        self._mo_hidden = spec.hidden_size

    @classmethod
    def _spec_for(cls, layer: _DeepSpeedMoE) -> ExpertSpec:
        """Validate an existing DeepSpeed layer for conversion; its ExpertSpec."""
        _check_options(
            getattr(layer.deepspeed_moe, "use_tutel", False),
            getattr(layer, "enable_expert_tensor_parallelism", False),
        )
        hidden = layer.deepspeed_moe.gate.wg.in_features
        experts = list(layer.deepspeed_moe.experts.deepspeed_experts)
        if not experts:
            raise ValueError("expert: the DeepSpeed layer holds no local experts")
        spec = parse_expert(experts[0], hidden)
        for e in experts[1:]:
            # Structure only: the deep copies share it; the probe ran on the first.
            if type(e) is not type(experts[0]) or [n for n, _ in e.named_children()] != [
                n for n, _ in experts[0].named_children()
            ]:
                raise ValueError("expert: the layer's local experts differ in structure")
        return spec

    def _mo_world(self, device: torch.device):
        if self.ep_size == 1:
            return local_world_for(device)
        group = self.deepspeed_moe.ep_group
        if group is None:
            raise RuntimeError(
                f"ep_size={self.ep_size} needs DeepSpeed's expert-parallel process group: "
                "run deepspeed.initialize(...) on the model (or call "
                "layer.set_deepspeed_parallelism()) before the first forward"
            )
        return _ep_world(group, self.ep_size)

    def _mo_route(self, x_TH: torch.Tensor, used_token):
        moe = self.deepspeed_moe
        gate = moe.gate
        if _gate_takes_sparse_routes(gate):
            l_aux, _cap, _E, ids_KS, _loc, w_KS, exp_counts = gate(
                x_TH, used_token, sparse_routes=True
            )
            ids_TK = ids_KS.t().contiguous()
            w_TK = w_KS.t().contiguous()
        else:
            l_aux, combine_SEC, dispatch_SEC, exp_counts = gate(x_TH, used_token)
            ids_TK, w_TK = _routes_from_dense(combine_SEC, dispatch_SEC, gate.k)
        # DeepSpeed's MOELayer keeps these on itself; code that reads them there still works.
        moe.l_aux, moe.exp_counts = l_aux, exp_counts
        return ids_TK, w_TK, l_aux, exp_counts

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}"
            )
        H = self._mo_hidden
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != H:
            raise ValueError(f"hidden_states must be [..., {H}], got {tuple(hidden_states.shape)}")
        x_TH = hidden_states.reshape(-1, H)
        ids_TK, w_TK, l_aux, exp_counts = self._mo_route(x_TH, used_token)
        spec = self._mo_spec
        w1, w2, b1, b2 = spec.stack(self.deepspeed_moe.experts.deepspeed_experts)
        y_TH = fused_experts(
            x_TH,
            ids_TK,
            w_TK,
            w1,
            w2,
            world=self._mo_world(x_TH.device),
            activation=spec.activation,
            b1=b1,
            b2=b2,
        )
        output = y_TH.reshape(hidden_states.shape)
        if self.use_residual:
            # Residual MoE (DeepSpeed's rule): a softmax over two coefficients mixes the MoE
            # output with the dense MLP's.
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, l_aux, exp_counts


def replace_moe_layers(model: nn.Module) -> int:
    """Turn every ``deepspeed.moe.layer.MoE`` in ``model`` (itself included) into :class:`MoE`,
    in place; returns how many were converted.

    The layers keep their identity, submodules and parameters (so an optimizer or a DeepSpeed
    engine built earlier still holds the right tensors, and hooks stay attached): only the
    class changes. Every layer is validated before any is converted, so an unsupported expert
    or option raises ``ValueError`` with the model untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    todo = []
    for name, mod in model.named_modules():
        if isinstance(mod, MoE) or not isinstance(mod, _DeepSpeedMoE):
            continue
        if type(mod) is not _DeepSpeedMoE:
            raise ValueError(
                f"layer {name or '<model>'!r}: {type(mod).__name__} subclasses DeepSpeed's MoE "
                "with its own code; replace_moe_layers converts only deepspeed.moe.layer.MoE"
            )
        try:
            todo.append((mod, MoE._spec_for(mod)))
        except ValueError as e:
            raise ValueError(f"layer {name or '<model>'!r}: {e}") from None
        check_swappable(mod, f"layer {name or '<model>'!r}")
    for mod, spec in todo:
        swap_class(mod, MoE)
        mod._mo_init(spec)
    return len(todo)
