"""MoE layer 1: expert grouped GEMM with the combine folded into its epilogue.

Two launches on the same stream (``World.run_fused(..., split=True)``):

*GEMM + scatter* (producer role): persistent grouped GEMM over this rank's receive layout
(same rows and BLOCK_M as layer 0). The epilogue adds the bias and stores every output row
straight into its *source* rank's combine buffer at the row's slot (a remote store through the
peer table; a local store for this rank's own tokens), then adds the number of rows it sent to
each source to that source's counter ``done[n_tile]`` (``signal_add``: the release covers the
whole tile thanks to the CTA barrier in front of it). Counters are per output column block, so
a source's reduction of a column block may start as soon as every expert finished that block.
Before its first remote store every program waits the destination ranks' ready epochs.

*Weighted reduction* (consumer role) on the source rank: tiles of tokens x columns wait until
``done[n_tile] >= kept assignments of this rank`` (known locally), then sum the K expert rows of
each token in k order with their weights, in fp32. No float atomics anywhere: the same inputs
give bitwise-identical outputs run after run. Dropped assignments (slot -1) contribute zero and
are never read. Optionally the rows are also saved (``o``) for the weights' gradient.

Why the reduction is a second launch rather than persistent consumer programs in the GEMM's
grid: its wait spans the whole GEMM (every expert contributes to every column), so resident
consumer programs would idle SMs the GEMM needs; issued second on the stream it costs one
launch and overlaps the peers' tail instead. The overlap of the combine's *traffic* with the
GEMM comes from the epilogue's remote stores. Stage codes: 1 (ready), 5 (combine).

Measured (one H200, bf16, Mixtral-8x7B shape, 16k tokens top-2, EP=1, 2026-12-03, TMA A and B
tiles, flattened tile loop, the CLI's interleaved rotating-input timing): GEMM + combine
5.83 ms, 660 TFLOP/s: 1.013x ``torch._grouped_mm`` on the same GEMM alone (5.91 ms) and 1.18x
the fastest unfused pipeline; qwen3-30b-a3b 0.874x (its combine kernel is ~27% of the time at
H 2048, K 8), deepseek-v3 1.065x (BENCHMARKS.md).

The reduction at one rank (no waits) runs one program per token x 128-column tile, its top-k
loop unrolled (``K_top`` constexpr): 132 persistent programs of 4 warps, rolled, left it
latency-bound. Measured the same evening (qwen3-30b-a3b): 0.37 ms (with the row copy the
backward then needed; one rank now keeps the GEMM's buffer instead) -> 0.175 ms; layer 1
0.936x grouped_mm at qwen3, 0.917x at olmoe, 0.99-1.09x on the other five presets. What is
left at the top-8 H-2048 shapes is the reduction's own traffic (``T x K x H`` rows read once),
which the floor does not have. At W > 1 the reduction stays persistent and tiled like the GEMM:
it waits per GEMM column tile.

At one rank on a Hopper GPU the GEMM + row stores run in the warp-specialized Gluon kernel
instead (``moe_ws.py``, its rows mode: the row stores in an epilogue partition, off the tensor
cores' path; ``fused._l1_ws_usable`` says when); the reduction below is the same.

Tried and dropped (2026-12-04): the one-rank combine *in the GEMM's epilogue*, without float
atomics: each tile counts its rows into a per-(token, column tile) counter (acq_rel atomics
after a CTA barrier) and the tile that brings a token to its kept count sums the token's K rows
in k order (the same fp32 arithmetic, bitwise equal to this file's reduction in the
interpreter; equal within bf16 rounding and to the reference in 18 H200 tests). On the H200 it
lost badly: layer 1 at qwen3-30b-a3b 1.76 ms (32-column slices) / 1.56 ms (64) against 0.85 ms
with the reduction launch, olmoe 1.72 against 0.98, mixtral-8x7b 5.82 against 5.64; qwen3's
forward+backward 9.67 against 8.29 ms. Why: a token is ready only once its last expert's tile
is done, so with random routing most tokens finish in the last tenth of the GEMM, and from the
middle on nearly every tile holds a few finishing rows; their epilogue is a dependent chain
(slot loads, then row loads from HBM, slice after slice) that the same warps wait out, as
this kernel has no warp specialization to hide it behind the next tile's MMAs. Wider slices
spill (ptxas, sm_90a: 64 columns at top-8 ~3.4 KB of spill loads a thread, 32 columns no more
than the GEMM alone), and Triton 3.6's loop fusion (``FLAT``) fails to compile the epilogue's
data-dependent branch (TritonGPUFuseNestedLoops; 3.9 takes it). Revisit with a
warp-specialized epilogue.
"""

import triton
import triton.language as tl

from .moe_layer0 import expert_tile, load_a_tile, load_b_tile
from .nvshmem_device import quiet
from .put import SIGNAL_ADD, put_signal, wait_sum_geq
from .signals import signal_add, trace_clock, trace_record, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_COMBINE = tl.constexpr(5)


@triton.jit(do_not_specialize=["rank", "budget"])
def _layer1_gemm_kernel(
    h_ptr,
    h_desc,
    w_ptr,
    w_desc,
    b_ptr,
    row_l_ptr,
    exp_end_ptr,
    n_tiles_ptr,
    row_src_ptr,
    row_slot_ptr,
    comb_local,
    comb_table,
    done_table,
    pad_local,
    epoch_ptr,
    err_ptr,
    rank,
    budget,
    trace_ptr,
    trace_rows,
    F,
    H,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    ES: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TIMER: tl.constexpr,
    TRACE: tl.constexpr,
    A_TMA: tl.constexpr = False,
    B_MODE: tl.constexpr = 0,
    FLAT: tl.constexpr = False,
    put_mask_ptr=None,
    sig_table=None,
    stage_out=None,
    PUT: tl.constexpr = False,
    USE_NVSHMEM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = comb_local.dtype.element_ty
    nbad = tl.zeros((), tl.int32)
    if W > 1:
        epoch = tl.load(epoch_ptr)
        for d in range(W):
            ok = wait_geq(pad_local + d, epoch, err_ptr, rank, STAGE_READY, d, budget, USE_TIMER)
            nbad += tl.where(ok, 0, 1)
    n_m = tl.load(n_tiles_ptr)
    n_n = tl.cdiv(H, BN)
    total = n_m * n_n
    for t in tl.range(pid, total, nprog, flatten=FLAT):
        if TRACE:
            t_start = trace_clock(trace_ptr + trace_rows * 6, USE_TIMER)
        nt, r0, le, rows, rmask = expert_tile(t, n_m, n_n, row_l_ptr, exp_end_ptr, BM, GROUP_M)
        cols = nt * BN + tl.arange(0, BN)
        cmask = cols < H
        a_row = h_ptr + rows.to(tl.int64) * stride_hm
        w_base = w_ptr + le.to(tl.int64) * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, F, BK):
            ks = k0 + tl.arange(0, BK)
            a, bm = load_a_tile(a_row, h_desc, r0, k0, ks, rmask, cmask, F, A_TMA, EVEN_K)
            b = load_b_tile(
                w_base,
                w_desc,
                le,
                nt * BN,
                k0,
                cols,
                ks,
                H,
                F,
                stride_wn,
                stride_wk,
                bm,
                B_MODE,
                BN,
                BK,
            )
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + le * stride_be + cols, mask=cmask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        slot = tl.load(row_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        omask = rmask[:, None] & cmask[None, :]
        val = acc.to(dtype)
        if W == 1:
            tl.store(comb_local + slot[:, None] * H + cols[None, :], val, mask=omask)
        else:
            src = tl.load(row_src_ptr + rows, mask=rmask, other=0)
            if nbad == 0:
                smask = rmask
                if PUT:
                    pm = tl.load(put_mask_ptr + src, mask=rmask, other=0)
                    smask = rmask & (pm == 0)
                    # Rows for sources on other nodes: staged here in receive-row order, then
                    # one put per row segment (the destination row is H wide, the tile BN).
                    pmask = (rmask & (pm != 0))[:, None] & cmask[None, :]
                    n_put = tl.sum(tl.where(rmask & (pm != 0), 1, 0))
                    srow = rows.to(tl.int64)[:, None] * H
                    tl.store(stage_out + srow + cols[None, :], val, mask=pmask)
                base = tl.load(comb_table + src, mask=smask, other=0)
                addr = base[:, None] + (slot[:, None] * H + cols[None, :]) * ES
                tl.store(addr.to(tl.pointer_type(dtype)), val, mask=smask[:, None] & cmask[None, :])
                for s in range(W):
                    ns = tl.sum(tl.where(smask & (src == s), 1, 0))
                    if ns > 0:
                        signal_add(tl.load(done_table + s).to(tl.pointer_type(tl.int32)) + nt, ns)
                if PUT:
                    end = tl.load(exp_end_ptr + le)
                    ncol = tl.minimum(BN, H - nt * BN)
                    # Tiles without a row for another node skip the row walk.
                    n_rows = tl.where(n_put > 0, BM, 0)
                    for i in range(0, n_rows):
                        r = r0 + i
                        if r < end:
                            sr = tl.load(row_src_ptr + r)
                            if tl.load(put_mask_ptr + sr) != 0:
                                sl = tl.load(row_slot_ptr + r).to(tl.int64)
                                put_signal(
                                    comb_table,
                                    (sl * H + nt * BN) * ES,
                                    stage_out + r.to(tl.int64) * H + nt * BN,
                                    ncol * ES,
                                    sig_table,
                                    nt,
                                    1,
                                    rank,
                                    sr,
                                    SIGNAL_ADD,
                                    USE_NVSHMEM,
                                )
        if TRACE:
            # The GEMM tile never waits (its ready waits happen once, before the loop).
            t_end = trace_clock(trace_ptr + trace_rows * 6, USE_TIMER)
            trace_record(trace_ptr, trace_rows, t, rank, pid, t_start, t_start, t_end)
    if USE_NVSHMEM:
        quiet()  # the staged rows may be reused by the next op only once delivered


@triton.jit(do_not_specialize=["rank", "budget"])
def _combine_kernel(
    comb_local,
    slot_of_ptr,
    wts_ptr,
    y_ptr,
    o_ptr,
    done_local,
    n_kept_ptr,
    err_ptr,
    rank,
    budget,
    T,
    H,
    stride_ym,
    K_top: tl.constexpr,
    W: tl.constexpr,
    HAS_W: tl.constexpr,
    SAVE_O: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    USE_TIMER: tl.constexpr,
    sig_local=None,
    PUT: tl.constexpr = False,
    USE_NVSHMEM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_n = tl.cdiv(H, BN)
    total = tl.cdiv(T, BT) * n_n
    need = tl.load(n_kept_ptr)
    for t in range(pid, total, nprog):
        tt = t // n_n
        nt = t % n_n
        toks = tt * BT + tl.arange(0, BT)
        tmask = toks < T
        cols = nt * BN + tl.arange(0, BN)
        cmask = cols < H
        bad = tl.zeros((), tl.int32)
        if W > 1:
            if PUT:  # rows arrive by stores (int32 counter) and by puts (int64 counter)
                ok = wait_sum_geq(
                    done_local + nt,
                    sig_local + nt,
                    need,
                    err_ptr,
                    rank,
                    STAGE_COMBINE,
                    nt,
                    budget,
                    USE_TIMER,
                    USE_NVSHMEM,
                )
            else:
                ok = wait_geq(
                    done_local + nt, need, err_ptr, rank, STAGE_COMBINE, nt, budget, USE_TIMER
                )
            bad = tl.where(ok, 0, 1)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        # Unrolled: the K slot loads, then the K row loads, go out together (a rolled loop
        # waited for each slot, then its row, K times over).
        for k in tl.static_range(K_top):
            a = toks.to(tl.int64) * K_top + k
            j = tl.load(slot_of_ptr + a, mask=tmask, other=-1).to(tl.int64)
            m = (j >= 0)[:, None] & cmask[None, :]
            v = tl.load(comb_local + j[:, None] * H + cols[None, :], mask=m, other=0.0)
            if SAVE_O:
                tl.store(o_ptr + j[:, None] * H + cols[None, :], v, mask=m)
            v = v.to(tl.float32)
            if HAS_W:
                # a dropped slot's weight is never read: 0 * inf (a router renormalizing an
                # all-dropped token gives 0 / 0) would make the token's row NaN
                wk = tl.load(wts_ptr + a, mask=tmask & (j >= 0), other=0.0).to(tl.float32)
                v = v * wk[:, None]
            acc += v
        if bad > 0:
            acc = tl.full((BT, BN), float("nan"), tl.float32)
        tl.store(
            y_ptr + toks.to(tl.int64)[:, None] * stride_ym + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=tmask[:, None] & cmask[None, :],
        )
