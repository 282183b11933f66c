"""MoE layer 0: token dispatch folded into the prologue of the expert grouped GEMM.

One launch holds two roles (``ROLE`` 0 = both, 1 = producers only, 2 = consumers only):

*Communication programs* (the first ``n_comm`` program ids, so the hardware schedules them
first) walk this rank's remote chunks (``layout.chunks``: at most CHUNK rows, never crossing a
(destination, expert) slice). For each chunk: wait the destination's ready epoch, gather the
token rows of x (optionally scaled per assignment: the backward of the combine dispatches
``dy * w``), store them into the destination's receive buffer at their final GEMM row, store
their slots, then ``signal_add(flag[src * El + l], rows)`` on the destination.

*GEMM programs* are persistent over M x N tiles (grouped ordering for L2 reuse). An M-tile lies
inside one local expert (experts are padded to BLOCK_M). Before loading A it waits, for each
source s whose slice overlaps the tile, until ``flag[s * El + l] >= rows the source sends``:
a counter, so the chunking on the source side does not matter. Rows of this rank's own tokens
are read straight from x through ``row_tok`` (no permute copy, no wait), and each expert's
sources are ordered starting with this rank, so the first tiles of an expert need no wait.
Epilogue: bias, activation (SwiGLU: gate rows [0, F), up rows [F, 2F) of w1; or GELU/ReLU/
SiLU/identity), an optional per-row scale, and optionally the pre-activations for backward.
In the backward (``DACT`` = the forward's activation code) the same kernel computes
``d h = (dy * w) @ w2`` and its epilogue applies the activation's derivative to the saved
pre-activations, writing ``d gu [R, 2F]`` directly. Measured on the H200 (Mixtral-8x7B, 16k
tokens): the unfused fp32 torch version of that step moved ~60 GB; fusing it took the layer's
forward+backward from 90.2 to 73.2 ms. That epilogue loads the saved gate and up tiles beside
the accumulator, so its block config is its own (``layer0_config("dact")``): at the forward's
plain-GEMM 128x256 it spilled, 18.5 ms for 3.85 TFLOP (208 TFLOP/s); 128x128, 4 stages: 7.5-8.0
ms (481-515 TFLOP/s; ``torch._grouped_mm`` on the same GEMM 5.7-5.8 ms), qwen3-30b-a3b 1.21 ms
against 3.7 (``tests/gpu/sweep_bwd.py``, 2026-12-03; 3 stages 9.3 ms, 4 warps 19.1 ms). With the
epilogue in column slices (``EPI_SUB`` 2, 4 or 8: the accumulator is split with reshape/permute/
split and each slice loads only its own gate/up columns) 128x256 spills far less: 4 slices,
3 stages, 6.65 ms (579 TFLOP/s) at mixtral-8x7b, 0.875 ms at qwen3-30b-a3b (grouped_mm 0.757),
4.01 ms at deepseek-v3 (grouped_mm 4.10); 2 slices 6.67 / 0.897 / 4.06 ms; the default now.
``DW`` (one rank, no ``b2``): the epilogue also sums ``act(pre) * h`` per row into one partial
per (slot, column tile), from which ``row_dot.weights_grad_from_partials`` gets the combine
weights' gradient without re-reading layer 1's rows. It costs registers (Triton 3.9's ptxas,
sm_90a, 4 slices: spill loads 2348 -> 3632 bytes per thread) and time: on the H200
(2026-12-04) +0.09 ms at qwen3-30b-a3b against the 0.18 ms of ``row_dot`` it saves, +0.30 ms
at mixtral-8x7b against ~0.08, so the host takes it only where ``F < H``.
At one rank on a Hopper GPU the host runs this GEMM (SwiGLU) as the warp-specialized Gluon
kernel of ``moe_ws.py`` instead (0.91 against 1.05 ms at qwen3-30b-a3b, 2026-12-04), and
the SwiGLU forward (no bias) too.
``EPI_SUB`` 8 (32-column slices at BN 256) cuts the spills further (same ptxas: spill loads
2348 -> 572 bytes without ``DW``, 3632 -> 1568 with it) but is slower: on the H200
(``sweep_bwd.py``, 2026-12-04) 1.106 / 1.003 ms with / without ``DW`` at qwen3-30b-a3b against
1.018 / 0.847 for 4 slices, 7.586 / 7.202 against 7.260 / 6.698 at mixtral-8x7b (more, narrower
slices issue more of the saved gate/up loads; fewer spills do not pay for them). It stays a
valid config, not a tuning candidate. The forward's SwiGLU epilogue takes ``EPI_SUB`` too
(``MOE_OVERLAP_L0_CONFIG``'s 7th field): with ``SAVE_GU`` (training) at 128x128 it spilled 1028
bytes a thread, in 2 slices 436, in 4 none (same ptxas), yet the forward+backward did not move
(qwen3-30b-a3b 8.131 / 8.264 ms in one piece, 8.166 in 4 slices, 8.189 in 2; olmoe 9.606
against 9.503 in 4, within the machine's 1-2% spread): off by default.

Flags live in the world's signal pad and are reset by their owner in ``World.begin_op``, then
the ready epoch is published: so a producer can only write into a receive buffer whose owner
has finished the previous op. Stage codes: 1 (ready), 4 (dispatch). A timed-out tile is
written as NaN and the error record names the flag (``src * El + l``).

Measured (one H200, bf16, Mixtral-8x7B shape, 16k tokens top-2, EP=1, 2026-12-03, TMA weight
tiles, tuned GROUP_M 16, the CLI's interleaved rotating-input timing): 13.39 ms, 575 TFLOP/s:
0.884x ``torch._grouped_mm`` on the same GEMM (11.83 ms) and 1.02x the fastest unfused pipeline;
qwen3-30b-a3b 0.938x, deepseek-v3 0.993x (BENCHMARKS.md). Before TMA (2026-12-02): 0.84x.
With the A rows staged contiguously at one rank and loaded by TMA (``A_TMA``, same day):
12.16 ms, 633 TFLOP/s, 1.000x grouped_mm; qwen3 0.907x, deepseek-v3 1.064x. Flattening the
tile loop into the K loop (``FLAT``, a win for layer 1) cost it: 0.779x. Inference at
narrow GEMMs (2F < 2048, qwen3) keeps pointer loads of the gathered rows instead, since the
staging pass costs the same bytes whatever the width: qwen3 0.94-1.02x in two calls that evening;
every preset 0.917-1.065x (BENCHMARKS.md). (That rule is this kernel's: at one rank on Hopper
the warp-specialized forward, ``moe_ws.py``, now takes inference at every width on staged rows:
qwen3-30b-a3b 1.010x against this kernel's 0.950x, 2026-12-05.)
Gate and up tiles in one TMA box (``B_MODE`` 3, ``load_gate_up``; 2026-12-04, night): one
``[BK, 2 BN]`` B tile and one dot, so each warp group issues ``m64n256k16`` wgmmas that read their
A tile from shared memory once, where the two ``n128`` dots read it twice. Same bits as the two
dots. Measured (``tests/gpu/ab_layers.py``, L2 flushed between calls, 3 rounds): qwen3-30b-a3b
1.537 ms against 1.590 (0.994x / 0.961x ``grouped_mm``), with the saved pre-activations 1.581
against 1.741; olmoe 1.955 / 2.027 (0.963x / 0.929x), 2.042 / 2.250 saving; deepseek-v3 7.769 /
8.533 ms; mixtral-8x7b equal (12.01 / 11.97). ``MOE_OVERLAP_L0_PAIR=0`` loads them apart.
An L2 prefetch of the saved gate/up tile before the backward's main loop
(``prefetch.global.L2`` by inline assembly) made that GEMM slower: 1.090 against 1.034 ms at
qwen3-30b-a3b, 1.386 against 1.298 at olmoe; not kept.
Block shape and GROUP_M sweeps (``bench tune``) move it < 5%.
Compute-bound (7.7 TFLOP vs 3.1 GB moved); the gap is kernel efficiency, not the gather
(BENCHMARKS.md).

Traps found
-----------
* Module-level stage codes must be ``tl.constexpr``: compiled Triton rejects plain globals
  (the interpreter accepts them).
* Every peer table handed to a kernel is int64, dummies included: an int32 dummy table makes
  ``int_to_ptr`` fail to compile even on a branch that never runs.
* Emulated ranks on one GPU: a rank must never lazily load a kernel while a peer's kernel
  spins on it (see ``launch.py``); and a timed wait must exit on the same iteration in every
  thread of the program (see ``signals.now_ns``).
* ``tests/test_compile_sm90.py`` compiles every variant here for sm_90 on a CPU-only machine,
  which catches the first two before any GPU time is spent.
"""

import triton
import triton.language as tl

from .nvshmem_device import quiet
from .put import SIGNAL_ADD, put_signal, wait_arrival
from .signals import peer_ptr, signal_add, trace_clock, trace_record, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_DISPATCH = tl.constexpr(4)

ACT_SWIGLU, ACT_GELU, ACT_RELU, ACT_SILU, ACT_NONE = 0, 1, 2, 3, 4
ACT_CODES = {"swiglu": 0, "gelu": 1, "relu": 2, "silu": 3, "none": 4}


@triton.jit
def apply_act(v, ACT: tl.constexpr):
    if ACT == 1:
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACT == 2:
        v = tl.maximum(v, 0.0)
    elif ACT == 3:
        v = v * tl.sigmoid(v)
    return v


@triton.jit
def act_grad(d, v, ACT: tl.constexpr):
    """``d * act'(v)`` for the plain activations (fp32 in, fp32 out)."""
    if ACT == 1:  # exact GELU
        cdf = 0.5 * (1.0 + tl.erf(v * 0.7071067811865476))
        pdf = tl.exp(-0.5 * v * v) * 0.3989422804014327
        d = d * (cdf + v * pdf)
    elif ACT == 2:
        d = tl.where(v > 0, d, 0.0)
    elif ACT == 3:
        sg = tl.sigmoid(v)
        d = d * sg * (1.0 + v * (1.0 - sg))
    return d


@triton.jit
def tile_coords(t, n_m, n_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order: GROUP_M M-tiles sweep all N-tiles together."""
    group = GROUP_M * n_n
    first_m = (t // group) * GROUP_M
    gsize = tl.minimum(n_m - first_m, GROUP_M)
    mt = first_m + (t % group) % gsize
    nt = (t % group) // gsize
    return mt, nt


@triton.jit
def expert_tile(t, n_m, n_n, row_l_ptr, exp_end_ptr, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent tile ``t``: its N-tile, first row, local expert, rows and row mask (rows past
    the expert's real rows are padding; experts are padded to BM so a tile has one expert)."""
    mt, nt = tile_coords(t, n_m, n_n, GROUP_M)
    r0 = mt * BM
    le = tl.load(row_l_ptr + r0)
    end = tl.load(exp_end_ptr + le)
    rows = r0 + tl.arange(0, BM)
    return nt, r0, le, rows, rows < end


@triton.jit
def load_b_tile(
    w_base,
    w_desc,
    le,
    n0,
    k0,
    cols,
    ks,
    NW,
    KW,
    stride_wn,
    stride_wk,
    bmask,
    B_MODE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The ``[BK, BN]`` weight tile ``w[le, n0 + j, k0 + i]`` of a grouped GEMM.

    ``B_MODE`` 0: pointer loads (any strides, masked). 1: TMA over the weight viewed as
    ``[El * NW, K]`` (k contiguous, the forward's layout). 2: TMA over ``[El * KW, N]`` (n
    contiguous: the backward's transposed use). (Mode 3, SwiGLU's gate and up tiles in one box,
    is ``load_gate_up``.) A tile that runs past its expert's rows reads the next expert's (or
    TMA's zero fill): in mode 1 only for columns the epilogue masks, in mode 2 only for k past
    the end, where the A tile is zero.
    """
    if B_MODE == 1:
        b = w_desc.load([le * NW + n0, k0]).T
    elif B_MODE == 2:
        b = w_desc.load([le * KW + k0, n0])
    else:
        b = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=bmask, other=0.0
        )
    return b


@triton.jit
def load_a_tile(
    a_row, a_desc, r0, k0, ks, rmask, cmask, K, A_TMA: tl.constexpr, EVEN_K: tl.constexpr
):
    """The ``[BM, BK]`` A tile at rows ``r0 ...`` and columns ``ks`` of a grouped GEMM, and the
    weight tile's mask. ``A_TMA``: contiguous rows through the descriptor (rows are
    independent, so padding rows only reach masked outputs; columns past K read TMA's zero
    fill); else pointer loads from the row pointers ``a_row [BM]``."""
    if A_TMA:
        a = a_desc.load([r0, k0])
        bm = cmask[None, :] & (ks[:, None] < K)
    elif EVEN_K:
        a = tl.load(a_row[:, None] + ks[None, :], mask=rmask[:, None], other=0.0)
        bm = cmask[None, :]
    else:
        a = tl.load(
            a_row[:, None] + ks[None, :], mask=rmask[:, None] & (ks[None, :] < K), other=0.0
        )
        bm = cmask[None, :] & (ks[:, None] < K)
    return a, bm


@triton.jit
def load_gate_up(w_desc, le, n0, k0, BN: tl.constexpr, BK: tl.constexpr):
    """``B_MODE`` 3: the gate rows ``[n0, n0 + BN)`` and the up rows ``F + n0 ...`` of expert
    ``le`` as one ``[BK, 2 * BN]`` tile, by one TMA box ``[2, BN, BK]`` over the weight viewed as
    ``[El * 2, F, K]`` (rows past F read TMA's zero fill, not the next expert's). One dot then
    covers both halves: per warp group one ``m64n(2BN)`` wgmma that reads its A tile from shared
    memory once, where two ``n(BN)`` dots read it twice."""
    b = w_desc.load([le * 2, n0, k0])
    return tl.reshape(b, (2 * BN, BK)).T


@triton.jit
def _copy_rows(x_ptr, scale_ptr, a, m, K_top, stride_xt, out_base, orow, H, HAS_SCALE, BH):
    """Rows ``x[a // K_top]`` (times ``scale[a]``) -> ``out_base[orow]`` (``[*, H]`` rows)."""
    dtype = x_ptr.dtype.element_ty
    tok = (a // K_top).to(tl.int64)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + a, mask=m, other=0.0).to(tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        mk = m[:, None] & (cols[None, :] < H)
        v = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :], mask=mk)
        if HAS_SCALE:
            v = (v.to(tl.float32) * sc[:, None]).to(dtype)
        tl.store(out_base + orow[:, None] * H + cols[None, :], v, mask=mk)


@triton.jit
def _store_chunk(
    x_ptr,
    scale_ptr,
    a,
    m,
    ri,
    j0,
    n,
    row0,
    fl,
    recv_table,
    slot_table,
    flag_table,
    dst,
    H,
    K_top,
    stride_xt,
    HAS_SCALE: tl.constexpr,
    BH: tl.constexpr,
):
    """Store path: rows and slots straight into ``dst``'s receive buffer, then its counter."""
    recv_d = peer_ptr(recv_table, dst, x_ptr.dtype.element_ty)
    drow = (row0 + ri).to(tl.int64)
    _copy_rows(x_ptr, scale_ptr, a, m, K_top, stride_xt, recv_d, drow, H, HAS_SCALE, BH)
    slot_d = peer_ptr(slot_table, dst, tl.int32)
    tl.store(slot_d + drow, j0 + ri, mask=m)
    signal_add(peer_ptr(flag_table, dst, tl.int32) + fl, n)


@triton.jit
def _put_chunk(
    x_ptr,
    scale_ptr,
    a,
    m,
    ri,
    j0,
    n,
    row0,
    fl,
    recv_table,
    slot_table,
    sig_table,
    stage_rows,
    stage_slots,
    rank,
    dst,
    H,
    K_top,
    stride_xt,
    slot_sig0,
    HAS_SCALE: tl.constexpr,
    BH: tl.constexpr,
    USE_NVSHMEM: tl.constexpr,
):
    """Put path: rows and slots into this rank's staging (by assignment index, unique per
    destination), then two puts with two counters, rows at word ``fl`` and slots at
    ``slot_sig0 + fl``: each signal covers exactly its own data, so no fence orders them."""
    jrow = (j0 + ri).to(tl.int64)
    _copy_rows(x_ptr, scale_ptr, a, m, K_top, stride_xt, stage_rows, jrow, H, HAS_SCALE, BH)
    tl.store(stage_slots + jrow, j0 + ri, mask=m)
    es = H * (x_ptr.dtype.element_ty.primitive_bitwidth // 8)
    put_signal(
        recv_table,
        row0.to(tl.int64) * es,
        stage_rows + j0.to(tl.int64) * H,
        n * es,
        sig_table,
        fl,
        n,
        rank,
        dst,
        SIGNAL_ADD,
        USE_NVSHMEM,
    )
    put_signal(
        slot_table,
        row0.to(tl.int64) * 4,
        stage_slots + j0,
        n * 4,
        sig_table,
        slot_sig0 + fl,
        n,
        rank,
        dst,
        SIGNAL_ADD,
        USE_NVSHMEM,
    )


@triton.jit
def _dact_store(h, cols, pre_rows, dst_rows, rmask, N, DACT: tl.constexpr, DW: tl.constexpr):
    """Backward epilogue of one column slice: ``h [BM, n]`` is d(act output) at ``cols``;
    ``pre_rows`` / ``dst_rows`` ``[BM, 1]`` point at the tile's rows of the saved
    pre-activations and of ``d pre`` (gate half, then the up half at ``+ N`` under SwiGLU).
    Padding rows are written as zeros: the grouped wgrads read whole padded expert ranges, and
    this saves a masking pass over ``[R, 2F]``. Returns ``[BM]`` fp32: with ``DW`` the slice's
    part of ``<act(pre), h>`` per row (the combine weights' gradient, scaled), else zeros."""
    cmask = cols < N
    keep = rmask[:, None]
    g = tl.load(pre_rows + cols[None, :], mask=keep & cmask[None, :], other=0.0).to(tl.float32)
    dst = dst_rows + cols[None, :]
    p = tl.zeros((h.shape[0],), tl.float32)
    if DACT == 0:
        u = tl.load(pre_rows + N + cols[None, :], mask=keep & cmask[None, :], other=0.0)
        u = u.to(tl.float32)
        sg = tl.sigmoid(g)
        d_g = tl.where(keep, h * u * sg * (1.0 + g * (1.0 - sg)), 0.0)
        d_u = tl.where(keep, h * g * sg, 0.0)
        tl.store(dst, d_g.to(dst_rows.dtype.element_ty), mask=cmask[None, :])
        tl.store(dst + N, d_u.to(dst_rows.dtype.element_ty), mask=cmask[None, :])
        if DW:  # <silu(g) * u, h> = sum(d_u * u); masked loads gave u = 0 there
            p = tl.sum(d_u * u, axis=1)
    else:
        d = tl.where(keep, act_grad(h, g, DACT), 0.0)
        tl.store(dst, d.to(dst_rows.dtype.element_ty), mask=cmask[None, :])
        if DW:
            p = tl.sum(apply_act(g, DACT) * h, axis=1)
    return p


@triton.jit
def _swiglu_store(g, u, c0, r0, rows64, rmask, N, gu_ptr, stride_gm, out_ptr, stride_om, rs, bad,
                  out_desc, gu_desc, SAVE_GU: tl.constexpr, ROW_SCALE: tl.constexpr,
                  O_TMA: tl.constexpr):  # fmt: skip
    """Forward SwiGLU epilogue of the column slice at ``c0`` (the whole tile, or one of
    ``EPI_SUB`` slices): the saved gate/up columns, then ``h`` (padding rows zero, NaN where a
    wait timed out). ``O_TMA``: by TMA stores through ``out_desc`` (``[R, N]``) and ``gu_desc``
    (``[R, 2, N]``: the gate and up halves as a middle dim, so a slice past N is clipped and
    never reaches the other half); padding rows of the saved pre-activations are then written
    too (the backward never reads them)."""
    dt = out_ptr.dtype.element_ty
    cols = c0 + tl.arange(0, g.shape[1])
    cmask = cols < N
    if SAVE_GU:
        if O_TMA:
            gu_desc.store([r0, 0, c0], tl.reshape(g.to(dt), (g.shape[0], 1, g.shape[1])))
            gu_desc.store([r0, 1, c0], tl.reshape(u.to(dt), (u.shape[0], 1, u.shape[1])))
        else:
            omask = rmask[:, None] & cmask[None, :]
            gp = gu_ptr + rows64[:, None] * stride_gm + cols[None, :]
            tl.store(gp, g.to(gu_ptr.dtype.element_ty), mask=omask)
            tl.store(gp + N, u.to(gu_ptr.dtype.element_ty), mask=omask)
    h = g * tl.sigmoid(g) * u
    if ROW_SCALE:
        h = h * rs[:, None]
    h = tl.where(bad, float("nan"), tl.where(rmask[:, None], h, 0.0))
    if O_TMA:
        out_desc.store([r0, c0], h.to(dt))
    else:
        dst = out_ptr + rows64[:, None] * stride_om + cols[None, :]
        tl.store(dst, h.to(dt), mask=cmask[None, :])


@triton.jit(do_not_specialize=["rank", "budget", "n_comm"])
def _layer0_kernel(
    x_ptr,
    scale_ptr,
    sorted_ptr,
    chunk_ptr,
    n_chunks_ptr,
    recv_table,
    slot_table,
    flag_table,
    pad_local,
    epoch_ptr,
    recv_local,
    row_tok_ptr,
    row_l_ptr,
    exp_end_ptr,
    n_tiles_ptr,
    slice_off_ptr,
    slice_cnt_ptr,
    flags_local,
    row_scale_ptr,
    w_ptr,
    w_desc,
    a_desc,
    b_ptr,
    out_ptr,
    gu_ptr,
    err_ptr,
    rank,
    budget,
    n_comm,
    trace_ptr,
    trace_rows,
    H,
    N,
    K_top,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_om,
    stride_gm,
    W: tl.constexpr,
    El: tl.constexpr,
    ROLE: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SAVE_GU: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    CH: tl.constexpr,
    BH: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TIMER: tl.constexpr,
    TRACE: tl.constexpr,
    DACT: tl.constexpr = -1,
    EPI_SUB: tl.constexpr = 1,
    B_MODE: tl.constexpr = 0,
    A_TMA: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    dw_ptr=None,
    dw_slot_ptr=None,
    DW: tl.constexpr = False,
    put_mask_ptr=None,
    sig_local=None,
    sig_table=None,
    stage_rows=None,
    stage_slots=None,
    PUT: tl.constexpr = False,
    USE_NVSHMEM: tl.constexpr = False,
    out_desc=None,
    gu_desc=None,
    O_TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    is_comm = (ROLE == 1) | ((ROLE == 0) & (pid < n_comm))
    if is_comm:
        epoch = tl.load(epoch_ptr)
        nch = tl.load(n_chunks_ptr)
        stride_p = n_comm
        if ROLE == 1:
            stride_p = nprog
        for c in range(pid, nch, stride_p):
            dst = tl.load(chunk_ptr + c * 5 + 0)
            j0 = tl.load(chunk_ptr + c * 5 + 1)
            n = tl.load(chunk_ptr + c * 5 + 2)
            row0 = tl.load(chunk_ptr + c * 5 + 3)
            fl = tl.load(chunk_ptr + c * 5 + 4)
            ok = wait_geq(
                pad_local + dst, epoch, err_ptr, rank, STAGE_READY, dst, budget, USE_TIMER
            )
            if ok:
                ri = tl.arange(0, CH)
                m = ri < n
                a = tl.load(sorted_ptr + j0 + ri, mask=m, other=0)
                if PUT:
                    if tl.load(put_mask_ptr + dst) != 0:
                        _put_chunk(
                            x_ptr,
                            scale_ptr,
                            a,
                            m,
                            ri,
                            j0,
                            n,
                            row0,
                            fl,
                            recv_table,
                            slot_table,
                            sig_table,
                            stage_rows,
                            stage_slots,
                            rank,
                            dst,
                            H,
                            K_top,
                            stride_xt,
                            W * El,
                            HAS_SCALE,
                            BH,
                            USE_NVSHMEM,
                        )
                    else:
                        _store_chunk(
                            x_ptr,
                            scale_ptr,
                            a,
                            m,
                            ri,
                            j0,
                            n,
                            row0,
                            fl,
                            recv_table,
                            slot_table,
                            flag_table,
                            dst,
                            H,
                            K_top,
                            stride_xt,
                            HAS_SCALE,
                            BH,
                        )
                else:
                    _store_chunk(
                        x_ptr,
                        scale_ptr,
                        a,
                        m,
                        ri,
                        j0,
                        n,
                        row0,
                        fl,
                        recv_table,
                        slot_table,
                        flag_table,
                        dst,
                        H,
                        K_top,
                        stride_xt,
                        HAS_SCALE,
                        BH,
                    )
        if USE_NVSHMEM:
            quiet()  # the staging rows may be reused by the next op only once delivered
    else:
        cpid = pid
        cprog = nprog
        if ROLE == 0:
            cpid = pid - n_comm
            cprog = nprog - n_comm
        n_m = tl.load(n_tiles_ptr)
        n_n = tl.cdiv(N, BN)
        total = n_m * n_n
        for t in tl.range(cpid, total, cprog, flatten=FLAT):
            if TRACE:
                t_start = trace_clock(trace_ptr + trace_rows * 6, USE_TIMER)
            nt, r0, le, rows, rmask = expert_tile(t, n_m, n_n, row_l_ptr, exp_end_ptr, BM, GROUP_M)
            nbad = tl.zeros((), tl.int32)
            if W > 1:
                for s in range(W):
                    off = tl.load(slice_off_ptr + s * El + le)
                    cnt = tl.load(slice_cnt_ptr + s * El + le)
                    need = (s != rank) & (cnt > 0) & (off < r0 + BM) & (off + cnt > r0)
                    if need:
                        fl = s * El + le
                        for part in tl.static_range(2 if PUT else 1):
                            # part 1: the slots of rows that came by puts travel as a second put
                            # (on the store path it re-reads the row flag, already met)
                            ok = wait_arrival(
                                flags_local + fl,
                                sig_local,
                                part * W * El + fl,
                                put_mask_ptr,
                                s,
                                cnt,
                                err_ptr,
                                rank,
                                STAGE_DISPATCH,
                                part * W * El + fl,
                                budget,
                                USE_TIMER,
                                PUT,
                                USE_NVSHMEM,
                            )
                            nbad += tl.where(ok, 0, 1)
            if TRACE:
                t_wait = trace_clock(trace_ptr + trace_rows * 6, USE_TIMER)
            tok = tl.load(row_tok_ptr + rows, mask=rmask, other=-2)
            a_row = tl.where(
                tok >= 0, x_ptr + tok.to(tl.int64) * stride_xt, recv_local + rows.to(tl.int64) * H
            )
            cols = nt * BN + tl.arange(0, BN)
            cmask = cols < N
            w_base = w_ptr + le.to(tl.int64) * stride_we
            NW = N
            if ACT == 0:
                NW = 2 * N
            if B_MODE == 3:
                acc2 = tl.zeros((BM, 2 * BN), dtype=tl.float32)
                for k0 in range(0, H, BK):
                    ks = k0 + tl.arange(0, BK)
                    a, bm = load_a_tile(a_row, a_desc, r0, k0, ks, rmask, cmask, H, A_TMA, EVEN_K)
                    acc2 = tl.dot(a, load_gate_up(w_desc, le, nt * BN, k0, BN, BK), acc2)
                acc, acc_u = tl.split(tl.permute(tl.reshape(acc2, (BM, 2, BN)), (0, 2, 1)))
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                if ACT == 0:
                    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
                for k0 in range(0, H, BK):
                    ks = k0 + tl.arange(0, BK)
                    a, bm = load_a_tile(a_row, a_desc, r0, k0, ks, rmask, cmask, H, A_TMA, EVEN_K)
                    b = load_b_tile(
                        w_base,
                        w_desc,
                        le,
                        nt * BN,
                        k0,
                        cols,
                        ks,
                        NW,
                        H,
                        stride_wn,
                        stride_wk,
                        bm,
                        B_MODE,
                        BN,
                        BK,
                    )
                    acc = tl.dot(a, b, acc)
                    if ACT == 0:
                        bu = load_b_tile(
                            w_base,
                            w_desc,
                            le,
                            N + nt * BN,
                            k0,
                            cols + N,
                            ks,
                            NW,
                            H,
                            stride_wn,
                            stride_wk,
                            bm,
                            B_MODE,
                            BN,
                            BK,
                        )
                        acc_u = tl.dot(a, bu, acc_u)
            if HAS_BIAS:
                bias = tl.load(b_ptr + le * stride_be + cols, mask=cmask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
                if ACT == 0:
                    bias_u = tl.load(b_ptr + le * stride_be + N + cols, mask=cmask, other=0.0)
                    acc_u += bias_u.to(tl.float32)[None, :]
            omask = rmask[:, None] & cmask[None, :]
            rows64 = rows.to(tl.int64)
            if ROW_SCALE:
                rs = tl.load(row_scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            else:
                rs = tl.zeros((BM,), tl.float32)
            if DACT < 0 and ACT == 0 and (O_TMA or EPI_SUB == 2 or EPI_SUB == 4):
                # Forward SwiGLU in column slices: both accumulators and their bf16 copies for
                # SAVE_GU live at once otherwise (ptxas: ~1 KB of spills a thread at 128x128)
                c = nt * BN
                if EPI_SUB == 2:
                    ga, gb = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                    ua, ub = tl.split(tl.permute(tl.reshape(acc_u, (BM, 2, BN // 2)), (0, 2, 1)))
                    _swiglu_store(ga, ua, c, r0, rows64, rmask, N, gu_ptr, stride_gm, out_ptr,
                                  stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU, ROW_SCALE,
                                  O_TMA)  # fmt: skip
                    _swiglu_store(gb, ub, c + BN // 2, r0, rows64, rmask, N, gu_ptr, stride_gm,
                                  out_ptr, stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU,
                                  ROW_SCALE, O_TMA)  # fmt: skip
                elif EPI_SUB == 4:
                    ga, gb = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                    ua, ub = tl.split(tl.permute(tl.reshape(acc_u, (BM, 2, BN // 2)), (0, 2, 1)))
                    g0, g1 = tl.split(tl.permute(tl.reshape(ga, (BM, 2, BN // 4)), (0, 2, 1)))
                    u0, u1 = tl.split(tl.permute(tl.reshape(ua, (BM, 2, BN // 4)), (0, 2, 1)))
                    g2, g3 = tl.split(tl.permute(tl.reshape(gb, (BM, 2, BN // 4)), (0, 2, 1)))
                    u2, u3 = tl.split(tl.permute(tl.reshape(ub, (BM, 2, BN // 4)), (0, 2, 1)))
                    q = BN // 4
                    _swiglu_store(g0, u0, c, r0, rows64, rmask, N, gu_ptr, stride_gm, out_ptr,
                                  stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU, ROW_SCALE,
                                  O_TMA)  # fmt: skip
                    _swiglu_store(g1, u1, c + q, r0, rows64, rmask, N, gu_ptr, stride_gm, out_ptr,
                                  stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU, ROW_SCALE,
                                  O_TMA)  # fmt: skip
                    _swiglu_store(g2, u2, c + 2 * q, r0, rows64, rmask, N, gu_ptr, stride_gm,
                                  out_ptr, stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU,
                                  ROW_SCALE, O_TMA)  # fmt: skip
                    _swiglu_store(g3, u3, c + 3 * q, r0, rows64, rmask, N, gu_ptr, stride_gm,
                                  out_ptr, stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU,
                                  ROW_SCALE, O_TMA)  # fmt: skip
                else:  # one piece (O_TMA; EPI_SUB 8 is the backward's only)
                    _swiglu_store(acc, acc_u, c, r0, rows64, rmask, N, gu_ptr, stride_gm, out_ptr,
                                  stride_om, rs, nbad > 0, out_desc, gu_desc, SAVE_GU, ROW_SCALE,
                                  O_TMA)  # fmt: skip
            else:
                if SAVE_GU:
                    tl.store(
                        gu_ptr + rows64[:, None] * stride_gm + cols[None, :],
                        acc.to(gu_ptr.dtype.element_ty),
                        mask=omask,
                    )
                    if ACT == 0:
                        tl.store(
                            gu_ptr + rows64[:, None] * stride_gm + N + cols[None, :],
                            acc_u.to(gu_ptr.dtype.element_ty),
                            mask=omask,
                        )
                if ACT == 0:
                    h = acc * tl.sigmoid(acc) * acc_u
                else:
                    h = apply_act(acc, ACT)
                if ROW_SCALE:
                    h = h * rs[:, None]
                if nbad > 0:
                    h = tl.full((BM, BN), float("nan"), tl.float32)
                if DACT < 0:
                    # padding rows of the tile as zeros (the backward's wgrad reads them)
                    tl.store(
                        out_ptr + rows64[:, None] * stride_om + cols[None, :],
                        tl.where(rmask[:, None], h, 0.0).to(out_ptr.dtype.element_ty),
                        mask=cmask[None, :],
                    )
                else:
                    # backward: d pre from h = d(act output) and the saved pre-activations
                    pre_rows = gu_ptr + rows64[:, None] * stride_gm
                    dst_rows = out_ptr + rows64[:, None] * stride_om
                    c = nt * BN + tl.arange(0, BN // EPI_SUB)
                    if EPI_SUB == 1:
                        p = _dact_store(h, c, pre_rows, dst_rows, rmask, N, DACT, DW)
                    else:
                        # The saved gate/up tiles of a 128x256 block beside its accumulator spill,
                        # so a sliced epilogue loads them one column slice at a time.
                        h0, h1 = tl.split(tl.permute(tl.reshape(h, (BM, 2, BN // 2)), (0, 2, 1)))
                        if EPI_SUB == 2:
                            p = _dact_store(h0, c, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(
                                h1, c + BN // 2, pre_rows, dst_rows, rmask, N, DACT, DW
                            )
                        elif EPI_SUB == 8:
                            q = BN // 8  # (offsets only: a reshape needs the constexpr inline)
                            h00, h01 = tl.split(
                                tl.permute(tl.reshape(h0, (BM, 2, BN // 4)), (0, 2, 1))
                            )
                            h10, h11 = tl.split(
                                tl.permute(tl.reshape(h1, (BM, 2, BN // 4)), (0, 2, 1))
                            )
                            a0, a1 = tl.split(
                                tl.permute(tl.reshape(h00, (BM, 2, BN // 8)), (0, 2, 1))
                            )
                            p = _dact_store(a0, c, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(a1, c + q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            a2, a3 = tl.split(
                                tl.permute(tl.reshape(h01, (BM, 2, BN // 8)), (0, 2, 1))
                            )
                            p += _dact_store(a2, c + 2 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(a3, c + 3 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            a4, a5 = tl.split(
                                tl.permute(tl.reshape(h10, (BM, 2, BN // 8)), (0, 2, 1))
                            )
                            p += _dact_store(a4, c + 4 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(a5, c + 5 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            a6, a7 = tl.split(
                                tl.permute(tl.reshape(h11, (BM, 2, BN // 8)), (0, 2, 1))
                            )
                            p += _dact_store(a6, c + 6 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(a7, c + 7 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                        else:
                            h00, h01 = tl.split(
                                tl.permute(tl.reshape(h0, (BM, 2, BN // 4)), (0, 2, 1))
                            )
                            h10, h11 = tl.split(
                                tl.permute(tl.reshape(h1, (BM, 2, BN // 4)), (0, 2, 1))
                            )
                            q = BN // 4
                            p = _dact_store(h00, c, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(h01, c + q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(h10, c + 2 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                            p += _dact_store(h11, c + 3 * q, pre_rows, dst_rows, rmask, N, DACT, DW)
                    if DW:
                        # one partial per (slot, column tile): summed (and unscaled) by
                        # row_dot.weights_grad_from_partials; padding rows have no slot
                        sl = tl.load(dw_slot_ptr + rows, mask=rmask, other=-1)
                        tl.store(dw_ptr + sl.to(tl.int64) * n_n + nt, p, mask=rmask & (sl >= 0))
            if TRACE:
                t_end = trace_clock(trace_ptr + trace_rows * 6, USE_TIMER)
                trace_record(trace_ptr, trace_rows, t, rank, pid, t_start, t_wait, t_end)
