"""Gradient of the combine weights: ``d w[a] = <o[slot_of[a]], dy[a // K]>`` in fp32.

``o [S, H]`` holds the expert output rows in slot order (layer 1 saves them), ``dy [T, H]`` the
incoming gradient. One pass reads each kept row of ``o`` once and ``dy`` from L2; the torch
version (``index_select`` of ``o`` into assignment order, then a batched GEMV) wrote and re-read
the whole ``[T*K, H]`` copy: measured on the H200 (qwen3-30b-a3b, 16k tokens, top-8) 0.28 ms
for the copy and 0.60 ms for the GEMV. Dropped assignments (``slot_of < 0``) get 0.

One rank, no bias: the backward's dispatch GEMM already holds ``w * (dy @ w2)`` for every row
in its epilogue beside the saved pre-activations, and ``<o, dy> = <act(pre), dy @ w2>``; so its
epilogue writes one partial sum per (slot, column tile) and :func:`weights_grad_from_partials`
adds them up and divides by ``w``, without reading ``o`` (qwen3-30b-a3b: ``row_dot`` 0.18 ms on
the H200, 2026-12-04). Where ``|w| < DW_MIN_WEIGHT`` (a zero weight leaves nothing to divide)
that assignment takes the ``row_dot`` form in the same kernel.
"""

import torch
import triton
import triton.language as tl

from .launch import launch

# Below this |w| the partials (which carry w) are not divided by it: bf16 rows scaled by such a
# weight could be subnormal, so those assignments read their o row instead.
DW_MIN_WEIGHT = 2.0**-40


@triton.jit
def _dots(
    o_ptr, dy_ptr, a, j, keep, H, K_top, stride_o, stride_dy, BA: tl.constexpr, BH: tl.constexpr
):
    """``[BA]`` fp32: ``<o[j], dy[a // K_top]>`` where ``keep``, else 0 (nothing read)."""
    o_row = o_ptr + tl.maximum(j, 0).to(tl.int64)[:, None] * stride_o
    dy_row = dy_ptr + (a // K_top).to(tl.int64)[:, None] * stride_dy
    acc = tl.zeros((BA, BH), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        m = keep[:, None] & (cols < H)[None, :]
        v = tl.load(o_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(dy_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += v * g
    return tl.sum(acc, axis=1)


@triton.jit
def _row_dot_kernel(
    o_ptr,
    dy_ptr,
    slot_of_ptr,
    out_ptr,
    TK,
    H,
    K_top,
    stride_o,
    stride_dy,
    BA: tl.constexpr,
    BH: tl.constexpr,
):
    a = tl.program_id(0) * BA + tl.arange(0, BA)
    am = a < TK
    j = tl.load(slot_of_ptr + a, mask=am, other=-1)
    d = _dots(o_ptr, dy_ptr, a, j, am & (j >= 0), H, K_top, stride_o, stride_dy, BA, BH)
    tl.store(out_ptr + a, d, mask=am)


def _strided_rows(t: torch.Tensor) -> bool:
    # An empty tensor is read nowhere, whatever its strides.
    return t.numel() > 0 and t.stride(-1) != 1


def row_dot(
    o_SH: torch.Tensor,
    dy_TH: torch.Tensor,
    slot_of_A: torch.Tensor,
    top_k: int,
    interpreted: bool = False,
) -> torch.Tensor:
    """``out [T*K]`` fp32 with ``out[a] = <o[slot_of[a]], dy[a // top_k]>`` (0 where
    ``slot_of[a] < 0``). ``o_SH`` and ``dy_TH``: rows contiguous, same dtype; ``slot_of_A``
    int32 ``[T*K]``."""
    if _strided_rows(o_SH) or _strided_rows(dy_TH):
        raise ValueError("row_dot needs row-contiguous o and dy")
    if o_SH.shape[1] != dy_TH.shape[1]:
        raise ValueError(f"o has {o_SH.shape[1]} columns, dy {dy_TH.shape[1]}")
    TK, H = slot_of_A.numel(), dy_TH.shape[1]
    if TK != dy_TH.shape[0] * top_k:
        raise ValueError(f"slot_of has {TK} entries, expected {dy_TH.shape[0]} x {top_k}")
    out = torch.empty(TK, dtype=torch.float32, device=dy_TH.device)
    if TK == 0:
        return out
    if H == 0 or o_SH.shape[0] == 0:
        return out.zero_()
    BA, BH = (16, 32) if interpreted else (32, 128)
    launch(
        _row_dot_kernel,
        (triton.cdiv(TK, BA),),
        o_SH,
        dy_TH,
        slot_of_A,
        out,
        TK,
        H,
        top_k,
        o_SH.stride(0),
        dy_TH.stride(0),
        BA=BA,
        BH=BH,
    )
    return out


@triton.jit
def _dw_from_partials_kernel(
    part_ptr,
    w_ptr,
    o_ptr,
    dy_ptr,
    slot_of_ptr,
    out_ptr,
    TK,
    H,
    K_top,
    NN,
    stride_o,
    stride_dy,
    w_min,
    BA: tl.constexpr,
    BH: tl.constexpr,
):
    a = tl.program_id(0) * BA + tl.arange(0, BA)
    am = a < TK
    j = tl.load(slot_of_ptr + a, mask=am, other=-1)
    keep = am & (j >= 0)
    w = tl.load(w_ptr + a, mask=am, other=0.0).to(tl.float32)
    p = tl.zeros((BA,), dtype=tl.float32)
    base = part_ptr + tl.maximum(j, 0).to(tl.int64) * NN
    for n in range(NN):
        p += tl.load(base + n, mask=keep, other=0.0)
    fast = keep & (tl.abs(w) >= w_min)
    res = tl.where(fast, p / tl.where(fast, w, 1.0), 0.0)
    slow = keep & (tl.abs(w) < w_min)
    if tl.max(slow.to(tl.int32), axis=0) > 0:
        d = _dots(o_ptr, dy_ptr, a, j, slow, H, K_top, stride_o, stride_dy, BA, BH)
        res = tl.where(slow, d, res)
    tl.store(out_ptr + a, res, mask=am)


def weights_grad_from_partials(
    part_SN: torch.Tensor,
    w_A: torch.Tensor,
    o_SH: torch.Tensor,
    dy_TH: torch.Tensor,
    slot_of_A: torch.Tensor,
    top_k: int,
    interpreted: bool = False,
) -> torch.Tensor:
    """``out [T*K]`` fp32, the same values as :func:`row_dot`, from ``part_SN [S, n]`` fp32:
    ``sum_n part[slot_of[a], n] = w[a] * <o[slot_of[a]], dy[a // top_k]>`` (the dispatch
    GEMM's epilogue wrote it). ``w_A [T*K]`` float: the combine weights; where ``|w[a]| <
    DW_MIN_WEIGHT`` the dot is read from ``o_SH`` / ``dy_TH`` as in :func:`row_dot`."""
    if part_SN.dtype != torch.float32 or part_SN.dim() != 2 or not part_SN.is_contiguous():
        raise ValueError("part_SN must be a contiguous fp32 [S, n] tensor")
    if _strided_rows(o_SH) or _strided_rows(dy_TH):
        raise ValueError("weights_grad_from_partials needs row-contiguous o and dy")
    TK, H = slot_of_A.numel(), dy_TH.shape[1]
    if TK != dy_TH.shape[0] * top_k or w_A.numel() != TK:
        raise ValueError(f"slot_of / w have {TK} / {w_A.numel()} entries, expected T x K")
    out = torch.empty(TK, dtype=torch.float32, device=dy_TH.device)
    if TK == 0:
        return out
    BA, BH = (16, 32) if interpreted else (64, 128)
    launch(
        _dw_from_partials_kernel,
        (triton.cdiv(TK, BA),),
        part_SN,
        w_A,
        o_SH,
        dy_TH,
        slot_of_A,
        out,
        TK,
        H,
        top_k,
        part_SN.shape[1],
        o_SH.stride(0),
        dy_TH.stride(0),
        DW_MIN_WEIGHT,
        BA=BA,
        BH=BH,
    )
    return out
