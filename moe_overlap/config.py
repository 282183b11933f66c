"""``MoEConfig``: the one description of an MoE layer that routers, kernels and references share.

Every field is validated when the config is built, so a bad value fails at construction with a
``ValueError``/``TypeError`` naming the field, never later inside a kernel. Only the rule that
needs the world (``num_experts % world_size == 0``) waits for :meth:`MoEConfig.validate_world`.

Choices this module fixes for the whole package:

* **Shared experts.** With ``n_shared_experts > 0`` the shared experts are one dense MLP (same
  activation as the routed experts) of FFN size ``shared_expert_ffn_size`` when given, else
  ``n_shared_experts * ffn_hidden_size`` (DeepSeek-V3 fuses its shared experts this way: the sum
  of n equal MLPs is one MLP with n times the rows). Giving ``shared_expert_ffn_size`` with
  ``n_shared_experts == 0`` is an error (it would silently do nothing).
* **Capacity.** :func:`expert_capacity` is the single formula, ``ceil(T * K / E * factor)`` in
  Python float arithmetic in exactly that order; every path (router, reference, kernels) calls
  it so that a value such as ``6 / 4 * 2.0`` rounds the same way everywhere.
* **Group-limited routing** (``n_group``/``topk_group``) needs both set or neither, and the kept
  groups must hold at least ``top_k`` experts.
* **Load-balance scores** (``aux_loss_scores``). ``"raw"`` (the default) averages each
  expert's softmax probability or raw sigmoid score. ``"normalized"`` first divides each
  token's scores by their sum over all experts (+1e-20), which is DeepSeek-V3's ``s'``. Raw
  sigmoid scores need not sum to 1, so with them the loss also falls when all of a token's
  logits fall together, a direction that changes no routing. Normalized scores sum to 1 for
  each token, so the loss moves only when score moves between experts. For softmax the two
  agree up to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")
SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_SCORES = ("raw", "normalized")

__all__ = [
    "ACTIVATIONS",
    "AUX_LOSS_SCORES",
    "SCORE_FUNCS",
    "MoEConfig",
    "expert_capacity",
    "w1_rows",
]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_int(name: str, v, minimum: int, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not _is_int(v):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {v!r} ({type(v).__name__})")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")


def _check_real(name: str, v, positive: bool, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not _is_real(v):
        raise TypeError(f"{name} must be a float, got {v!r} ({type(v).__name__})")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    if not positive and v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")


def _check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r} ({type(v).__name__})")


def w1_rows(cfg_or_activation, F: int | None = None) -> int:
    """Rows of one expert's first weight: ``2F`` for swiglu (gate rows, then up rows), else ``F``.

    ``cfg_or_activation`` is a :class:`MoEConfig` (``F`` defaults to its ``ffn_hidden_size``) or
    an activation name (``F`` required).
    """
    if isinstance(cfg_or_activation, MoEConfig):
        activation = cfg_or_activation.activation
        F = cfg_or_activation.ffn_hidden_size if F is None else F
    else:
        activation = cfg_or_activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_int("F", F, 1)
    return 2 * F if activation == "swiglu" else F


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor) -> int:
    """Assignments one source rank may send to one expert: ``ceil(T * K / E * factor)``.

    ``None`` factor means dropless and returns ``T * K`` (no expert can receive more). The
    arithmetic is Python float in this exact order; every path must use this function.
    """
    if capacity_factor is None:
        return num_tokens * top_k
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


@dataclass
class MoEConfig:
    """One MoE layer. Sizes: H ``hidden_size``, F ``ffn_hidden_size`` (per routed expert), E
    ``num_experts`` (global), K ``top_k``. See the module docstring for the shared-expert and
    capacity rules."""

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    activation: str = "swiglu"
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    n_group: int | None = None
    topk_group: int | None = None
    router_bias: bool = False
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_ffn_size: int | None = None
    max_tokens_per_rank: int | None = None
    aux_loss_scores: str = "raw"

    def __post_init__(self):
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("ffn_hidden_size", self.ffn_hidden_size, 1)
        _check_int("num_experts", self.num_experts, 1)
        _check_int("top_k", self.top_k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.aux_loss_scores not in AUX_LOSS_SCORES:
            raise ValueError(
                f"aux_loss_scores must be one of {AUX_LOSS_SCORES}, got {self.aux_loss_scores!r}"
            )
        _check_bool("norm_topk_prob", self.norm_topk_prob)
        _check_bool("router_bias", self.router_bias)
        _check_real("capacity_factor", self.capacity_factor, positive=True, allow_none=True)
        _check_real("aux_loss_coef", self.aux_loss_coef, positive=False)
        _check_real("z_loss_coef", self.z_loss_coef, positive=False)
        _check_real("routed_scaling_factor", self.routed_scaling_factor, positive=True)
        _check_int("n_group", self.n_group, 1, allow_none=True)
        _check_int("topk_group", self.topk_group, 1, allow_none=True)
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(
                "n_group and topk_group must be set together (group-limited routing) or both "
                f"be None; got n_group={self.n_group}, topk_group={self.topk_group}"
            )
        if self.n_group is not None:
            if self.num_experts % self.n_group:
                raise ValueError(
                    f"num_experts ({self.num_experts}) must be divisible by n_group "
                    f"({self.n_group})"
                )
            if self.topk_group > self.n_group:
                raise ValueError(
                    f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})"
                )
            kept = self.topk_group * (self.num_experts // self.n_group)
            if self.top_k > kept:
                raise ValueError(
                    f"top_k ({self.top_k}) exceeds the {kept} experts in the topk_group="
                    f"{self.topk_group} kept groups of {self.num_experts // self.n_group}"
                )
        _check_int("n_shared_experts", self.n_shared_experts, 0)
        _check_int("shared_expert_ffn_size", self.shared_expert_ffn_size, 1, allow_none=True)
        if self.shared_expert_ffn_size is not None and self.n_shared_experts == 0:
            raise ValueError(
                "shared_expert_ffn_size is set but n_shared_experts is 0: set n_shared_experts "
                ">= 1 to get shared experts"
            )
        _check_int("max_tokens_per_rank", self.max_tokens_per_rank, 1, allow_none=True)

    # ------------------------------------------------------------------ derived sizes
    @property
    def w1_rows(self) -> int:
        """Rows of one routed expert's first weight (``2F`` for swiglu, else ``F``)."""
        return w1_rows(self.activation, self.ffn_hidden_size)

    @property
    def shared_ffn_size(self) -> int:
        """FFN size of the fused shared-expert MLP (0 when there are no shared experts)."""
        if self.n_shared_experts == 0:
            return 0
        if self.shared_expert_ffn_size is not None:
            return self.shared_expert_ffn_size
        return self.n_shared_experts * self.ffn_hidden_size

    def capacity(self, num_tokens: int) -> int:
        """Per-(source rank, expert) capacity for ``num_tokens`` local tokens."""
        return expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)

    def validate_world(self, world_size: int) -> int:
        """Check the config against an expert-parallel world; returns the local expert count."""
        _check_int("world_size", world_size, 1)
        if self.num_experts % world_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the world size "
                f"({world_size})"
            )
        return self.num_experts // world_size

    def num_local_experts(self, world_size: int) -> int:
        """El = E / world_size (validated)."""
        return self.validate_world(world_size)
