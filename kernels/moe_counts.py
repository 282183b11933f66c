"""Count exchange: every rank pushes its per-expert assignment counts to every peer.

After it, every rank holds the full ``[W, E]`` matrix ``cnt_all[s, e]`` (assignments source s
sends to expert e), so every rank can compute every other rank's receive layout and the same
workspace size without another collective: the world's workspace grows collectively and
deterministically.

Protocol: one producer program per rank: wait each destination's ready epoch, store the E
counts into the destination's slot row [rank], ``signal_set(flag[rank], 1)`` there. One
consumer program: wait the W flags of its own pad, copy the matrix out. Stage code 3.
"""

import triton
import triton.language as tl

from .launch import launch
from .signals import peer_ptr, signal_set, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_COUNTS = tl.constexpr(3)


@triton.jit(do_not_specialize=["rank", "budget"])
def _count_exchange_kernel(
    counts_ptr,
    out_ptr,
    buf_local,
    buf_table,
    flags_local,
    flag_table,
    pad_local,
    epoch_ptr,
    err_ptr,
    E,
    rank,
    budget,
    W: tl.constexpr,
    ROLE: tl.constexpr,
    BE: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    pid = tl.program_id(0)
    is_producer = (ROLE == 1) | ((ROLE == 0) & (pid == 0))
    offs = tl.arange(0, BE)
    m = offs < E
    if is_producer:
        epoch = tl.load(epoch_ptr)
        c = tl.load(counts_ptr + offs, mask=m)
        for d in range(W):
            ok = wait_geq(pad_local + d, epoch, err_ptr, rank, STAGE_READY, d, budget, USE_TIMER)
            if ok:
                dst = peer_ptr(buf_table, d, tl.int32)
                tl.store(dst + rank * E + offs, c, mask=m)
                signal_set(peer_ptr(flag_table, d, tl.int32) + rank, 1)
    else:
        for s in range(W):
            ok = wait_geq(flags_local + s, 1, err_ptr, rank, STAGE_COUNTS, s, budget, USE_TIMER)
            v = tl.load(buf_local + s * E + offs, mask=m)
            # A timed-out row reads as -1: layout code treats negative counts as an error.
            v = tl.where(ok, v, -1)
            tl.store(out_ptr + s * E + offs, v, mask=m)


def launch_count_exchange(
    counts,
    out,
    buf_local,
    buf_table,
    flags_local,
    flag_table,
    pad_local,
    epoch,
    err,
    rank,
    world_size,
    budget,
    role,
    use_timer,
):
    E = counts.numel()
    grid = (2 if role == 0 else 1,)
    launch(
        _count_exchange_kernel,
        grid,
        counts,
        out,
        buf_local,
        buf_table,
        flags_local,
        flag_table,
        pad_local,
        epoch,
        err,
        E,
        rank,
        budget,
        W=world_size,
        ROLE=role,
        BE=triton.next_power_of_2(max(E, 16)),
        USE_TIMER=use_timer,
    )
