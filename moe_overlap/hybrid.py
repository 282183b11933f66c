"""``HybridBlock``: a transformer block with tensor-parallel attention and expert-parallel MoE
on one world (the Flux half and the MoE half of the library in one layer).

::

    x [S/W, B, H]  (this rank's sequence shard)
      -> RMSNorm                                         replicated weight, local tokens
      -> wqkv: all_gather_matmul                         [S, B, 3H/W]   (gather in the prologue)
      -> causal attention + RoPE on this rank's heads    [S, B, H/W]    (n_heads / W heads)
      -> wo: matmul_reduce_scatter                       [S/W, B, H]    (scatter in the epilogue)
      -> + x
      -> RMSNorm -> MoELayer (experts sharded over the same world)  [S/W, B, H]
      -> + residual

Design record
-------------
* **Layout.** Sequence first, ``[S, B, H]`` (Megatron's choice): the fused TP ops gather and
  scatter dim 0 of the flattened rows, so rank r's shard ``x[r*S/W:(r+1)*S/W]`` is one
  contiguous block of ``S/W * B`` rows and the gathered activations are ``[S, B, ...]`` in
  order. The recipe (``moe_overlap.recipe``) works in ``[B, S, H]``; its ``--tp`` model
  transposes once after the embedding (and once before the loss), not at every block.
  ``S % W == 0`` and ``n_heads % W == 0`` are required (ValueError otherwise).
* **Tokens each rank dispatches.** The ReduceScatter of ``wo`` leaves rank r exactly the
  ``S/W * B`` tokens of its sequence shard; the MoE layer dispatches those, so every token is
  routed once, by one rank, and no gather/scatter sits between attention and experts.
* **Sharding one full model** (:func:`shard_full_weight`, :meth:`HybridBlock.from_full`): the
  full ``wqkv [3H, H]`` stacks q, k, v rows (heads in order inside each); rank r keeps the q, k
  and v rows of heads ``[r*n/W, (r+1)*n/W)``, stacked q_r, k_r, v_r (``[3H/W, H]``). ``wo [H,
  H]`` keeps the matching input columns ``[r*H/W, (r+1)*H/W)`` (heads are contiguous in the
  attention output). Experts keep ``[r*El, (r+1)*El)``. Norms, router (and shared experts)
  are whole. Sharding is indexing, so ``shard_full_weight(name, full_grad)`` is also the
  expected local gradient: the tests compare exactly that.
* **Gradients, exactly.** Every rank backpropagates its *share* of one global loss (its
  tokens' terms; see ``aux_loss`` below). Then:

  - ``wqkv``/``wo`` shards (``tensor_parallel``) and experts (``expert_parallel``): the
    fused backward (AG <-> RS, dispatch <-> combine) already sums every rank's contribution,
    so the local ``.grad`` *is* the unsharded model's gradient for those rows. No reduction.
  - norm weights, router (and shared experts): replicated, applied to local tokens only
    (``sequence_parallel``). The unsharded gradient is the **sum** over ranks of the local
    ``.grad``: call :func:`sync_replicated_grads` (one flat all-reduce) before the optimizer.
    A sum, not an average: each rank's loss is already a share of the global loss, not a
    mean over its own tokens.
  - the input ``x`` shard: its ``.grad`` is the matching rows of the unsharded gradient.

* **Router losses over the whole sequence.** ``E * sum_e f_e P_e`` is not additive over token
  subsets, so each rank's local statistic would change the loss with W. The block all-reduces
  the expert counts (one ``[E]`` int64 host collective per forward, skipped at W = 1 or when
  ``aux_loss_coef == 0``) so ``f_e`` is global, and sets ``aux_loss`` to this rank's share
  ``coef * E * sum_e f_e * (sum over local tokens of p_e) / T_total`` (+ the z-loss share
  ``z_coef * sum_local lse^2 / T_total``). Summed over ranks it is exactly the unsharded
  block's aux loss, and its gradient is this rank's part of the global gradient (``f_e``
  carries none). The inner ``MoELayer`` is built with both coefficients zeroed so its router
  does not compute a local loss nobody uses; the block keeps the real config in ``moe_cfg``.
* **Capacity** is a per-source-rank rule, so under sequence parallelism it would depend on
  W: the block requires dropless routing (``capacity_factor=None``, ValueError otherwise).

Traps. The collective contract of the fused ops holds: every rank runs the same blocks in the
same order with the same shapes. The count all-reduce runs in the forward (a host collective),
never in backward, so emulated ranks on one GPU (concurrent mode) stay deadlock-free in
autograd.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .config import MoEConfig
from .dispatch.router import balance_scores, router_logits
from .experts.layer import MoELayer
from .tp.linear import ColumnParallelLinear, RowParallelLinear
from .world import World

__all__ = [
    "HybridBlock",
    "RMSNorm",
    "TensorParallelAttention",
    "apply_rope",
    "causal_attention",
    "param_kind",
    "reference_block",
    "rms_norm",
    "rope_tables",
    "shard_full_weight",
    "sync_replicated_grads",
]


# ----------------------------------------------------------------------------------- math
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim computed in fp32 (float64 stays float64), returned in
    ``x``'s dtype."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cd)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(cd)).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, dtype, device):
    """``(cos, sin)`` of shape ``[S, head_dim]`` (rotate-half layout), built in float64."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device)


def apply_rope(x_BNSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, d]`` by position (rotate-half: pairs ``(i, i + d/2)``)."""
    half = x_BNSd.shape[-1] // 2
    rot = torch.cat([-x_BNSd[..., half:], x_BNSd[..., :half]], dim=-1)
    return x_BNSd * cos_Sd + rot * sin_Sd


def causal_attention(x_BSD, wqkv_3DD, wo_DD, n_heads, cos_Sd, sin_Sd):
    """Unsharded multi-head causal self-attention with RoPE on ``x_BSD [B, S, D]``:
    ``wqkv [3D, D]`` (q, k, v row blocks, heads in order), ``wo [D, D]``."""
    B, S, D = x_BSD.shape
    hd = D // n_heads
    qkv = F.linear(x_BSD, wqkv_3DD).view(B, S, 3, n_heads, hd).permute(2, 0, 3, 1, 4)
    q, k, v = apply_rope(qkv[0], cos_Sd, sin_Sd), apply_rope(qkv[1], cos_Sd, sin_Sd), qkv[2]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, N, S, hd]
    return F.linear(o.transpose(1, 2).reshape(B, S, D), wo_DD)


class RMSNorm(nn.Module):
    """RMSNorm with a weight ``[dim]`` (ones at init)."""

    def __init__(self, dim, eps, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------------- sharding
_TP_SUFFIXES = ("attn.wqkv.weight", "attn.wo.weight")


def param_kind(name: str) -> str:
    """How a full-model parameter name is distributed over the hybrid world:
    ``"tensor"`` (attention wqkv/wo shards), ``"expert"`` (expert slices) or ``"replicated"``
    (everything else: norms, router, shared experts, embeddings)."""
    if name.endswith(_TP_SUFFIXES):
        return "tensor"
    if ".experts." in name or name.startswith("experts."):
        return "expert"
    return "replicated"


def shard_full_weight(
    name: str, full: torch.Tensor, n_heads: int, rank: int, world_size: int
) -> torch.Tensor:
    """This rank's piece of the full tensor ``name`` (a view; see the module docstring).

    Works for weights and equally for full gradients (the expected local gradient).
    ``attn.wqkv.weight [3H, H]`` -> ``[3H/W, H]`` (q, k, v rows of heads ``[r*n/W,
    (r+1)*n/W)``); ``attn.wo.weight [H, H]`` -> ``[H, H/W]``; ``*.experts.* [E, ...]`` ->
    ``[E/W, ...]``; anything else is returned whole.
    """
    W, r = world_size, rank
    kind = param_kind(name)
    if kind == "tensor":
        if name.endswith("wqkv.weight"):
            three_h, h = full.shape
            if three_h % 3 or (three_h // 3) % W or n_heads % W:
                raise ValueError(
                    f"{name}: shape {tuple(full.shape)} with {n_heads} heads cannot be split "
                    f"over {W} ranks"
                )
            return full.view(3, W, three_h // (3 * W), h)[:, r].reshape(three_h // W, h)
        if full.shape[1] % W:
            raise ValueError(f"{name}: {full.shape[1]} input columns do not split over {W}")
        k = full.shape[1] // W
        return full[:, r * k : (r + 1) * k]
    if kind == "expert":
        if full.shape[0] % W:
            raise ValueError(f"{name}: {full.shape[0]} experts do not split over {W} ranks")
        el = full.shape[0] // W
        return full[r * el : (r + 1) * el]
    return full


# ----------------------------------------------------------------------------------- checks
def _check_heads(H: int, n_heads, W: int) -> None:
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    if H % n_heads or (H // n_heads) % 2:
        raise ValueError(
            f"hidden_size {H} must split into {n_heads} heads of even size (RoPE rotates pairs)"
        )
    if n_heads % W:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by the world size ({W})")


def _check_rope(cos, sin, S: int, head_dim: int, x: torch.Tensor) -> None:
    """``cos``/``sin`` ``[S, head_dim]`` in x's dtype and on its device (checked before the
    attention's first GEMM launches; attention would reject a mismatch only after it)."""
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    for nm, t in (("cos", cos), ("sin", sin)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{nm} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (S, head_dim):
            raise ValueError(
                f"{nm} must be [S, head_dim] = [{S}, {head_dim}] (the full sequence), "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != x.dtype:
            raise TypeError(f"{nm} dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{nm} is on {t.device} but x is on {x.device}")


# ----------------------------------------------------------------------------------- modules
class TensorParallelAttention(nn.Module):
    """Causal self-attention with RoPE, heads split over the world, sequence-parallel in/out.

    ``wqkv``: :class:`ColumnParallelLinear` ``[3H/W, H]`` (q_r, k_r, v_r rows), gathering the
    input shard in its GEMM prologue. ``wo``: :class:`RowParallelLinear` ``[H, H/W]``,
    reduce-scattering back to the sequence shard in its epilogue.
    """

    def __init__(self, hidden_size: int, n_heads: int, world: World, dtype=None, device=None):
        super().__init__()
        if not isinstance(world, World):
            raise TypeError(f"world must be a moe_overlap World, got {type(world).__name__}")
        W = world.world_size
        _check_heads(hidden_size, n_heads, W)
        self.world = world
        self.n_heads = n_heads
        self.n_local_heads = n_heads // W
        self.head_dim = hidden_size // n_heads
        H = hidden_size
        kw = dict(dtype=dtype, device=device)
        self.wqkv = ColumnParallelLinear(H, 3 * H, world, gather_input=True, **kw)
        self.wo = RowParallelLinear(H, H, world, scatter_output=True, **kw)

    def forward(self, x_sBH: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor):
        """``x [S/W, B, H]`` -> ``[S/W, B, H]``; ``cos``/``sin`` ``[S, head_dim]`` (full S)."""
        H = self.n_heads * self.head_dim
        if not isinstance(x_sBH, torch.Tensor) or x_sBH.dim() != 3 or x_sBH.shape[-1] != H:
            got = tuple(x_sBH.shape) if isinstance(x_sBH, torch.Tensor) else type(x_sBH).__name__
            raise ValueError(f"x must be this rank's sequence shard [S/W, B, {H}], got {got}")
        s, B, _ = x_sBH.shape
        S = s * self.world.world_size
        if cos_Sd is None or sin_Sd is None:
            raise ValueError("TensorParallelAttention needs cos and sin [S, head_dim]")
        _check_rope(cos_Sd, sin_Sd, S, self.head_dim, x_sBH)
        nl, hd = self.n_local_heads, self.head_dim
        qkv = self.wqkv(x_sBH)  # [S, B, 3H/W]: every position, this rank's heads
        qkv = qkv.view(S, B, 3, nl, hd).permute(2, 1, 3, 0, 4)  # [3, B, nl, S, hd]
        q, k, v = apply_rope(qkv[0], cos_Sd, sin_Sd), apply_rope(qkv[1], cos_Sd, sin_Sd), qkv[2]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nl, S, hd]
        o = o.permute(2, 0, 1, 3).reshape(S, B, nl * hd)  # heads contiguous: wo's columns
        return self.wo(o)


def _router_loss_share(x_TH, weight_EH, counts_E, cfg: MoEConfig, n_tokens: int):
    """This rank's share of the router losses of ``n_tokens`` tokens (all ranks): see the
    module docstring. ``counts_E`` are the *global* pre-drop assignment counts (no grad)."""
    logits = router_logits(x_TH, weight_EH)  # the router's own fp32 (or float64) logits
    cd = logits.dtype
    E, K = cfg.num_experts, cfg.top_k
    loss = logits.new_zeros(())
    if cfg.aux_loss_coef != 0.0:
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        f = counts_E.to(cd) / max(n_tokens * K, 1)
        # this rank's tokens' part of the global mean
        P = balance_scores(scores, cfg).sum(0) / max(n_tokens, 1)
        loss = loss + cfg.aux_loss_coef * (E * (f * P).sum())
    if cfg.z_loss_coef != 0.0:
        z = torch.logsumexp(logits, dim=-1).square().sum() / max(n_tokens, 1)
        loss = loss + cfg.z_loss_coef * z
    return loss if cd == torch.float64 else loss.float()


class HybridBlock(nn.Module):
    """Pre-norm transformer block: tensor-parallel attention + expert-parallel MoE, one world.

    Args:
        moe_cfg: the MoE layer (its ``hidden_size`` is the block's H). ``capacity_factor`` must
            be None (dropless).
        n_heads: attention heads; ``H % n_heads == 0``, even head dim, ``n_heads % W == 0``.
        world: the World shared by attention (TP) and experts (EP).
        rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
        dtype, device: parameters (default: torch's default dtype, the world's device).
        impl: ``"fused"`` (Triton kernels) or ``"baseline"`` for the MoE layer.
        generator: initializes the MoE layer (attention shards draw from ``world.generator``);
            :meth:`load_full` overwrites everything anyway.

    ``forward(x [S/W, B, H], cos=None, sin=None) -> [S/W, B, H]``; after it, ``aux_loss`` is
    this rank's differentiable share of the block's router losses (sum over ranks = the
    unsharded block's) and ``expert_counts [E]`` int64 the assignments this rank routed.

    Parameters carry ``tensor_parallel`` / ``expert_parallel`` / ``sequence_parallel``
    attributes (see the module docstring for what each means for the gradient).
    """

    def __init__(
        self,
        moe_cfg: MoEConfig,
        n_heads: int,
        world: World,
        *,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        dtype=None,
        device=None,
        impl: str = "fused",
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if not isinstance(moe_cfg, MoEConfig):
            raise TypeError(f"moe_cfg must be a MoEConfig, got {type(moe_cfg).__name__}")
        if not isinstance(world, World):
            raise TypeError(f"world must be a moe_overlap World, got {type(world).__name__}")
        H, W = moe_cfg.hidden_size, world.world_size
        _check_heads(H, n_heads, W)
        if moe_cfg.capacity_factor is not None:
            raise ValueError(
                "HybridBlock needs dropless routing (moe_cfg.capacity_factor=None): capacity "
                "is per source rank, so under sequence parallelism it would depend on W"
            )
        device = torch.device(device) if device is not None else world.device
        if device != world.device:
            raise ValueError(f"device {device} differs from the world's {world.device}")
        dtype = dtype or torch.get_default_dtype()
        self.world = world
        self.moe_cfg = moe_cfg
        self.hidden_size = H
        self.n_heads = n_heads
        self.head_dim = H // n_heads
        self.rope_theta = float(rope_theta)
        self.attn_norm = RMSNorm(H, norm_eps, dtype, device)
        self.attn = TensorParallelAttention(H, n_heads, world, dtype=dtype, device=device)
        self.moe_norm = RMSNorm(H, norm_eps, dtype, device)
        # The router losses need global counts, so the block computes them (module docstring).
        inner = dataclasses.replace(moe_cfg, aux_loss_coef=0.0, z_loss_coef=0.0)
        if generator is None:
            # A private generator keeps construction from consuming the default RNG.
            generator = torch.Generator(device=device)
        self.moe = MoELayer(
            inner, world=world, dtype=dtype, device=device, impl=impl, generator=generator
        )
        for name, p in self.named_parameters():
            kind = param_kind(name)
            p.tensor_parallel = kind == "tensor"
            p.expert_parallel = kind == "expert"
            p.sequence_parallel = kind == "replicated"
        self.aux_loss = None
        self.expert_counts = None
        self._rope_cache: dict = {}

    @classmethod
    def from_full(
        cls,
        weights: Mapping[str, torch.Tensor],
        moe_cfg: MoEConfig,
        n_heads: int,
        world: World,
        *,
        prefix: str = "",
        dtype=None,
        **kwargs,
    ) -> HybridBlock:
        """A block on ``world`` holding this rank's shards of the full weights ``weights``
        (names as :meth:`load_full`). ``dtype`` defaults to that of ``wqkv``."""
        dtype = dtype or weights[prefix + "attn.wqkv.weight"].dtype
        blk = cls(moe_cfg, n_heads, world, dtype=dtype, **kwargs)
        blk.load_full(weights, prefix)
        return blk

    @torch.no_grad()
    def load_full(self, weights: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Copy this rank's shards of the *full* (unsharded) block weights.

        ``weights[prefix + name]`` for every parameter name of this block, full shapes:
        ``attn_norm.weight [H]``, ``attn.wqkv.weight [3H, H]``, ``attn.wo.weight [H, H]``,
        ``moe_norm.weight [H]``, ``moe.router.weight [E, H]``, ``moe.experts.gate_up_proj [E,
        2F, H]``, ``moe.experts.down_proj [E, H, F]`` (+ expert biases, shared experts when
        configured). A router correction bias buffer is copied when present.
        """
        W, r = self.world.world_size, self.world.rank
        params = dict(self.named_parameters())
        missing = sorted(prefix + n for n in params if prefix + n not in weights)
        if missing:
            raise ValueError(f"full weights lack {missing}")
        for name, p in params.items():
            src = shard_full_weight(name, weights[prefix + name], self.n_heads, r, W)
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(
                    f"{prefix + name}: full shape {tuple(weights[prefix + name].shape)} gives a "
                    f"shard {tuple(src.shape)}, the block holds {tuple(p.shape)}"
                )
            p.copy_(src)
        bias = self.moe.router.e_score_correction_bias
        key = prefix + "moe.router.e_score_correction_bias"
        if bias is not None and key in weights:
            bias.copy_(weights[key])

    def _rope(self, S: int, dtype, device):
        key = (S, dtype, device)
        if key not in self._rope_cache:
            self._rope_cache = {key: rope_tables(S, self.head_dim, self.rope_theta, dtype, device)}
        return self._rope_cache[key]

    def _check(self, x, cos, sin):
        H, W = self.hidden_size, self.world.world_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != H:
            raise ValueError(
                f"x must be this rank's sequence shard [S/W, B, {H}] (sequence first), got "
                f"{tuple(x.shape)}"
            )
        dt = self.attn_norm.weight.dtype
        if x.dtype != dt:
            raise TypeError(f"x dtype {x.dtype} differs from the block's {dt}")
        if x.device != self.world.device:
            raise ValueError(f"x is on {x.device} but the block's world is on {self.world.device}")
        _check_rope(cos, sin, x.shape[0] * W, self.head_dim, x)

    def forward(self, x_sBH: torch.Tensor, cos_Sd=None, sin_Sd=None) -> torch.Tensor:
        """``x [S/W, B, H]`` (rank r holds positions ``[r*S/W, (r+1)*S/W)``) -> same shape.

        ``cos``/``sin`` ``[S, head_dim]`` cover the full sequence (default: built from
        ``rope_theta`` in x's dtype, cached).
        """
        self._check(x_sBH, cos_Sd, sin_Sd)
        s, B, H = x_sBH.shape
        W = self.world.world_size
        if cos_Sd is None:
            cos_Sd, sin_Sd = self._rope(s * W, x_sBH.dtype, x_sBH.device)
        h = x_sBH + self.attn(self.attn_norm(x_sBH), cos_Sd, sin_Sd)
        a = self.moe_norm(h)
        y = self.moe(a)
        counts = self.moe.expert_counts
        self.expert_counts = counts
        cfg = self.moe_cfg
        if cfg.aux_loss_coef != 0.0 and W > 1:
            counts = self.world.all_reduce(counts.detach().clone())
        self.aux_loss = _router_loss_share(
            a.reshape(-1, H), self.moe.router.weight, counts, cfg, s * B * W
        )
        return h + y

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, n_heads={self.n_heads} "
            f"({self.attn.n_local_heads} local), world_size={self.world.world_size}"
        )


def sync_replicated_grads(module: nn.Module, world: World | None = None) -> int:
    """Sum over ranks, in one flat all-reduce, the ``.grad`` of every parameter of ``module``
    marked ``sequence_parallel`` (the replicated norms/router of each :class:`HybridBlock`, and
    the bias of a scattering :class:`RowParallelLinear`). Afterwards each equals the unsharded
    model's gradient. A missing ``.grad`` counts as zeros (every rank must contribute the same
    layout). ``world``: default the first block's. Collective; returns the tensor count.

    It covers what ``moe_overlap.tp.sync_sequence_parallel_grads`` covers: call one of the two
    on a module, never both (a bias would be summed twice)."""
    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    if not params:
        return 0
    if world is None:
        world = next((m.world for m in module.modules() if isinstance(m, HybridBlock)), None)
        if world is None:
            world = next(m.world for m in module.modules() if isinstance(m, RowParallelLinear))
    if world.world_size == 1:
        return len(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    world.all_reduce(flat)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off : off + n].view_as(p.grad))
        off += n
    return len(params)


# ----------------------------------------------------------------------------------- reference
def reference_block(
    x_SBH: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    moe_cfg: MoEConfig,
    n_heads: int,
    *,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    prefix: str = "",
    return_route: bool = False,
    topk_ids: torch.Tensor | None = None,
):
    """The unsharded block in pure torch (any float dtype; tests pass float64).

    ``x [S, B, H]`` (the full sequence), ``weights`` full (names as
    :meth:`HybridBlock.load_full`). The MoE part is :func:`moe_overlap.reference.moe_layer`
    on all ``S*B`` tokens in ``[S, B]`` order (rank r's tokens are rows ``[r*S/W*B,
    (r+1)*S/W*B)``) with the global expert weights. Returns ``(y [S, B, H], aux)`` where
    ``aux`` is the scaled router loss over all tokens (what the ranks' ``aux_loss`` sum to),
    plus the MoE's :class:`moe_overlap.reference.RouteResult` when ``return_route``.

    ``topk_ids [S*B, K]`` int, optional: impose the expert choice (for instance the one a
    bf16 run made, so that a near-tie that rounding flipped does not fail a test); weights,
    load-balance counts and losses then follow these ids (dropless).
    """

    def p(name):
        return weights.get(prefix + name)

    S, B, H = x_SBH.shape
    cos, sin = rope_tables(S, H // n_heads, rope_theta, x_SBH.dtype, x_SBH.device)
    x = x_SBH.transpose(0, 1)  # the reference attention is batch-first
    h = x + causal_attention(
        rms_norm(x, p("attn_norm.weight"), norm_eps),
        p("attn.wqkv.weight"),
        p("attn.wo.weight"),
        n_heads,
        cos,
        sin,
    )
    h = h.transpose(0, 1)  # [S, B, H]: the MoE sees tokens in the ranks' order
    a = rms_norm(h, p("moe_norm.weight"), norm_eps).reshape(S * B, H)
    moe_w = dict(
        shared_w1=p("moe.shared_experts.gate_up_proj"),
        shared_w2=p("moe.shared_experts.down_proj"),
        b1=p("moe.experts.gate_up_bias"),
        b2=p("moe.experts.down_bias"),
    )
    w1, w2 = p("moe.experts.gate_up_proj"), p("moe.experts.down_proj")
    bias = p("moe.router.e_score_correction_bias")
    if topk_ids is None:
        y, aux, route = reference.moe_layer(
            a, p("moe.router.weight"), w1, w2, moe_cfg, bias, return_route=True, **moe_w
        )
    else:
        y, aux, route = _reference_moe_forced(
            a, p("moe.router.weight"), w1, w2, moe_cfg, bias, topk_ids, moe_w
        )
    y = h + y.reshape(S, B, H)
    return (y, aux, route) if return_route else (y, aux)


def _reference_moe_forced(a_TH, router_w, w1, w2, cfg: MoEConfig, bias, topk_ids, moe_w):
    """``reference.moe_layer`` with the top-k ids imposed (see :func:`reference_block`)."""
    T, K = a_TH.shape[0], cfg.top_k
    ids = topk_ids.to(device=a_TH.device, dtype=torch.int64)
    if tuple(ids.shape) != (T, K) or (
        ids.numel() and (ids.min() < 0 or ids.max() >= cfg.num_experts)
    ):
        raise ValueError(f"topk_ids must be [{T}, {K}] ids in [0, {cfg.num_experts})")
    r = reference.route(a_TH, router_w, cfg, bias)
    w = r.scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    y = reference.experts(a_TH, ids, w, w1, w2, cfg.activation, moe_w["b1"], moe_w["b2"])
    if cfg.n_shared_experts > 0:
        y = y + reference.shared_experts(
            a_TH, moe_w["shared_w1"], moe_w["shared_w2"], cfg.activation
        )
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=cfg.num_experts).to(a_TH.device)
    f = counts.to(r.scores.dtype) / max(T * K, 1)
    lb = cfg.num_experts * (f * reference.balance_scores(r.scores, cfg).sum(0) / max(T, 1)).sum()
    aux = cfg.aux_loss_coef * lb + cfg.z_loss_coef * r.z_loss
    route = r._replace(topk_ids=ids, topk_weights=w, aux_loss=lb, counts=counts)
    return y, aux, route
