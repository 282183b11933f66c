"""Integrations: run other libraries' MoE layers on :func:`moe_overlap.fused_experts`.

* :mod:`moe_overlap.integrations.deepspeed` -- ``MoE`` (a drop-in subclass of
  ``deepspeed.moe.layer.MoE``) and ``replace_moe_layers(model)``.
* :mod:`moe_overlap.integrations.transformers` -- the ``"moe_overlap"`` experts implementation
  for HF transformers 5.x (Mixtral, Qwen-MoE, OLMoE, Phi-MoE, ...) and
  ``replace_mixtral_moe(model)``; on transformers 4.x the Mixtral sparse MoE block is replaced.

Neither submodule is imported here: importing this package never imports DeepSpeed or
transformers. The helpers below are shared by both submodules.

Worlds: a layer whose experts are all local (DeepSpeed ``ep_size=1``, an HF model on one
process) runs on a single-rank local world, passed explicitly. ``fused_experts(world=None)``
would build the default world, which in a data-parallel job with torch.distributed initialized
is every process -- but those processes hold replicas of the same experts, not shards.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

__all__ = ["activation_name", "local_world_for", "check_swappable", "swap_class"]

_WORLDS: dict = {}
_WORLDS_LOCK = threading.Lock()


def local_world_for(device: torch.device):
    """One shared single-rank world per device (every integrated layer on it shares its
    workspace, as the World protocol intends)."""
    from ..world import local_world, resolve_device

    device = resolve_device(device)
    with _WORLDS_LOCK:
        world = _WORLDS.get(device)
        if world is None:
            world = local_world(device=device)
            _WORLDS[device] = world
        return world


def fused_experts(*args, **kwargs):
    """``moe_overlap.fused_experts``, looked up at call time (so tests may stand in for it)."""
    import moe_overlap

    fn = getattr(moe_overlap, "fused_experts", None)
    if fn is None:
        raise RuntimeError("moe_overlap.fused_experts is not available in this build")
    return fn(*args, **kwargs)


# Activations fused_experts runs for a plain two-layer MLP, with the torch function each one is.
_PLAIN = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu": lambda z: F.gelu(z, approximate="none"),
}


def activation_name(act) -> str | None:
    """Which of ``"relu"``, ``"silu"``, ``"gelu"`` (exact erf GELU) the callable ``act`` computes,
    found by evaluating it on a fixed grid (class names differ between libraries and versions;
    the function is what counts). None when it is none of them (for example the tanh GELU)."""
    z = torch.linspace(-6.0, 6.0, 97, dtype=torch.float32)
    try:
        with torch.no_grad():
            got = act(z.clone())
    except Exception:  # noqa: BLE001 - anything that cannot run on a tensor is unsupported
        return None
    if not isinstance(got, torch.Tensor) or got.shape != z.shape:
        return None
    got = got.to(torch.float32)
    for name, fn in _PLAIN.items():
        if torch.allclose(got, fn(z), rtol=1e-5, atol=1e-6):
            return name
    return None


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / max(||expected||, tiny), in float64."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def check_swappable(module, name: str) -> None:
    """Raise ``ValueError`` when ``module``'s forward was replaced on the instance by other code
    (then changing its class would not change what it runs)."""
    fwd = module.__dict__.get("forward")
    if fwd is not None and getattr(fwd, "__func__", None) is not type(module).forward:
        raise ValueError(
            f"{name}: its forward was replaced on the instance by other code; "
            "cannot switch it to fused_experts"
        )


def swap_class(module, new_cls) -> None:
    """Give ``module`` the class ``new_cls`` (a subclass of its own) in place: identity,
    submodules, parameters, buffers and hooks stay. An instance-level ``forward`` that is just
    the old class's forward, bound (transformers 4.x output capturing leaves one behind after
    every call), is removed, since it would shadow the new class's forward."""
    module.__dict__.pop("forward", None)
    module.__class__ = new_cls
