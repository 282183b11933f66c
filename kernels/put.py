"""Put transport for the fused MoE kernels: rows that cross nodes travel as puts with a signal.

The store path (one node, NVLink) writes a tile through the peer pointer table and raises an
int32 flag with a release atomic. A destination that is not load/store reachable (another node,
or ``MOE_OVERLAP_NVSHMEM_FORCE_PUT=1``) gets the put path instead:

1. the producer stores the data into its *own* symmetric staging slot (a put's source must be
   symmetric memory: NVSHMEM's remote transports only read registered buffers);
2. one :func:`put_signal` delivers the bytes to the same buffer offset on the destination and
   then updates a 64-bit signal word there (``SIGNAL_SET`` / ``SIGNAL_ADD``). Data and signal are
   one NVSHMEM operation (``putmem_signal_nbi_block``), so no fence or quiet is needed: every
   signalled unit is exactly one call;
3. the consumer waits on its local 64-bit word (:func:`wait_arrival`), bounded like every wait.

Which peers take puts comes from the world (``World.put_mask``: int32 ``[W]``, 1 = put), not
from 0 entries of the peer table, so emulated worlds can run the same path: an emulated world
given a multi-node topology (``World.set_topology``) has real addresses for every peer, and
``USE_NVSHMEM=False`` turns step 2 into a plain copy from the staging slot to the peer's
buffer (byte loads/stores through the table) followed by a release atomic on the peer's 64-bit
word. That keeps the staging, the offset arithmetic, the signal words and the waits under the
CPU interpreter's tests; only the NVSHMEM call itself needs the GPU.

Signal words are int64 and live in the op's slice of the world's signal pad, after its int32
flags (``World.begin_op_signals``): zeroed by their owner at the op start like the flags, never
aliased with them. A signal word written into a rank during an op is waited for by that rank in
the same op (the same rule as the int32 flags, same reason: the next op's reset).

Cost (not measured: no multi-node machine has been lent): the count exchange and the layer-0
dispatch put whole contiguous chunks (up to CHUNK rows of H); the layer-1 combine puts one
``BN``-column row segment per (row, column tile), since its destination rows are H wide and
``putmem`` moves one contiguous range. A tile-major combine buffer would let it put one block
per (tile, source) instead: the first thing to try once puts can be timed.
"""

import triton
import triton.language as tl

from .nvshmem_device import CMP_GE, putmem_signal_nbi_block, signal_wait_until, wait_signal_geq
from .signals import gave_up_before, load_acquire, now_ns, record_error, wait_geq

SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)


@triton.jit
def put_signal(
    table,
    off,
    src,
    nbytes,
    sig_table,
    sig_index,
    value,
    rank,
    pe,
    SIG_OP: tl.constexpr,
    USE_NVSHMEM: tl.constexpr,
    BLOCK: tl.constexpr = 1024,
):
    """Deliver ``nbytes`` bytes from this rank's symmetric ``src`` to byte offset ``off`` of the
    buffer whose int64 base table is ``table`` on rank ``pe``; then apply ``SIG_OP`` with
    ``value`` to int64 word ``sig_index`` of the buffer ``sig_table`` on ``pe``.

    Collective over the program's threads (uniform control flow). ``src`` is a pointer or int64
    address inside this rank's copy of a symmetric buffer.
    """
    tl.debug_barrier()  # every warp's staging stores are done before the put reads them
    if USE_NVSHMEM:
        # NVSHMEM addresses the destination by this rank's own symmetric address.
        dst = tl.load(table + rank) + off
        sig = tl.load(sig_table + rank) + sig_index * 8
        putmem_signal_nbi_block(dst, src, nbytes, sig, value, SIG_OP, pe)
    else:
        dst = (tl.load(table + pe) + off).to(tl.pointer_type(tl.int8))
        s = src.to(tl.int64).to(tl.pointer_type(tl.int8))
        for b0 in range(0, nbytes, BLOCK):
            o = b0 + tl.arange(0, BLOCK)
            m = o < nbytes
            tl.store(dst + o, tl.load(s + o, mask=m), mask=m)
        tl.debug_barrier()  # every warp's bytes are stored before the signal
        sig = tl.load(sig_table + pe).to(tl.pointer_type(tl.int64)) + sig_index
        if SIG_OP == 9:
            tl.atomic_xchg(sig, tl.cast(value, tl.int64), sem="release", scope="sys")
        else:
            tl.atomic_add(sig, tl.cast(value, tl.int64), sem="release", scope="sys")


@triton.jit
def wait_arrival(
    flag_ptr,
    sig_base,
    sig_index,
    put_mask_ptr,
    peer,
    target,
    err_ptr,
    rank,
    stage,
    index,
    budget,
    USE_TIMER: tl.constexpr,
    PUT: tl.constexpr,
    USE_NVSHMEM: tl.constexpr,
):
    """Bounded wait until what ``peer`` sent has arrived: its int32 flag ``*flag_ptr`` (store
    path) or, where ``put_mask[peer]`` says puts, its int64 signal word ``sig_base[sig_index]``
    reaches ``target``. Without ``PUT`` it is ``signals.wait_geq`` (``sig_base`` and
    ``put_mask_ptr`` unused). Returns True on arrival."""
    # Nested rather than ``by_put = False; if PUT: ...; if by_put:``: compiled Triton (3.9)
    # does not fold that second branch away when PUT is False.
    if PUT:
        if tl.load(put_mask_ptr + peer) != 0:
            ok = wait_signal_geq(
                sig_base + sig_index,
                target,
                err_ptr,
                rank,
                stage,
                index,
                budget,
                USE_TIMER,
                USE_NVSHMEM,
            )
        else:
            ok = wait_geq(flag_ptr, target, err_ptr, rank, stage, index, budget, USE_TIMER)
    else:
        ok = wait_geq(flag_ptr, target, err_ptr, rank, stage, index, budget, USE_TIMER)
    return ok


@triton.jit
def wait_sum_geq(
    flag_ptr,
    sig_ptr,
    target,
    err_ptr,
    rank,
    stage,
    index,
    budget,
    USE_TIMER: tl.constexpr,
    USE_NVSHMEM: tl.constexpr,
):
    """Bounded wait until int32 ``*flag_ptr`` (stored rows) plus int64 ``*sig_ptr`` (rows that
    came by puts) reach ``target``: a counter fed by both transports at once.

    ``signals.wait_geq``'s loop over two words. Folding it into ``wait_geq`` (a constexpr second
    word) would touch every kernel's waits, which the H200 has not re-run: kept apart until
    it can."""
    budget = tl.where(gave_up_before(err_ptr), 0, budget)  # as wait_geq
    seen = load_acquire(flag_ptr).to(tl.int64) + load_acquire(sig_ptr)
    start = now_ns(USE_TIMER)
    spent = start * 0
    while (seen < target) & (spent < budget):
        seen = load_acquire(flag_ptr).to(tl.int64) + load_acquire(sig_ptr)
        if USE_TIMER:
            spent = now_ns(USE_TIMER) - start
        else:
            spent += 1
    ok = seen >= target
    if seen < target:
        record_error(err_ptr, rank, stage, index, target, seen)
    tl.debug_barrier()
    if USE_NVSHMEM:
        if ok:
            # NVSHMEM's own post-wait ordering for what a NIC delivered (returns at once).
            signal_wait_until(sig_ptr, CMP_GE, tl.atomic_add(sig_ptr, 0, sem="acquire"))
    return ok
