"""The router's top-k: scores, selection, renormalization and counts in one pass over the logits,
and its backward in one more.

Forward (``route_topk``), one program per ``BT`` tokens, the ``[BT, E]`` logits tile in
registers: softmax (or sigmoid) scores, ``sel = scores + bias``, then K rounds of "largest
``sel``, lowest expert id among equals" (the stable descending sort's tie rule, so the ids are
the torch router's), the chosen scores gathered, renormalized and scaled; the per-expert counts
of the tile go out as one integer atomic per expert (deterministic). Writes ``ids [T, K]``
int64, ``w [T, K]`` fp32 and adds into ``counts [E]`` int64.

Backward (``route_topk_backward``): recomputes the scores from the logits and takes ``d w``
(and optionally ``d logits`` from other uses of the logits, the aux and z losses) to
``d logits``: with ``g_k = s[id_k]`` and ``S = sum_k g_k``, renormalized
``d g_k = c / (S + eps) * (dw_k - sum_j dw_j g_j / (S + eps))``; softmax
``d l = s * (d s - <d s, s>)``, sigmoid ``d l = d s * s * (1 - s)``. It writes ``d logits`` in
fp32, or, for the bf16 logits GEMMs (``moe_overlap.dispatch.router``), split into ``hi | lo``
bf16 halves of one ``[T, 2E]`` tensor, ready for the two GEMMs.

Why: the torch router ran a stable sort over ``[T, E]`` (0.09 ms at qwen3-30b-a3b, 16k tokens,
E 128 on the H200), a gather, the renormalization, the counts' scatter-add and their backward
as about twenty small launches. Measured on the H200 (2026-12-04, BENCHMARKS.md): the bf16
``MoELayer`` forward+backward at qwen3-30b-a3b 7.95 -> 7.76 ms, olmoe 9.74 -> 9.27 ms.
Tests hold the ids bitwise equal to the stable sort's (ties included) on the CPU, and equal
except at fp32-rounding ties at benchmark sizes on the GPU.

Not under ``torch.compile`` (the router keeps its torch form there) and not for group-limited
routing, which selects groups first.

A row whose scores are NaN has no largest element: its ids fall back to in-range experts (the
lowest id not yet taken), so a NaN input can never index out of bounds downstream.
"""

import torch
import triton
import triton.language as tl

from .launch import launch

EPS = 1e-20


@triton.jit
def _tile_scores(logits_ptr, T, E, stride_l, BT: tl.constexpr, BE: tl.constexpr,
                 SIGMOID: tl.constexpr):  # fmt: skip
    """This program's ``BT`` tokens: their ids (int64), row mask, the expert ids and mask, the
    tile mask and the ``[BT, BE]`` scores (softmax or sigmoid of the logits; 0 outside the
    tile: padding columns score nothing, padding rows are never stored)."""
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = toks < T
    t64 = toks.to(tl.int64)
    es = tl.arange(0, BE)
    em = es < E
    m2 = tm[:, None] & em[None, :]
    # padding columns -inf (no share of a softmax), padding rows 0 (finite)
    l = tl.load(logits_ptr + t64[:, None] * stride_l + es[None, :], mask=m2, other=0.0)
    l = tl.where(em[None, :], l, float("-inf"))
    if SIGMOID:
        s = tl.sigmoid(l)
    else:
        m = tl.max(l, axis=1)
        p = tl.exp(l - m[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    return t64, tm, es, em, m2, tl.where(m2, s, 0.0)


@triton.jit
def _topk_fwd_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    counts_ptr,
    T,
    E,
    scale,
    stride_l,
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
):
    t64, tm, es, em, m2, s = _tile_scores(logits_ptr, T, E, stride_l, BT, BE, SIGMOID)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + es, mask=em, other=0.0)[None, :]
    sel = tl.where(em[None, :], sel, float("-inf"))
    taken = tl.zeros((BT, BE), tl.int32) != 0
    ks = tl.arange(0, KP)
    ids = tl.zeros((BT, KP), tl.int32)
    gs = tl.zeros((BT, KP), tl.float32)
    hist = tl.zeros((BE,), tl.int32)
    for k in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), sel), axis=1)
        hit = (sel == best[:, None]) & ~taken & em[None, :]
        idx = tl.min(tl.where(hit, es[None, :], BE), axis=1)
        # no hit (a NaN row): the lowest id not taken yet
        free = tl.min(tl.where(~taken & em[None, :], es[None, :], BE), axis=1)
        idx = tl.where(idx < BE, idx, free)
        one = es[None, :] == idx[:, None]
        taken = taken | one
        g = tl.sum(tl.where(one, s, 0.0), axis=1)
        ids = tl.where(ks[None, :] == k, idx[:, None], ids)
        gs = tl.where(ks[None, :] == k, g[:, None], gs)
        hist += tl.sum((one & tm[:, None]).to(tl.int32), axis=0)
    w = gs
    if NORM:
        w = w / (tl.sum(gs, axis=1)[:, None] + 1e-20)
    w = w * scale
    out = t64[:, None] * K + ks[None, :]
    om = tm[:, None] & (ks < K)[None, :]
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=om)
    tl.store(w_ptr + out, w, mask=om)
    tl.atomic_add(counts_ptr + es, hist.to(tl.int64), mask=em & (hist > 0))


@triton.jit
def _topk_bwd_kernel(
    logits_ptr,
    ids_ptr,
    dw_ptr,
    dl_in_ptr,
    out_ptr,
    T,
    E,
    scale,
    stride_l,
    stride_din,
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORM: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DL: tl.constexpr,
    SPLIT: tl.constexpr,
):
    t64, tm, es, em, m2, s = _tile_scores(logits_ptr, T, E, stride_l, BT, BE, SIGMOID)
    dl = tl.zeros((BT, BE), tl.float32)
    if HAS_DW:
        ks = tl.arange(0, KP)
        kk = t64[:, None] * K + ks[None, :]
        km = tm[:, None] & (ks < K)[None, :]
        ids = tl.load(ids_ptr + kk, mask=km, other=0).to(tl.int32)
        dw = tl.load(dw_ptr + kk, mask=km, other=0.0)
        gs = tl.zeros((BT, KP), tl.float32)
        for k in tl.static_range(K):
            idk = tl.sum(tl.where(ks[None, :] == k, ids, 0), axis=1)
            g = tl.sum(tl.where(es[None, :] == idk[:, None], s, 0.0), axis=1)
            gs = tl.where(ks[None, :] == k, g[:, None], gs)
        if NORM:
            den = tl.sum(gs, axis=1) + 1e-20
            dg = scale / den[:, None] * (dw - (tl.sum(dw * gs, axis=1) / den)[:, None])
        else:
            dg = scale * dw
        ds = tl.zeros((BT, BE), tl.float32)
        for k in tl.static_range(K):
            idk = tl.sum(tl.where(ks[None, :] == k, ids, 0), axis=1)
            dgk = tl.sum(tl.where(ks[None, :] == k, dg, 0.0), axis=1)
            ds += tl.where(es[None, :] == idk[:, None], dgk[:, None], 0.0)
        if SIGMOID:
            dl = ds * s * (1.0 - s)
        else:
            dl = s * (ds - tl.sum(dg * gs, axis=1)[:, None])
    if HAS_DL:
        dl += tl.load(dl_in_ptr + t64[:, None] * stride_din + es[None, :], mask=m2, other=0.0)
    if SPLIT:
        hi = dl.to(tl.bfloat16, fp_downcast_rounding="rtne")
        lo = (dl - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        dst = out_ptr + t64[:, None] * (2 * E) + es[None, :]
        tl.store(dst, hi, mask=m2)
        tl.store(dst + E, lo, mask=m2)
    else:
        tl.store(out_ptr + t64[:, None] * E + es[None, :], dl, mask=m2)


def _blocks(E: int, interpreted: bool) -> tuple[int, int]:
    BE = max(triton.next_power_of_2(E), 2)
    cap = 1024 if interpreted else 4096  # elements of the [BT, BE] tile per program
    return max(1, min(64, cap // BE)), BE


def route_topk(
    logits_TE: torch.Tensor,
    k: int,
    sigmoid: bool,
    norm: bool,
    scale: float,
    bias_E: torch.Tensor | None = None,
    interpreted: bool = False,
):
    """``(ids [T, K] int64, w [T, K] fp32, counts [E] int64)`` from fp32 ``logits_TE`` (rows
    contiguous). ``bias_E`` fp32 ``[E]`` shifts the selection only. No autograd here: see
    ``moe_overlap.dispatch.router``."""
    T, E = logits_TE.shape
    if logits_TE.dtype != torch.float32 or logits_TE.stride(1) != 1:
        raise ValueError("route_topk needs fp32 logits with contiguous rows")
    if not 1 <= k <= E:
        raise ValueError(f"top-k {k} must be in [1, {E}]")
    dev = logits_TE.device
    if bias_E is not None:
        if bias_E.shape != (E,) or bias_E.dtype != torch.float32 or bias_E.device != dev:
            raise ValueError(
                f"bias_E must be fp32 [{E}] on {dev}, got {bias_E.dtype} "
                f"{list(bias_E.shape)} on {bias_E.device}"
            )
        bias_E = bias_E.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=dev)
    w = torch.empty(T, k, dtype=torch.float32, device=dev)
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    if T == 0:
        return ids, w, counts
    BT, BE = _blocks(E, interpreted)
    launch(
        _topk_fwd_kernel,
        (triton.cdiv(T, BT),),
        logits_TE,
        bias_E if bias_E is not None else logits_TE,
        ids,
        w,
        counts,
        T,
        E,
        float(scale),
        logits_TE.stride(0),
        K=k,
        KP=triton.next_power_of_2(k),
        BT=BT,
        BE=BE,
        SIGMOID=sigmoid,
        HAS_BIAS=bias_E is not None,
        NORM=norm,
        num_warps=4,
    )
    return ids, w, counts


def route_topk_backward(
    logits_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    dw_TK: torch.Tensor | None,
    dl_TE: torch.Tensor | None,
    sigmoid: bool,
    norm: bool,
    scale: float,
    split: bool,
    interpreted: bool = False,
) -> torch.Tensor:
    """``d logits`` from ``d w`` (fp32 ``[T, K]`` or None) plus ``dl_TE`` (fp32 ``[T, E]``,
    gradients of other uses of the logits, or None): fp32 ``[T, E]``, or with ``split`` bf16
    ``[T, 2E]`` whose halves ``hi | lo`` add up to it (16 significant bits)."""
    T, E = logits_TE.shape
    if logits_TE.dtype != torch.float32 or logits_TE.stride(1) != 1:
        raise ValueError("route_topk_backward needs fp32 logits with contiguous rows")
    if ids_TK.dim() != 2 or ids_TK.shape[0] != T or ids_TK.dtype != torch.int64:
        raise ValueError(f"ids_TK must be int64 [{T}, K], got {ids_TK.dtype} {list(ids_TK.shape)}")
    K = ids_TK.shape[1]
    if dw_TK is not None and dw_TK.shape != (T, K):
        raise ValueError(f"dw_TK must be [{T}, {K}], got {list(dw_TK.shape)}")
    if dl_TE is not None and dl_TE.shape != (T, E):
        raise ValueError(f"dl_TE must be [{T}, {E}], got {list(dl_TE.shape)}")
    ids_TK = ids_TK.contiguous()
    dev = logits_TE.device
    if split:
        out = torch.empty(T, 2 * E, dtype=torch.bfloat16, device=dev)
    else:
        out = torch.empty(T, E, dtype=torch.float32, device=dev)
    if T == 0:
        return out
    if dw_TK is not None:
        dw_TK = dw_TK.float().contiguous()
    if dl_TE is not None:
        dl_TE = dl_TE.float()
        if dl_TE.stride(1) != 1:
            dl_TE = dl_TE.contiguous()
    BT, BE = _blocks(E, interpreted)
    launch(
        _topk_bwd_kernel,
        (triton.cdiv(T, BT),),
        logits_TE,
        ids_TK,
        dw_TK if dw_TK is not None else logits_TE,
        dl_TE if dl_TE is not None else logits_TE,
        out,
        T,
        E,
        float(scale),
        logits_TE.stride(0),
        dl_TE.stride(0) if dl_TE is not None else 0,
        K=K,
        KP=triton.next_power_of_2(K),
        BT=BT,
        BE=BE,
        SIGMOID=sigmoid,
        NORM=norm,
        HAS_DW=dw_TK is not None,
        HAS_DL=dl_TE is not None,
        SPLIT=split,
        num_warps=4,
    )
    return out
