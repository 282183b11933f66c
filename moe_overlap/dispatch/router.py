"""``Router``: fp32 top-k gate with group-limited routing, correction bias, capacity and aux losses.

The rules are those of ``moe_overlap.reference`` (its module docstring is the contract); this is
an independent, vectorized implementation of them:

* No Python loop over tokens and no host sync (no ``.item()``, ``nonzero``, boolean-mask
  indexing or ``bincount``, whose output size depends on the data): the forward is CUDA-graph
  capturable. Shapes depend only on ``T`` (a host int), including the capacity.
* Selection sorts the selection scores with a *stable* descending sort and keeps the first K,
  so an exact tie goes to the lower expert id (group-limited: the lower group id), matching the
  reference. ``torch.topk`` leaves ties unspecified.
* fp32 logits without group-limited routing, on CUDA (or in the Triton interpreter), take two
  kernels instead (``kernels/router_topk.py``): scores, the same tie rule by repeated argmax,
  renormalization, scaling and the counts in one pass, and the backward to ``d logits`` in
  another (split for the bf16 GEMMs below). They replace a stable sort over ``[T, E]`` and about
  twenty small launches; tests hold their ids bitwise equal to the sort's, ties included.
  ``torch.compile`` keeps the torch form.
* Capacity: the ``T*K`` assignments are laid out choice-rank-major (``j = k*T + t``), sorted
  stably by expert id, and each one's position inside its expert's run is ``j_sorted -
  run_start``; an assignment is kept when that position is below the capacity.
* Logits are fp32 whatever ``x``'s dtype (float64 stays float64 so tests can compare tightly);
  ``topk_weights`` are float32 (float64 for float64 input) and differentiable to the weight.
* ``aux_loss`` is already scaled: ``aux_loss_coef * load_balance + z_loss_coef * z_loss``. A
  term whose coefficient is 0 is skipped; with both 0 the result is a constant 0 tensor with no
  autograd history.
* bf16 ``x`` with a bf16 weight (a bf16 ``MoELayer``) takes :func:`router_logits`: a product of
  two bf16 values is exact in fp32, so one GEMM on the bf16 operands with an fp32 result gives
  the fp32 logits of the same values, without the fp32 copy of ``x`` and on tensor cores
  instead of fp32 SIMT. Only the accumulation differs: the H200's tensor cores add with less
  care than fp32 FMAs (relative error 1.4e-6 against 1.1e-7 at T 16384, H 2048; bf16 ``x``
  itself carries 4e-3). The backward splits ``d logits`` into two bf16 terms (``hi + lo``, 16
  significant bits) and runs both GEMMs the same way; ``dx`` and ``d weight`` come out within
  one bf16 rounding of float64. On the H200 (BENCHMARKS.md, 2026-12-04 evening) the router's
  three GEMMs now take 0.09 ms of a qwen3-30b-a3b forward+backward step (the fp32 path's took
  0.58); in one call the bf16 ``MoELayer`` ran that step in 7.95 ms against 8.38 for the same
  fused experts behind the benchmark's fp32 torch router (it was 1-2% slower than them before).

Initialization (:func:`init_router_weight_`): normal, mean 0, std 0.02 (the usual transformer
``initializer_range``), drawn in fp32 on the generator's device and then cast, so every dtype and
every world size starts from the same numbers for one seed.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
from torch import nn

from ..config import MoEConfig, expert_capacity
from ..kernels.launch import warmup_only
from ..kernels.router_topk import route_topk, route_topk_backward
from ..world.base import interpreted, launch_lock

__all__ = ["Router", "RouterOutput", "init_router_weight_", "router_logits", "ROUTER_INIT_STD"]

ROUTER_INIT_STD = 0.02


class RouterOutput(NamedTuple):
    topk_ids: torch.Tensor  # [T, K] int64 global expert ids, -1 = capacity drop
    topk_weights: torch.Tensor  # [T, K] float32, 0 where dropped, differentiable
    aux_loss: torch.Tensor  # scalar, already scaled by the config's coefficients
    counts: torch.Tensor  # [E] int64 assignments kept per expert (this rank)


@torch.no_grad()
def init_router_weight_(
    weight: torch.Tensor, generator: torch.Generator | None = None, std: float = ROUTER_INIT_STD
) -> torch.Tensor:
    """Fill ``weight`` in place with N(0, std^2) drawn in fp32 on ``generator``'s device."""
    dev = generator.device if generator is not None else torch.device("cpu")
    vals = torch.randn(weight.shape, generator=generator, dtype=torch.float32, device=dev)
    weight.copy_(vals * std)
    return weight


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16 matrices with an fp32 result: on CUDA one tensor-core GEMM with
    fp32 output; elsewhere (CPU, meta) the fp32 GEMM of the same values, which is the same
    arithmetic."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _split_bf16(v_TE: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, E]`` -> bf16 ``[T, 2E]``: ``hi | lo`` with ``hi + lo`` equal to ``v`` to 16
    significant bits."""
    T, E = v_TE.shape
    out = torch.empty(T, 2 * E, dtype=torch.bfloat16, device=v_TE.device)
    out[:, :E] = v_TE
    out[:, E:] = v_TE - out[:, :E].float()
    return out


def _logits_grads(d, x_TH, w_EH, needs):
    """``(dx, d weight)`` of ``logits = x @ w^T`` from ``d``: bf16 ``[T, 2E]`` (``hi | lo``, the
    bf16 path) or fp32 ``[T, E]``; None where ``needs`` says no."""
    dx = dw = None
    if d.dtype == torch.bfloat16:
        E = w_EH.shape[0]
        if needs[0]:
            w2 = torch.cat([w_EH, w_EH], dim=0)  # [2E, H]
            # One rounding to bf16, like the fp32 path's cast of its fp32 dx: cuBLAS
            # accumulates in fp32 and splits no K this short (2E).
            dx = (d @ w2) if d.is_cuda else _mm_f32(d, w2).to(x_TH.dtype)
        if needs[1]:
            dw2 = _mm_f32(d.t(), x_TH)  # [2E, H]
            dw = (dw2[:E] + dw2[E:]).to(w_EH.dtype)
        return dx, dw
    if needs[0]:
        dx = (d @ w_EH.to(d.dtype)).to(x_TH.dtype)
    if needs[1]:
        dw = (d.t() @ x_TH.to(d.dtype)).to(w_EH.dtype)
    return dx, dw


def _bf16_pair(x_TH, w_EH) -> bool:
    return x_TH.dtype == torch.bfloat16 and w_EH.dtype == torch.bfloat16


def _logits(x_TH, w_EH) -> torch.Tensor:
    """fp32 logits without autograd (the two Functions below)."""
    with _no_autocast(x_TH):
        if _bf16_pair(x_TH, w_EH):
            return _mm_f32(x_TH, w_EH.t())
        return x_TH.float() @ w_EH.float().t()


def _no_autocast(x):
    """The logits stay fp32 inside a caller's ``torch.autocast`` region, which would otherwise
    run their GEMM in its low-precision dtype (and route on rounded logits)."""
    try:
        on = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type without autocast (meta)
        on = False
    return torch.autocast(x.device.type, enabled=False) if on else contextlib.nullcontext()


class _Bf16Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        return _logits(x_TH, w_EH)

    @staticmethod
    def backward(ctx, d_TE):
        x_TH, w_EH = ctx.saved_tensors
        d2 = _split_bf16(d_TE.float().contiguous())  # [T, 2E]: d = d2[:, :E] + d2[:, E:]
        return _logits_grads(d2, x_TH, w_EH, ctx.needs_input_grad)


_WARM_BWD: set = set()


class _RouteFn(torch.autograd.Function):
    """Logits, scores, top-k, renormalization and counts with two kernels beside the GEMMs
    (``kernels/router_topk.py``). Outputs ``(logits, ids, w, counts)``; gradients flow from
    ``w`` and from ``logits`` (the aux and z losses use them) to ``x`` and the weight."""

    @staticmethod
    def forward(ctx, x_TH, w_EH, bias_E, k, sigmoid, norm, scale):
        logits = _logits(x_TH, w_EH)
        interp = interpreted()
        with launch_lock():  # emulated ranks are threads; the interpreter is not thread-safe
            ids, tw, counts = route_topk(logits, k, sigmoid, norm, scale, bias_E, interp)
        ctx.save_for_backward(x_TH, w_EH, logits, ids)
        ctx.mark_non_differentiable(ids, counts)
        ctx.set_materialize_grads(False)
        ctx.args = (sigmoid, norm, scale, _bf16_pair(x_TH, w_EH), interp)
        if logits.is_cuda and any(ctx.needs_input_grad[:2]):
            _warm_backward(logits, ids, ctx.args)
        return logits, ids, tw, counts

    @staticmethod
    def backward(ctx, d_logits, _d_ids, d_w, _d_counts):
        x_TH, w_EH, logits, ids = ctx.saved_tensors
        sigmoid, norm, scale, split, interp = ctx.args
        if d_logits is None and d_w is None:
            return None, None, None, None, None, None, None
        with launch_lock():
            d = route_topk_backward(logits, ids, d_w, d_logits, sigmoid, norm, scale, split, interp)
        dx, dw = _logits_grads(d, x_TH, w_EH, ctx.needs_input_grad)
        return dx, dw, None, None, None, None, None


def _warm_backward(logits, ids, args) -> None:
    """Compile and load the backward kernel's variants in the forward (once each): emulated
    ranks run their backward while peers' kernels may spin, and a first CUDA module load then
    can wait for them (``kernels/launch.py``)."""
    sigmoid, norm, scale, split, interp = args
    for has_dl in (False, True):
        key = (logits.device, logits.shape[1], ids.shape[1], sigmoid, norm, split, has_dl)
        if key in _WARM_BWD:
            continue
        dl = logits if has_dl else None
        dw = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
        with warmup_only():
            route_topk_backward(logits, ids, dw, dl, sigmoid, norm, scale, split, interp)
        _WARM_BWD.add(key)


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``x_TH [T, H] @ w_EH [E, H]^T`` -> ``[T, E]``, differentiable to both.

    bf16 x and bf16 w: exact-product GEMMs on tensor cores (module docstring). Any other pair
    runs in fp32 (float64 where either is float64)."""
    if x_TH.dtype == torch.bfloat16 and w_EH.dtype == torch.bfloat16:
        return _Bf16Logits.apply(x_TH, w_EH)
    cd = torch.float64 if torch.float64 in (x_TH.dtype, w_EH.dtype) else torch.float32
    with _no_autocast(x_TH):
        return x_TH.to(cd) @ w_EH.to(cd).t()


def balance_scores(scores_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Scores averaged into the load-balance ``P_e``: raw, or over each token's sum
    (``cfg.aux_loss_scores``, see ``moe_overlap.config``). ``reference.balance_scores`` is the
    tests' copy of this rule, kept apart on purpose (the reference shares no code with the fast
    paths)."""
    if cfg.aux_loss_scores == "normalized":
        return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    return scores_TE


def _stable_topk_desc(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


class Router(nn.Module):
    """Top-k router of one MoE layer.

    ``weight [E, H]`` (Parameter, ``dtype`` default float32); with ``cfg.router_bias`` also a
    buffer ``e_score_correction_bias [E]`` float32 (zeros; updated by the training loop, used
    for selection only).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        dtype: torch.dtype | None = None,
        device=None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dtype = torch.float32 if dtype is None else dtype
        E, H = cfg.num_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H, dtype=dtype, device=device))
        init_router_weight_(self.weight, generator)
        if cfg.router_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(E, dtype=torch.float32, device=device)
            )
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` casts buffers too: the correction bias stays fp32, as
        # the rest of routing, or its small updates (DeepSeek-V3: 1e-3) round away. The cast
        # copy has already lost those bits, so the fp32 original only follows the device.
        old = self.e_score_correction_bias
        super()._apply(fn, recurse)
        b = self.e_score_correction_bias
        if b is not None and b.is_floating_point() and b.dtype != torch.float32:
            src = old if old is not None and old.dtype == torch.float32 else b
            self.e_score_correction_bias = src.to(device=b.device, dtype=torch.float32)
        return self

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"E={c.num_experts}, H={c.hidden_size}, top_k={c.top_k}, "
            f"score_func={c.score_func}, bias={c.router_bias}"
        )

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating tensor, got {x.dtype}")
        H = self.cfg.hidden_size
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"x must be [T, {H}], got {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"x is on {x.device} but the router weight is on {self.weight.device}")

    def _kernel_path(self, x_TH: torch.Tensor, cd: torch.dtype) -> bool:
        """Whether the top-k runs as ``kernels/router_topk.py``: fp32 logits (float64 keeps the
        torch path, which tests compare tightly), no group-limited routing, on CUDA or in the
        Triton interpreter (the CPU suite); not under ``torch.compile``, which traces the torch
        path and fuses its small ops itself. ``MOE_OVERLAP_ROUTER_KERNEL=0`` turns it off."""
        if cd != torch.float32 or self.cfg.n_group is not None:
            return False
        if torch.compiler.is_compiling():
            return False
        if os.environ.get("MOE_OVERLAP_ROUTER_KERNEL", "1") == "0":
            return False
        dev = x_TH.device.type
        return dev == "cuda" or (dev == "cpu" and interpreted())

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        """Route ``x_TH [T, H]`` (any float dtype). See the module docstring for the rules."""
        self._check(x_TH)
        cfg = self.cfg
        T = x_TH.shape[0]
        E, K = cfg.num_experts, cfg.top_k
        cd = torch.float64 if torch.float64 in (x_TH.dtype, self.weight.dtype) else torch.float32
        sigmoid = cfg.score_func == "sigmoid"
        scores = None
        if self._kernel_path(x_TH, cd):
            bias = self.e_score_correction_bias
            logits, ids, w, all_counts = _RouteFn.apply(
                x_TH,
                self.weight,
                None if bias is None else bias.float().contiguous(),
                K,
                sigmoid,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        else:
            logits = router_logits(x_TH, self.weight)
            scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
            sel = scores.detach()
            if self.e_score_correction_bias is not None:
                sel = sel + self.e_score_correction_bias.to(cd)
            if cfg.n_group is not None:
                G = cfg.n_group
                grouped = sel.view(T, G, E // G)
                top2 = grouped.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # [T, G]
                keep_g = _stable_topk_desc(top2, cfg.topk_group)
                gmask = torch.zeros(T, G, dtype=torch.bool, device=sel.device)
                gmask.scatter_(1, keep_g, True)
                emask = gmask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
                sel = sel.masked_fill(~emask, float("-inf"))
            ids = _stable_topk_desc(sel, K)  # [T, K] int64, best first

            w = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            if cfg.routed_scaling_factor != 1.0:
                w = w * cfg.routed_scaling_factor

            ones = torch.ones(T * K, dtype=torch.int64, device=ids.device)
            all_counts = torch.zeros(E, dtype=torch.int64, device=ids.device)
            all_counts.scatter_add_(0, ids.reshape(-1), ones)

        if cfg.capacity_factor is not None:
            cap = expert_capacity(T, K, E, cfg.capacity_factor)
            flat = ids.t().reshape(-1)  # j = k*T + t: choice rank first, then token
            order = torch.sort(flat, stable=True).indices
            run_start = torch.cumsum(all_counts, 0) - all_counts  # [E]
            pos_sorted = torch.arange(T * K, device=ids.device) - run_start[flat[order]]
            pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
            kept = (pos < cap).view(K, T).t()  # [T, K]
            ids = torch.where(kept, ids, torch.full_like(ids, -1))
            w = torch.where(kept, w, torch.zeros_like(w))
            counts = torch.clamp(all_counts, max=cap)
        else:
            counts = all_counts

        aux = None
        if cfg.aux_loss_coef != 0.0:
            f = all_counts.to(cd) / max(T * K, 1)
            if scores is None:
                scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
            P = balance_scores(scores, cfg).sum(dim=0) / max(T, 1)
            aux = cfg.aux_loss_coef * (E * (f * P).sum())
        if cfg.z_loss_coef != 0.0:
            z = torch.logsumexp(logits, dim=-1).square().sum() / max(T, 1)
            aux = cfg.z_loss_coef * z if aux is None else aux + cfg.z_loss_coef * z
        if aux is None:
            aux = logits.new_zeros(())
        if cd != torch.float64:
            w = w.float()
            aux = aux.float()
        return RouterOutput(ids, w, aux, counts)
