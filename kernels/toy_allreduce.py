"""Toy fused op: all-reduce by pushing tiles into every peer, one flag per (source, tile).

Proves the machinery end to end (pointer tables, ready handshake, per-tile flags, bounded waits,
role switch) with the smallest possible data path; the MoE and TP kernels use the same pieces.

Protocol (rank r, tiles t of the [M, N] input):
  producer program t: wait until every destination d published ready epoch >= ours, then store
    tile t of x into d's buffer slot [r] and ``signal_set(flag[r * n_tiles + t], 1)`` on d.
  consumer program t: for s in 0..W-1 wait ``flag[s * n_tiles + t] >= 1`` (own flags, reset by
    ``World.begin_op``), then sum the W slots in rank order (deterministic, no atomics on data).
Producers have the low program ids so a launch with both roles schedules them first.
"""

import triton
import triton.language as tl

from .launch import launch
from .signals import peer_ptr, signal_set, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_CONSUME = tl.constexpr(2)


@triton.jit(do_not_specialize=["rank", "budget"])
def _push_allreduce_kernel(
    x_ptr,
    out_ptr,
    buf_local,
    buf_table,
    flag_table,
    flags_local,
    pad_local,
    epoch_ptr,
    err_ptr,
    M,
    N,
    rank,
    budget,
    W: tl.constexpr,
    ROLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * n_n
    is_producer = (ROLE == 1) | ((ROLE == 0) & (pid < n_tiles))
    t = pid
    if ROLE == 0:
        t = pid % n_tiles
    rows = (t // n_n) * BM + tl.arange(0, BM)
    cols = (t % n_n) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    if is_producer:
        epoch = tl.load(epoch_ptr)
        tile = tl.load(x_ptr + offs, mask=mask)
        for d in range(W):
            ok = wait_geq(pad_local + d, epoch, err_ptr, rank, STAGE_READY, d, budget, USE_TIMER)
            if ok:
                dst = peer_ptr(buf_table, d, x_ptr.dtype.element_ty)
                tl.store(dst + rank * M * N + offs, tile, mask=mask)
                flags = peer_ptr(flag_table, d, tl.int32)
                signal_set(flags + rank * n_tiles + t, 1)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        nbad = tl.zeros((), tl.int32)
        for s in range(W):
            ok = wait_geq(
                flags_local + s * n_tiles + t,
                1,
                err_ptr,
                rank,
                STAGE_CONSUME,
                s * n_tiles + t,
                budget,
                USE_TIMER,
            )
            nbad += tl.where(ok, 0, 1)
            part = tl.load(buf_local + s * M * N + offs, mask=mask, other=0.0)
            acc += part.to(tl.float32)
        if nbad > 0:
            acc = tl.full((BM, BN), float("nan"), tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_push_allreduce(
    x,
    out,
    buf_local,
    buf_table,
    flag_table,
    flags_local,
    pad_local,
    epoch,
    err,
    rank,
    world_size,
    budget,
    role,
    use_timer,
    block=(16, 32),
):
    """Launch one role (0 both, 1 producer, 2 consumer) of the toy all-reduce."""
    M, N = x.shape
    BM, BN = block
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = (2 * n_tiles if role == 0 else n_tiles,)
    launch(
        _push_allreduce_kernel,
        grid,
        x,
        out,
        buf_local,
        buf_table,
        flag_table,
        flags_local,
        pad_local,
        epoch,
        err,
        M,
        N,
        rank,
        budget,
        W=world_size,
        ROLE=role,
        BM=BM,
        BN=BN,
        USE_TIMER=use_timer,
    )
    return n_tiles
