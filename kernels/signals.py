"""Signal primitives: publish with release, poll with acquire, every wait bounded.

Flag contract
-------------
* Flags are int32 words in symmetric memory. A producer publishes with
  ``atomic_xchg(..., sem="release", scope="sys")`` (``signal_set``) or ``atomic_add``
  (``signal_add``); a consumer polls with ``atomic_add(flag, 0, sem="acquire", scope="sys")``.
  These atomics run both in the Triton interpreter and on the GPU.
* A release orders only the issuing thread's earlier stores, and a tile is written by every warp
  of the program, so ``tl.debug_barrier()`` sits before every publish and after every successful
  poll. The interpreter runs one program at a time and cannot show this race; only a GPU test
  with delayed producers that checks the data can.
* Every wait is bounded. ``wait_geq`` gives up after ``budget`` (nanoseconds of ``%globaltimer``
  when ``USE_TIMER``, else loop iterations, as in the interpreter where inline asm does not run),
  writes one error record into the world's error buffer and returns False; the caller marks its
  output (NaN) and leaves. The host raises ``CommTimeoutError`` lazily (``World.check``).
* Budgets are in time on the GPU because a peer's kernel may still be JIT-compiling on the host
  while we spin: measured on the H200, an iteration budget of 10M polls ran out before a
  ``rank=1`` specialization finished compiling. Hence also ``do_not_specialize`` on every
  rank-like argument of kernels that wait.

Error record (int64 words, see ``moe_overlap.errors.ERR_FIELDS``): code (1 = timeout), rank,
stage, flag index, expected, seen. The first failing wait claims the record with a CAS; later
ones leave it alone.
"""

import triton
import triton.language as tl

from .launch import launch

# Reads per now_ns call: >= 32 x the warps of any waiting kernel (8 here) times the elements a
# thread may hold of a 1-D tensor (4), so no warp's share is a replica of another's.
TIMER_SPAN: tl.constexpr = tl.constexpr(1024)


@triton.jit
def gave_up_before(err_ptr):
    """Whether this rank has already recorded a timeout, one answer for the whole program: a
    scalar atomic is issued once and its result shared, where a plain load is made by every
    thread and threads could see the record appear at different moments (and then wait with
    different budgets)."""
    return tl.atomic_add(err_ptr, 0, sem="relaxed") != 0


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    """Global nanosecond timer on the GPU; a constant 0 where inline asm cannot run.

    Every thread reads ``%globaltimer`` itself, and the reads differ: a wait loop whose exit
    depended on them would let threads of one program leave at different iterations and then
    disagree at the CTA barrier (undefined behaviour; seen as an illegal instruction on the
    H200). So the reads are reduced to one value the whole program agrees on: over
    ``TIMER_SPAN`` reads, more than the threads of any program that waits, so every warp holds
    some and the reduction crosses warps through shared memory. Over 32 reads (until
    2026-12-05) each warp of a 4- or 8-warp program reduced only its own copy (a ``redux.sync``,
    no shared-memory step in the PTX), so warps could still leave a timed-out wait apart.
    """
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;",
            "=l,l",
            [tl.zeros([TIMER_SPAN], tl.int64)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
        t = tl.max(t, axis=0)
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def trace_clock(clock_ptr, USE_TIMER: tl.constexpr):
    """Timestamp of a per-tile trace event: ``%globaltimer`` on the GPU, a logical clock (an
    atomic counter, so events stay ordered) in the interpreter."""
    if USE_TIMER:
        t = now_ns(USE_TIMER)
    else:
        t = tl.atomic_add(clock_ptr, 1).to(tl.int64) + 1
    return t


@triton.jit
def trace_record(trace_ptr, n_rows, row, rank, pid, t_start, t_wait, t_end):
    """One event row ``(rank, program, tile, start, wait done, end)`` of a ``[n, 6]`` int64
    trace buffer (``moe_overlap.bench.trace`` reads it); rows past ``n_rows`` are dropped."""
    if row < n_rows:
        base = trace_ptr + row * 6
        tl.store(base + 0, rank)
        tl.store(base + 1, pid)
        tl.store(base + 2, row)
        tl.store(base + 3, t_start)
        tl.store(base + 4, t_wait)
        tl.store(base + 5, t_end)


@triton.jit
def load_acquire(flag_ptr):
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def signal_set(flag_ptr, value):
    """Publish ``value`` after this program's earlier stores (all warps) are visible."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def signal_add(flag_ptr, value):
    """Add ``value`` to a counter flag after this program's earlier stores are visible."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def record_error(err_ptr, rank, stage, index, expected, seen):
    zero = tl.zeros((), tl.int64)
    prev = tl.atomic_cas(err_ptr, zero, zero + 1)
    if prev == 0:
        # Plain stores convert ints, constexprs and tensors alike to the buffer's int64.
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, stage)
        tl.store(err_ptr + 3, index)
        tl.store(err_ptr + 4, expected)
        tl.store(err_ptr + 5, seen)


@triton.jit
def before(seen, target):
    """``seen < target`` modulo the flag's width: the ready epoch is an int32 that wraps after
    2^31 ops, and at the wrap a plain compare would let a stale ``INT32_MAX`` pass a target of
    ``INT32_MIN`` (a producer writing into a destination not ready yet). Right while the two
    are within 2^31 of each other, which every flag here is (counters restart each op)."""
    return (seen - target).to(seen.dtype) < 0


@triton.jit
def wait_geq(flag_ptr, target, err_ptr, rank, stage, index, budget, USE_TIMER: tl.constexpr):
    """Spin until ``*flag_ptr >= target`` (acquire; modulo the flag's width, see ``before``) or
    the budget runs out.

    Returns a scalar bool: True when the flag arrived. On timeout an error record names
    ``rank``, ``stage``, ``index``, ``target`` and the last value seen.
    """
    # Once this rank has recorded a timeout (any program, any stage of the op), later waits
    # look once and give up: a dead peer must cost one budget per op, not one per tile (at 20 s
    # a wait and tens of tiles a program, minutes with no message).
    budget = tl.where(gave_up_before(err_ptr), 0, budget)
    seen = load_acquire(flag_ptr)
    start = now_ns(USE_TIMER)
    spent = start * 0
    while before(seen, target) & (spent < budget):
        seen = load_acquire(flag_ptr)
        if USE_TIMER:
            spent = now_ns(USE_TIMER) - start
        else:
            spent += 1
    ok = (seen - target).to(seen.dtype) >= 0
    if before(seen, target):
        record_error(err_ptr, rank, stage, index, target, seen)
    tl.debug_barrier()
    return ok


@triton.jit
def peer_ptr(table_ptr, peer, DTYPE: tl.constexpr):
    """Base pointer of ``peer``'s buffer from an int64 table of base addresses."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(DTYPE))


@triton.jit(do_not_specialize=["rank"])
def _ready_kernel(pad_table_ptr, epoch_ptr, rank, world_size):
    # One program: bump this rank's op epoch and publish it into slot [rank] of every peer's
    # pad. Stream order puts this after the previous op's consumers and after the owner reset
    # of this op's flags, so a producer that sees epoch e at its destination may write there.
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    for p in range(world_size):
        base = peer_ptr(pad_table_ptr, p, tl.int32)
        tl.atomic_xchg(base + rank, e, sem="release", scope="sys")


@triton.jit(do_not_specialize=["target", "rank", "index", "budget"])
def _wait_kernel(
    flag_ptr, target, err_ptr, out_ptr, rank, stage, index, budget, USE_TIMER: tl.constexpr
):
    ok = wait_geq(flag_ptr, target, err_ptr, rank, stage, index, budget, USE_TIMER)
    tl.store(out_ptr, ok.to(tl.int32))


def publish_ready(pad_table, epoch, rank: int, world_size: int):
    """Launch the op-start handshake (see ``_ready_kernel``)."""
    launch(_ready_kernel, (1,), pad_table, epoch, rank, world_size)


def wait_flag(flag, target, err, out, rank, stage, index, budget, use_timer):
    """Launch one bounded wait on ``flag[0] >= target``; ``out[0]`` gets 1 on success."""
    launch(
        _wait_kernel, (1,), flag, target, err, out, rank, stage, index, budget, USE_TIMER=use_timer
    )
