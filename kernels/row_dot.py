"""Gradient of the combine weights: ``d w[a] = <o[slot_of[a]], dy[a // K]>`` in fp32.

``o [S, H]`` holds the expert output rows in slot order (layer 1 saves them), ``dy [T, H]`` the
incoming gradient. One pass reads each kept row of ``o`` once and ``dy`` from L2; the torch
version (``index_select`` of ``o`` into assignment order, then a batched GEMV) wrote and re-read
the whole ``[T*K, H]`` copy: measured on the H200 (qwen3-30b-a3b, 16k tokens, top-8) 0.28 ms
for the copy and 0.60 ms for the GEMV. Dropped assignments (``slot_of < 0``) get 0.
"""

import torch
import triton
import triton.language as tl

from .launch import launch


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
    keep = am & (j >= 0)
    o_row = o_ptr + tl.maximum(j, 0).to(tl.int64)[:, None] * stride_o
    dy_row = dy_ptr + (a // K_top).to(tl.int64)[:, None] * stride_dy
    acc = tl.zeros((BA, BH), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        m = keep[:, None] & (cols < H)[None, :]
        v = tl.load(o_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(dy_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += v * g
    tl.store(out_ptr + a, tl.sum(acc, axis=1), mask=am)


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
    if o_SH.stride(-1) != 1 or dy_TH.stride(-1) != 1:
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
