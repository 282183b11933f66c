"""Count exchange: every rank pushes its per-expert assignment counts to every peer.

After it, every rank holds the full ``[W, E]`` matrix ``cnt_all[s, e]`` (assignments source s
sends to expert e), so every rank can compute every other rank's receive layout and the same
workspace size without another collective: the world's workspace grows collectively and
deterministically.

Protocol: one producer program per rank: wait each destination's ready epoch, store the E
counts into the destination's slot row [rank], ``signal_set(flag[rank], 1)`` there. One
consumer program: wait the W flags of its own pad, copy the matrix out. Stage code 3.

Put path (``PUT``; destinations on other nodes, ``kernels/put.py``): the producer stores its
counts into row [rank] of its *own* buffer (the staging slot: every destination gets the same
row) and puts that row to the same place on the destination with ``SIGNAL_SET`` 1 on int64
word [rank]; the consumer waits that word for sources that reach it by puts.
"""

import triton
import triton.language as tl

from .launch import launch
from .nvshmem_device import quiet
from .put import SIGNAL_SET, put_signal, wait_arrival
from .signals import peer_ptr, signal_set, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_COUNTS = tl.constexpr(3)


@triton.jit
def _store_counts(buf_table, flag_table, c, m, offs, rank, d, E):
    dst = peer_ptr(buf_table, d, tl.int32)
    tl.store(dst + rank * E + offs, c, mask=m)
    signal_set(peer_ptr(flag_table, d, tl.int32) + rank, 1)


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
    sig_local,
    sig_table,
    put_mask_ptr,
    E,
    rank,
    budget,
    W: tl.constexpr,
    ROLE: tl.constexpr,
    BE: tl.constexpr,
    USE_TIMER: tl.constexpr,
    PUT: tl.constexpr = False,
    USE_NVSHMEM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    is_producer = (ROLE == 1) | ((ROLE == 0) & (pid == 0))
    offs = tl.arange(0, BE)
    m = offs < E
    if is_producer:
        epoch = tl.load(epoch_ptr)
        c = tl.load(counts_ptr + offs, mask=m)
        if PUT:
            tl.store(buf_local + rank * E + offs, c, mask=m)  # the put's staging slot
        for d in range(W):
            ok = wait_geq(pad_local + d, epoch, err_ptr, rank, STAGE_READY, d, budget, USE_TIMER)
            if ok:
                if PUT:
                    if tl.load(put_mask_ptr + d) != 0:
                        put_signal(
                            buf_table,
                            rank * E * 4,
                            buf_local + rank * E,
                            E * 4,
                            sig_table,
                            rank,
                            1,
                            rank,
                            d,
                            SIGNAL_SET,
                            USE_NVSHMEM,
                        )
                    else:
                        _store_counts(buf_table, flag_table, c, m, offs, rank, d, E)
                else:
                    _store_counts(buf_table, flag_table, c, m, offs, rank, d, E)
        if USE_NVSHMEM:
            quiet()  # the staged row is rewritten by the next exchange only once delivered
    else:
        for s in range(W):
            ok = wait_arrival(
                flags_local + s,
                sig_local,
                s,
                put_mask_ptr,
                s,
                1,
                err_ptr,
                rank,
                STAGE_COUNTS,
                s,
                budget,
                USE_TIMER,
                PUT,
                USE_NVSHMEM,
            )
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
    sig_local=None,
    sig_table=None,
    put_mask=None,
    use_nvshmem=False,
):
    """``put_mask`` (int32 ``[W]``, 1 = put) turns on the put path, with the op's int64
    signal words ``sig_local`` / ``sig_table`` (``World.begin_op_signals``)."""
    E = counts.numel()
    grid = (2 if role == 0 else 1,)
    put = put_mask is not None
    opts = {}
    if use_nvshmem:
        from .nvshmem_device import compile_options

        opts = compile_options()
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
        sig_local,
        sig_table,
        put_mask,
        E,
        rank,
        budget,
        W=world_size,
        ROLE=role,
        BE=triton.next_power_of_2(max(E, 16)),
        USE_TIMER=use_timer,
        PUT=put,
        USE_NVSHMEM=bool(use_nvshmem),
        **opts,
    )
