"""Gather of the rows a layer-0 GEMM used, as an ordinary ``[R, H]`` tensor (for the wgrads).

Row ``r`` of the receive layout is a local token (``row_tok[r] >= 0``: read ``x[tok]``,
optionally times ``row_scale[r]``), a row a peer pushed into the receive buffer
(``row_tok[r] == -1``: copied as is, the producer already scaled it) or padding (-2: zero).

One pass: read each row once, write it once. The torch version (``index_select``, an fp32
multiply, a cast, two ``where`` selects) moved the ``[R, H]`` rows five to seven times; the
product is rounded once from fp32 in both, so the results are bitwise equal.

``row_scale`` (the backward's per-row combine weight) is one launch too: its torch form was
seven small ops, each a launch and a gap on the GPU.
"""

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    recv_ptr,
    tok_ptr,
    scale_ptr,
    out_ptr,
    R,
    H,
    stride_x,
    stride_r,
    stride_o,
    HAS_RECV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < R
    cm = cols < H
    tok = tl.load(tok_ptr + rows, mask=rm, other=-2)
    local = tok >= 0
    src = x_ptr + tl.maximum(tok, 0).to(tl.int64)[:, None] * stride_x + cols[None, :]
    v = tl.load(src, mask=(local & rm)[:, None] & cm[None, :], other=0.0)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + rows, mask=rm & local, other=0.0).to(tl.float32)
        v = (v.to(tl.float32) * sc[:, None]).to(out_ptr.dtype.element_ty)
    if HAS_RECV:
        remote = tok == -1
        rsrc = recv_ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :]
        vr = tl.load(rsrc, mask=(remote & rm)[:, None] & cm[None, :], other=0.0)
        v = tl.where(remote[:, None], vr, v)
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(dst, v.to(out_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


@triton.jit
def _row_scale_kernel(tok_ptr, slot_ptr, sorted_ptr, w_ptr, out_ptr, R, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    tok = tl.load(tok_ptr + r, mask=rm, other=-2)
    local = rm & (tok >= 0)
    j = tl.load(slot_ptr + r, mask=local, other=0)
    a = tl.load(sorted_ptr + j, mask=local, other=0)
    w = tl.load(w_ptr + a, mask=local, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.where(local, w, tl.where(tok == -1, 1.0, 0.0)), mask=rm)


def row_scale(
    row_tok_R: torch.Tensor,
    row_slot_R: torch.Tensor,
    sorted_assign_A: torch.Tensor,
    w_A: torch.Tensor,
    interpreted: bool = False,
) -> torch.Tensor:
    """``[R]`` fp32: ``w[sorted_assign[row_slot[r]]]`` for local rows (``row_tok >= 0``), 1
    for rows peers send (-1, already scaled there), 0 for padding. ``row_tok_R``,
    ``row_slot_R``, ``sorted_assign_A``: int32; ``w_A [T*K]`` any float dtype."""
    R = row_tok_R.shape[0]
    out = torch.empty(R, dtype=torch.float32, device=row_tok_R.device)
    if R == 0:
        return out
    if w_A.numel() == 0:  # no assignments: nothing is local, every load is masked
        w_A = out
    BR = 32 if interpreted else 1024
    launch(
        _row_scale_kernel,
        (triton.cdiv(R, BR),),
        row_tok_R,
        row_slot_R,
        sorted_assign_A if sorted_assign_A.numel() else row_tok_R,
        w_A,
        out,
        R,
        BR=BR,
    )
    return out


def gather_rows(
    x_TH: torch.Tensor,
    row_tok_R: torch.Tensor,
    recv_RH: torch.Tensor | None = None,
    row_scale_R: torch.Tensor | None = None,
    interpreted: bool = False,
    out_RH: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [R, H]`` (dtype of x): ``x[tok] * scale`` for local rows, ``recv`` rows for -1,
    zeros for padding. ``row_tok_R`` int32; ``recv_RH`` at least R rows, row-major;
    ``row_scale_R`` fp32 or None; ``out_RH``: where to write (``[R, H]``, x's dtype, rows
    contiguous), else a new tensor."""
    R, H = row_tok_R.shape[0], x_TH.shape[1]
    for name, t in (("x_TH", x_TH), ("recv_RH", recv_RH)):
        # The kernel steps rows by stride(0) and columns by 1.
        if t is not None and t.numel() and t.stride(1) != 1:
            raise ValueError(f"gather_rows needs {name} with contiguous rows, strides {t.stride()}")
    if out_RH is None:
        out = torch.empty(R, H, dtype=x_TH.dtype, device=x_TH.device)
    else:
        if tuple(out_RH.shape) != (R, H) or out_RH.dtype != x_TH.dtype or out_RH.stride(1) != 1:
            raise ValueError(f"out_RH must be [{R}, {H}] {x_TH.dtype} with contiguous rows")
        out = out_RH
    if R == 0 or H == 0:
        return out
    if x_TH.shape[0] == 0:  # no local rows: any valid pointer will do, every load is masked
        x_TH = out
    BR, BH = (16, 32) if interpreted else (32, 128)
    grid = (triton.cdiv(R, BR), triton.cdiv(H, BH))
    launch(
        _gather_rows_kernel,
        grid,
        x_TH,
        recv_RH if recv_RH is not None else out,
        row_tok_R,
        row_scale_R if row_scale_R is not None else out,
        out,
        R,
        H,
        x_TH.stride(0),
        recv_RH.stride(0) if recv_RH is not None else 0,
        out.stride(0),
        HAS_RECV=recv_RH is not None,
        HAS_SCALE=row_scale_R is not None,
        BR=BR,
        BH=BH,
    )
    return out
