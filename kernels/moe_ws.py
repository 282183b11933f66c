"""The MoE grouped GEMMs at one rank, warp-specialized (Hopper, Gluon): layer 0's SwiGLU
forward, the backward's dispatch GEMM, layer 1's GEMMs (forward and the backward's combine) and
the experts' weight gradients.

* forward (``FWD``): ``h = silu(gate) * up`` with ``[gate | up] = x[rows] @ w1[l]^T``, and with
  ``SAVE_GU`` the gate/up pre-activations for the backward, as ``_layer0_kernel`` does with
  ``ACT`` SwiGLU (see ``moe_layer0.py``);
* backward: ``d gu = dact(gu) * ((dy * w)[rows] @ w2[l])``: the GEMM of layer 1's backward
  (``d h``) with SwiGLU's derivative at the saved pre-activations in its epilogue, as
  ``_layer0_kernel`` does with ``DACT`` = 0;
* rows (``ROWS``): ``out[slot[r]] = a[r] @ B[l]``, each row stored at its slot for the
  reduction that follows, as ``moe_layer1._layer1_gemm_kernel`` does at one rank: layer 1's
  forward (``h @ w2[l]^T``; ``w2`` viewed ``[El * H, F]``, ``[BN, BK]`` K-major boxes,
  ``B_KMAJOR``) and the backward's combine (``d gu @ w1[l]``; ``w1`` viewed ``[El * 2F, H]``,
  ``[BK, BN]`` boxes);
* weight gradients (``WGRAD``): ``out[l] = a[rows of l]^T @ b[rows of l]``, each expert's
  contraction over its real rows only (``moe_wgrad.py`` says why), A boxes ``[BK, BM]`` read
  transposed by the wgmma, B boxes ``[BK, BN]``; tiles walk (expert, M tile, N tile), each
  expert's step count carried with the load position (an expert without rows takes one step
  and its epilogue stores zeros), the epilogue partition storing the tile into ``out [El, M,
  N]``,

each with the epilogue off the tensor cores' path. In the kernel, ``KD`` is the contraction
(x's H, layer 1's F or 2F) and ``N`` the output columns (F; layer 1's H).

When it wins: one rank, a Hopper GPU (the host takes it there; ``fused._l0_ws_usable``,
``fused._dact_ws_usable``, ``fused._l1_ws_usable`` and ``fused._wgrad_ws_usable`` say
exactly when). Layer 1: its epilogue only stores, as the forward's does, but its contraction
is short at the fine-grained shapes (F 768 at qwen3-30b-a3b: 12 K steps a tile), so the Triton
kernel's epilogue between two main loops cost it more: measured on the H200 (2026-12-05, CLI,
vs ``torch._grouped_mm`` on the same GEMM) 1.049x at qwen3-30b-a3b against the Triton kernel's
0.934x, 1.012x at olmoe against 0.931x. The weight gradients (``WGRAD``): ``MoELayer``
forward+backward 7.41 against 7.63 ms with ``grouped_mm`` at qwen3-30b-a3b, 9.05 against
9.29 at olmoe, 41.3 against 42.7 at deepseek-v3 (the Triton wgrad kernel: 43.3).

The backward's epilogue reads the saved gate and up tiles and writes ``d gu`` (8 bytes per
output element against ``2 H`` FLOPs); in the one-partition Triton kernel it runs between two
main loops, so the tensor cores idle while it waits on memory: 1.05 ms at qwen3-30b-a3b where
``torch._grouped_mm`` does the bare GEMM in 0.78 (H200, 2026-12-04; an L2 prefetch of the tile,
more column slices, two programs per SM and Triton 3.6's automatic warp specialization, which
gave wrong results, did not close it). The forward's epilogue only stores (``h``, and ``gu`` in
training): here it wins less, a few percent where its rows are gathered anyway (training) or
staged (olmoe, see below; and since the nested K loop at qwen3-30b-a3b inference too, 1.533 ms
against the Triton kernel's pointer loads' 1.594-1.598, H200, 2026-12-05).

The forward's A rows must be contiguous for TMA (Hopper's TMA cannot gather): the training
forward gathers them anyway for the wgrad; inference stages them into the workspace first.
Tried instead (2026-12-05, H200, CLI layer 0): the MMA warps copying each tile's x rows into
the ring themselves (``cp.async`` 16-byte pieces, each thread's arrival counted on the stage's
barrier, a proxy fence before the wgmma), so inference skips the staging pass. Bitwise equal to
the staged kernel, but never faster: qwen3-30b-a3b 1.532 ms against 1.533 staged, olmoe 1.97
against 1.89, deepseek-v3 8.86 against 8.01, mixtral-8x7b 13.27 against 11.78. The copies'
address math and issue, and the partition-wide ``bar.sync`` Gluon puts before each ``cp.async``
arrive, sit between the MMA warps' wgmmas every K step, and a loader partition does not fit
the register budget below.
Its B tile is two TMA boxes, ``[BN / 2, BK]`` each, of ``w1`` viewed ``[El * 2F, H]``: the gate
rows of the tile's F range and the up rows ``F`` further, side by side in one K-major stage, so
one ``m64nBNk16`` wgmma (the stage viewed transposed) makes ``[gate | up]``; the epilogue takes
the halves of ``c_smem``. A gate box past F reads up rows (an up box, the next expert's): they
only feed output columns >= F, which are never stored. ``h`` comes from gate/up rounded to the
input dtype (as the unfused pipeline's ``grouped_mm`` outputs are; the Triton kernel uses fp32
there), so it agrees with the saved ``gu`` the backward reads.

How (one persistent program per SM, two partitions, 12 warps):

* *MMA* (the default partition, 2 warp groups, ``m64nBNk16`` wgmmas): issues the TMA loads of
  the A tile (the gathered rows, ``[BM, BK]``: x in the forward, ``dy * w`` in the backward)
  and the B tile (forward: the gate and up boxes above; backward: ``w2`` viewed ``[El * H, F]``,
  ``[BK, BN]``) ``STAGES - 1`` K steps ahead into a ring (``ready[s]`` completes with the bytes;
  A columns past H are TMA's zero fill, so B rows read past the expert meet zeros), keeps one
  wgmma in flight, and refills a stage once the wgmma that read it is done. At a tile's end it
  rounds the accumulator to the input dtype into ``c_smem [BM, BN]`` (once ``c_empty`` says the
  epilogue has read the previous one) and signals ``c_ready``.
* *epilogue* (4 warps). Rows: per ``[16, 64]`` piece of ``c_smem``, stores the rows at their
  slots (loaded a tile ahead). Forward: per ``[16, 64]`` piece of each half of ``c_smem``, stores
  ``h`` (and gate, up), zeros on padding rows. Backward: per ``[16, 64]`` piece of ``c_smem``,
  with the saved gate and up (loaded a row chunk ahead, across tiles too), writes
  ``d gate = dh * up * silu'(gate)`` and ``d up = dh * silu(gate)`` (zeros on padding rows),
  and with ``DW`` sums ``d up * up`` per row into one partial per (slot, column tile), as the
  Triton kernel does (``row_dot.weights_grad_from_partials`` finishes it).

So tile ``i``'s epilogue runs while tile ``i + 1``'s main loop does. The waits are the CTA's own
mbarriers on its TMA loads and its two partitions, never on another program or rank, so there
is no spin budget to bound. ``d h`` is rounded to the input dtype before the derivative (the
unfused pipeline rounds it too: ``grouped_mm`` writes bf16); the Triton kernel keeps fp32
there, so the two agree to bf16 rounding (2.8e-3 relative), not bitwise.

``SPLIT`` (``MOE_OVERLAP_WS_SPLIT=1``; the row modes, not ``WGRAD``): the two MMA warp groups
as two partitions of one warp group each (:func:`_mma_lo` the default, with the loads;
:func:`_mma_hi` a worker), each with its own ``[64, BN]`` accumulator on its half of the
stage's A tile. A tile whose last 64 rows are all padding (the expert ends in its first 64)
costs warp group 1 no wgmma: it waits for each step's tile, releases the stage and hands the
epilogue zeros. At deepseek-v3 (256 rows an expert on average, 2.5 tiles an expert) about half
the experts' last tile is such a tile, so the row GEMMs would issue 2.25 tiles' wgmmas an
expert instead of 2.5 (~10%; the other presets, 1-3%). Warp group 0 now refills a stage only
once warp group 1 has released it too (``empty[s]``, one arrival a step; it was the same
partition's own ``warpgroup_mma_wait`` before), and ``c_ready`` takes an arrival from each
half. Deadlock-free by construction: warp group 1 waits for step ``i``'s tile before it
releases step ``i``, so it is never a ring ahead of the loads, and both wait the same
``c_empty`` phase. Same wgmmas on the same data, so bitwise equal to the unsplit kernel (the
GPU test checks it). Compiled for sm_90 on the CPU (2026-12-05, Triton 3.9's ptxas: the
worker at 160 registers like the default partition, 12 warps, no spills but 16 bytes in the
backward; ptxas neither injects a wgmma wait, C7517, nor serializes the wgmmas, C7515, which a
first version's zeroing of the accumulator on the skip path made it do in both warp groups:
found by review from the SASS, every HGMMA followed by a full wait). **Measured slower, so
off by default**: on an H100 (2026-12-06, ``tests/gpu/ab_layers.py``, three rounds, bitwise
equal to the unsplit kernels) deepseek-v3's layer 0 took 10.21 against 8.57 ms, its training
forward 9.69 / 8.77, the backward's dispatch 5.11 / 4.75, the combine 8.70 / 8.16, layer 1 4.51
/ 4.50; qwen3-30b-a3b and mixtral-8x7b lost 0-10% (mixtral's layer 0 gained 1%). The ~10% of
wgmmas it skips do not pay for what the split adds to every K step: warp group 0 issues the
next stage's loads only after an mbarrier arrival from the other partition, where the unsplit
kernel's own ``warpgroup_mma_wait`` sufficed (the likely cost, not measured apart).

Budget (Triton 3.6, sm_90a): 128x256x64, 3 stages: 3 x 48 KiB ring + 64 KiB ``c_smem`` =
208 KiB of shared memory. An ``m64n256`` wgmma needs >= 154 registers a thread at compile
time, so ``maxnreg`` is 168 and the kernel has at most 12 warps (65536 / 168 / 32); a third
partition for the loads (a loader warp) would make 13, rounded to 16 warps at 128 registers:
ptxas refused. Of the 12, ``setmaxnreg`` gives the epilogue warp group ``EPI_REGS`` = 184 and
the MMA warp groups 160 (ptxas: 8 bytes of spills a thread; 438 at 152, 1.8 KB at 128).

Measured on the H200 (``tests/gpu/ab_layers.py``, L2 flushed, medians of 2-3 rounds,
2026-12-04), qwen3-30b-a3b / olmoe. The forward, inference with its staging pass, against
``torch._grouped_mm`` (1.51 / 1.83-1.87 ms) and the Triton kernel (pointer loads, 1.58-1.61 /
1.96-2.02 ms): **1.60-1.63 / 1.97 ms**; saving gate/up 1.665 / 2.007 against Triton's 1.640 /
2.063; the first version (a global load between two wgmmas, see :func:`_mma`) 1.72-1.80 /
2.13-2.16. The backward, against ``torch._grouped_mm`` on the bare GEMM (0.78 / 0.94 ms) and
the Triton kernel (1.05 / 1.30-1.35 ms):

* this kernel: **0.91-0.92 / 1.17-1.18 ms**;
* the first version, each ``[32, 64]`` piece loading its gate/up before computing it: 1.45 /
  1.91 ms (the loads are never reordered past the stores before them, since the compiler cannot
  rule out aliasing, so every piece waited out a full memory latency);
* the epilogue's global loads and stores switched off (a diagnostic): 0.79 ms, ``grouped_mm``'s
  time: the main loop and the hand-off cost nothing extra, the epilogue's memory latency is what
  is left;
* two row chunks ahead: 1.27 ms (ptxas spilled 788 bytes a thread); an L2 prefetch of the next
  tile's gate/up while the epilogue waits: 0.96 ms; BN 128 with 4 stages: 1.24 ms; BK 32 with 5
  stages: 1.22 ms; GROUP_M 16: 0.92 ms (same).

Hopper only (``warpgroup_mma``). Gluon does not run in the interpreter: the CPU suite compiles
this kernel for sm_90 (``tests/test_compile_sm90.py``) and tests the host's choice;
``tests/gpu/test_fused_experts_gpu.py`` runs it on the H200 against the float64 reference and
against the Triton kernel.
"""

try:  # Gluon's Hopper API as of Triton 3.6 (later releases rename the TMA load)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate as aggregate

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

if HAVE_GLUON:
    # epilogue piece: SUB_R rows x SUB columns, 8 elements a thread at 4 warps; a row chunk
    # (BN // SUB pieces) is in flight while the one before it computes
    SUB_R = gl.constexpr(16)
    SUB = gl.constexpr(64)

    @aggregate
    class _Args:
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        c_smem: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        c_ready: gl.shared_memory_descriptor
        c_empty: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        pre_ptr: gl.tensor
        out_ptr: gl.tensor
        row_l_ptr: gl.tensor
        exp_end_ptr: gl.tensor
        n_tiles_ptr: gl.tensor
        dw_ptr: gl.tensor
        dw_slot_ptr: gl.tensor
        KD: gl.tensor
        N: gl.tensor
        stride_pm: gl.tensor
        stride_om: gl.tensor
        n_exp: gl.tensor
        BM: gl.constexpr
        BN: gl.constexpr
        BK: gl.constexpr
        GROUP_M: gl.constexpr
        DW: gl.constexpr
        FWD: gl.constexpr
        SAVE_GU: gl.constexpr
        ROWS: gl.constexpr
        B_KMAJOR: gl.constexpr
        CARRY: gl.constexpr
        WGRAD: gl.constexpr
        SPLIT: gl.constexpr
        MMA_WARPS: gl.constexpr
        EPI_WARPS: gl.constexpr

        @gluon.constexpr_function
        def __init__(  # fmt: skip
            self,
            a_desc,
            b_desc,
            a_bufs,
            b_bufs,
            c_smem,
            ready,
            c_ready,
            c_empty,
            empty,
            pre_ptr,
            out_ptr,
            row_l_ptr,
            exp_end_ptr,
            n_tiles_ptr,
            dw_ptr,
            dw_slot_ptr,
            KD,
            N,
            stride_pm,
            stride_om,
            n_exp,
            BM,
            BN,
            BK,
            GROUP_M,
            DW,
            FWD,
            SAVE_GU,
            ROWS,
            B_KMAJOR,
            CARRY,
            WGRAD,
            SPLIT,
            MMA_WARPS,
            EPI_WARPS,
        ):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.c_smem = c_smem
            self.ready = ready
            self.c_ready = c_ready
            self.c_empty = c_empty
            self.empty = empty
            self.pre_ptr = pre_ptr
            self.out_ptr = out_ptr
            self.row_l_ptr = row_l_ptr
            self.exp_end_ptr = exp_end_ptr
            self.n_tiles_ptr = n_tiles_ptr
            self.dw_ptr = dw_ptr
            self.dw_slot_ptr = dw_slot_ptr
            self.KD = KD
            self.N = N
            self.stride_pm = stride_pm
            self.stride_om = stride_om
            self.n_exp = n_exp
            self.BM = gl.constexpr(BM)
            self.BN = gl.constexpr(BN)
            self.BK = gl.constexpr(BK)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.DW = gl.constexpr(DW)
            self.FWD = gl.constexpr(FWD)
            self.SAVE_GU = gl.constexpr(SAVE_GU)
            self.ROWS = gl.constexpr(ROWS)
            self.B_KMAJOR = gl.constexpr(B_KMAJOR)
            self.CARRY = gl.constexpr(CARRY)
            self.WGRAD = gl.constexpr(WGRAD)
            self.SPLIT = gl.constexpr(SPLIT)
            self.MMA_WARPS = gl.constexpr(MMA_WARPS)
            self.EPI_WARPS = gl.constexpr(EPI_WARPS)

    @gluon.jit
    def _tile_of(t, n_m, n_n, GROUP_M: gl.constexpr):
        # the same grouped order as moe_layer0.tile_coords
        group = GROUP_M * n_n
        first_m = (t // group) * GROUP_M
        # at least 1: past the last tile (masked off by the callers) it would divide by 0
        gsize = gl.maximum(gl.minimum(n_m - first_m, GROUP_M), 1)
        return first_m + (t % group) % gsize, (t % group) // gsize

    @gluon.constexpr_function
    def _cols_per_tile(BN, FWD):
        # the forward's tile holds BN / 2 gate and BN / 2 up columns of one F range
        return BN // 2 if FWD else BN

    @gluon.jit
    def _issue_tile(p, ti, pid, nprog, n_m, n_n):
        """(first row, N tile, local expert) of this program's ``ti``-th tile (expert 0 past
        the last tile: its steps are never issued)."""
        t = pid + ti * nprog
        mt, nt = _tile_of(t, n_m, n_n, p.GROUP_M)
        r0 = mt * p.BM
        return r0, nt, gl.load(p.row_l_ptr + r0, mask=t < n_m * n_n, other=0)

    @gluon.jit
    def _next_issue(p, st, pid, nprog, n_m, n_n, n_k):
        """The issue position one K step on: ``st`` = (K step, tile, its row, N tile, expert,
        and the next tile's row, N tile, expert). The next tile's expert is loaded a whole tile
        before its first step is issued, so the MMA warps never wait on that load."""
        kk, ti, r0, nt, le, r0n, ntn, len_ = st
        kk += 1
        wrap = kk == n_k
        kk = gl.where(wrap, 0, kk)
        ti = gl.where(wrap, ti + 1, ti)
        if wrap:
            r0 = r0n
            nt = ntn
            le = len_
            r0n, ntn, len_ = _issue_tile(p, ti + 1, pid, nprog, n_m, n_n)
        return kk, ti, r0, nt, le, r0n, ntn, len_

    @gluon.jit
    def _issue(p, ip, n_iter, st):
        """TMA loads of this program's K step ``ip`` (over all its tiles; ``st`` from
        :func:`_next_issue`) into stage ``ip % STAGES``; nothing past the last step. No global
        load here: it would sit on the MMA warps' path between two wgmmas."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        kk, ti, r0, nt, le, r0n, ntn, len_ = st
        go = ip < n_iter
        s = ip % STAGES
        if p.FWD:
            # w1 viewed [El * 2F, H]: the gate box (rows f0..) and the up box (rows F + f0..)
            # side by side in one [BN, BK] stage. A gate box past F reads up rows (and an up box
            # the next expert's): those only feed output columns >= F, which are never stored.
            NB: gl.constexpr = p.BN // 2
            nbytes: gl.constexpr = p.a_desc.block_type.nbytes + 2 * p.b_desc.block_type.nbytes
            brow = le * (2 * p.N) + nt * NB
            b = p.b_bufs.index(s)
            mbarrier.expect(p.ready.index(s), nbytes, pred=go)
            _tma_load(p.a_desc, [r0, kk * p.BK], p.ready.index(s), p.a_bufs.index(s), pred=go)
            _tma_load(p.b_desc, [brow, kk * p.BK], p.ready.index(s), b.slice(0, NB, dim=0),
                      pred=go)  # fmt: skip
            _tma_load(p.b_desc, [brow + p.N, kk * p.BK], p.ready.index(s), b.slice(NB, NB, dim=0),
                      pred=go)  # fmt: skip
        else:
            nbytes2: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
            mbarrier.expect(p.ready.index(s), nbytes2, pred=go)
            _tma_load(p.a_desc, [r0, kk * p.BK], p.ready.index(s), p.a_bufs.index(s), pred=go)
            if p.B_KMAJOR:
                # w viewed [El * N, KD] (layer 1's w2): the tile's N rows. Columns past KD are
                # TMA's zero fill; rows past the expert only feed output columns >= N (unstored)
                _tma_load(p.b_desc, [le * p.N + nt * p.BN, kk * p.BK], p.ready.index(s),
                          p.b_bufs.index(s), pred=go)  # fmt: skip
            else:
                # w viewed [El * KD, N]. A columns past KD are TMA's zero fill, so B rows read
                # past the expert (the next expert's) meet zeros: finite weights assumed, as a
                # NaN there would still poison this expert's rows (0 * NaN)
                _tma_load(p.b_desc, [le * p.KD + kk * p.BK, nt * p.BN], p.ready.index(s),
                          p.b_bufs.index(s), pred=go)  # fmt: skip

    @gluon.jit
    def _issue_at(p, ip, n_iter, pid, nprog, n_m, n_n, n_k):
        """:func:`_issue` with the position worked out from ``ip`` and the expert loaded here:
        the backward's path (see :func:`_mma`)."""
        ti = ip // n_k
        kk = ip - ti * n_k
        t = pid + ti * nprog
        mt, nt = _tile_of(t, n_m, n_n, p.GROUP_M)
        r0 = mt * p.BM
        le = gl.load(p.row_l_ptr + r0, mask=ip < n_iter, other=0)
        _issue(p, ip, n_iter, (kk, ti, r0, nt, le, r0, nt, le))

    @gluon.jit
    def _mma_start(p):
        """The loading partition's start: its tile and step counts, and the loads of its first
        ``STAGES - 1`` K steps issued; returns them with the carried issue position."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.N, _cols_per_tile(p.BN, p.FWD))
        n_k = gl.cdiv(p.KD, p.BK)
        n_iter = gl.cdiv(gl.maximum(n_m * n_n - pid, 0), nprog) * n_k
        r0, nt, le = _issue_tile(p, 0, pid, nprog, n_m, n_n)
        r0n, ntn, len_ = _issue_tile(p, 1, pid, nprog, n_m, n_n)
        zero = pid * 0
        st = (zero, zero, r0, nt, le, r0n, ntn, len_)
        for ip in gl.static_range(STAGES - 1):
            if p.CARRY:
                _issue(p, ip, n_iter, st)
                st = _next_issue(p, st, pid, nprog, n_m, n_n, n_k)
            else:
                _issue_at(p, ip, n_iter, pid, nprog, n_m, n_n, n_k)
        return pid, nprog, n_m, n_n, n_k, n_iter, st

    @gluon.jit
    def _mma(p):
        """Default partition: issues the loads STAGES - 1 steps ahead and the wgmmas; hands
        each finished tile to the epilogue through ``c_smem``.

        Where the loads' positions come from is ``CARRY``'s choice, as measured (H200,
        ab_layers, 2026-12-04, with the drain below): the forward carries them from step to
        step and loads a tile's expert one tile ahead (qwen3-30b-a3b 1.686 -> 1.625 ms, olmoe
        2.045 -> 1.970, against a load between every two wgmmas); the backward's dispatch GEMM,
        the same change made slower (0.906 -> 0.969, 1.144 -> 1.223 ms), so it keeps the
        per-step load (:func:`_issue_at`); layer 1 carries (measured 2026-12-05 with it).

        The K loop sits inside the tile loop. As one flat loop with the tile's end under an
        ``if`` (the first version, every number above), ptxas (12.8 and 13.4, sm_90a) drained
        every wgmma at the loop's back edge (C7517, "warpgroup.wait is injected ... to allow use
        of registers defined by GMMA": the accumulator is redefined under the branch), so no
        wgmma stayed in flight from one K step to the next and whatever the MMA warps did
        between two wgmmas (the barrier wait, the next TMA issue, a global load) idled the
        tensor cores. ``tests/test_compile_sm90.py`` checks that ptxas injects no such wait."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[p.MMA_WARPS, 1], instr_shape=[16, p.BN, 16]
        )
        pid, nprog, n_m, n_n, n_k, n_iter, st = _mma_start(p)
        zero = pid * 0
        acc = gl.zeros((p.BM, p.BN), gl.float32, layout=layout)
        ic = zero
        for j in range(n_iter // n_k):
            for kk in range(n_k):
                s = ic % STAGES
                mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
                if p.B_KMAJOR:  # K-major weight tiles: the transposed view, as wgmma reads it
                    acc = warpgroup_mma(
                        p.a_bufs.index(s),
                        p.b_bufs.index(s).permute((1, 0)),
                        acc,
                        use_acc=kk > 0,
                        is_async=True,
                    )
                else:
                    acc = warpgroup_mma(
                        p.a_bufs.index(s), p.b_bufs.index(s), acc, use_acc=kk > 0, is_async=True
                    )
                # step ic - 1's wgmma is done: its stage takes step ic + STAGES - 1
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if p.CARRY:
                    _issue(p, ic + STAGES - 1, n_iter, st)
                    st = _next_issue(p, st, pid, nprog, n_m, n_n, n_k)
                else:
                    _issue_at(p, ic + STAGES - 1, n_iter, pid, nprog, n_m, n_n, n_k)
                ic += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.wait(p.c_empty, (j & 1) ^ 1)  # a fresh barrier passes phase 1
            p.c_smem.store(acc.to(p.out_ptr.dtype.element_ty))
            fence_async_shared()
            mbarrier.arrive(p.c_ready)

    @gluon.jit
    def _wgmma_half(p, s, acc, kk, LO: gl.constexpr):
        """One K step of one warp group: its 64 rows of the stage's A tile (``LO``: the first
        64) against the whole B tile."""
        HALF: gl.constexpr = p.BM // 2
        a = p.a_bufs.index(s).slice(0 if LO else HALF, HALF, dim=0)
        if p.B_KMAJOR:
            acc = warpgroup_mma(a, p.b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)  # fmt: skip
        else:
            acc = warpgroup_mma(a, p.b_bufs.index(s), acc, use_acc=kk > 0, is_async=True)
        return acc

    @gluon.jit
    def _mma_lo(p):
        """``SPLIT``'s default partition, warp group 0: the tile's first 64 rows (never all
        padding: a tile exists only for an expert row), and the loads as in :func:`_mma`, a
        stage refilled once warp group 1 has released it too (``empty``)."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        HALF: gl.constexpr = p.BM // 2
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[p.MMA_WARPS, 1], instr_shape=[16, p.BN, 16]
        )
        pid, nprog, n_m, n_n, n_k, n_iter, st = _mma_start(p)
        zero = pid * 0
        acc = gl.zeros((HALF, p.BN), gl.float32, layout=layout)
        ic = zero
        for j in range(n_iter // n_k):
            for kk in range(n_k):
                s = ic % STAGES
                mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
                acc = _wgmma_half(p, s, acc, kk, True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # step ic + STAGES - 1 takes the stage of step ic - 1, once warp group 1 is
                # done with it too (its first use passes: a fresh barrier passes phase 1)
                iq = ic + STAGES - 1
                mbarrier.wait(p.empty.index(iq % STAGES), ((iq // STAGES) & 1) ^ 1)
                if p.CARRY:
                    _issue(p, iq, n_iter, st)
                    st = _next_issue(p, st, pid, nprog, n_m, n_n, n_k)
                else:
                    _issue_at(p, iq, n_iter, pid, nprog, n_m, n_n, n_k)
                ic += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.wait(p.c_empty, (j & 1) ^ 1)
            p.c_smem.slice(0, HALF, dim=0).store(acc.to(p.out_ptr.dtype.element_ty))
            fence_async_shared()
            mbarrier.arrive(p.c_ready)

    @gluon.jit
    def _tile_row0(p, t, n_m, n_n, total):
        """(first row, its local expert) of tile ``t``; expert 0 past the last tile."""
        mt, _ = _tile_of(t, n_m, n_n, p.GROUP_M)
        r0 = mt * p.BM
        return r0, gl.load(p.row_l_ptr + r0, mask=t < total, other=0)

    @gluon.jit
    def _mma_hi(p):
        """``SPLIT``'s worker partition, warp group 1: the tile's last 64 rows. Where they are
        all padding (the expert ends in the first 64: about half the experts' last tile when
        each has ~256 rows, as at deepseek-v3), it issues no wgmma and hands the epilogue
        zeros; it still waits for each step's tile and releases its stage, so the two warp
        groups stay on the same step of the ring.

        The tile's expert end takes two dependent loads (the row's expert, then its end): the
        expert is loaded two tiles ahead and the end one tile ahead, so neither sits between
        two wgmmas."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        HALF: gl.constexpr = p.BM // 2
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[p.MMA_WARPS, 1], instr_shape=[16, p.BN, 16]
        )
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.N, _cols_per_tile(p.BN, p.FWD))
        n_k = gl.cdiv(p.KD, p.BK)
        total = n_m * n_n
        mine = gl.cdiv(gl.maximum(total - pid, 0), nprog)
        r0, le = _tile_row0(p, pid, n_m, n_n, total)
        end = gl.load(p.exp_end_ptr + le, mask=pid < total, other=0)
        r0n, len_ = _tile_row0(p, pid + nprog, n_m, n_n, total)
        acc = gl.zeros((HALF, p.BN), gl.float32, layout=layout)
        ic = pid * 0
        for j in range(mine):
            t = pid + j * nprog
            r0nn, lenn = _tile_row0(p, t + 2 * nprog, n_m, n_n, total)
            endn = gl.load(p.exp_end_ptr + len_, mask=t + nprog < total, other=0)
            if r0 + HALF < end:
                for kk in range(n_k):
                    s = ic % STAGES
                    mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
                    acc = _wgmma_half(p, s, acc, kk, False)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    # step ic - 1's wgmma is done: its stage may be refilled
                    mbarrier.arrive(p.empty.index((ic + STAGES - 1) % STAGES), pred=kk > 0)
                    ic += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(p.empty.index((ic + STAGES - 1) % STAGES))
                mbarrier.wait(p.c_empty, (j & 1) ^ 1)
                p.c_smem.slice(HALF, HALF, dim=0).store(acc.to(p.out_ptr.dtype.element_ty))
            else:
                for _kk in range(n_k):
                    s = ic % STAGES
                    mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
                    mbarrier.arrive(p.empty.index(s))
                    ic += 1
                # zeros, not whatever c_smem held: the backward's epilogue multiplies these
                # rows by zeros, and uninitialized shared memory may hold NaN. Stored from a
                # tensor of their own: zeroing the accumulator here (a plain register write to
                # wgmma's operand) made ptxas serialize every wgmma of the kernel (C7515)
                mbarrier.wait(p.c_empty, (j & 1) ^ 1)
                zeros = gl.zeros((HALF, p.BN), p.out_ptr.dtype.element_ty, layout=layout)
                p.c_smem.slice(HALF, HALF, dim=0).store(zeros)
            fence_async_shared()
            mbarrier.arrive(p.c_ready)
            r0 = r0n
            end = endn
            r0n = r0nn
            len_ = lenn

    @gluon.jit
    def _tile_rows(p, t, n_m, n_n, total):
        """(first row, N tile, end of its expert's rows) of tile ``t``; end 0 past the last
        tile, so every load for it is masked off."""
        ok = t < total
        mt, nt = _tile_of(t, n_m, n_n, p.GROUP_M)
        r0 = mt * p.BM
        le = gl.load(p.row_l_ptr + r0, mask=ok, other=0)
        return r0, nt, gl.load(p.exp_end_ptr + le, mask=ok, other=0)

    @gluon.jit
    def _load_pre(p, r0, rc: gl.constexpr, nt, end, ROWS: gl.constexpr, COLS: gl.constexpr):
        """The saved gate and up of row chunk ``rc`` of a tile: ``BN // SUB`` pieces each."""
        rows = r0 + rc * SUB_R + gl.arange(0, SUB_R, layout=ROWS)
        keep = rows < end
        gs = ()
        us = ()
        for ch in gl.static_range(p.BN // SUB):
            cols = nt * p.BN + ch * SUB + gl.arange(0, SUB, layout=COLS)
            m2 = keep[:, None] & (cols < p.N)[None, :]
            src = p.pre_ptr + (rows[:, None] * p.stride_pm + cols[None, :])
            gs = gs + (gl.load(src, mask=m2, other=0.0),)
            us = us + (gl.load(src + p.N, mask=m2, other=0.0),)
        return gs, us

    @gluon.jit
    def _epilogue(p):
        """Worker partition. Memory-latency bound, so the saved gate/up of the next row chunk
        (across tiles too) are in flight while this chunk computes and stores: loads are never
        reordered past the stores before them (the compiler cannot rule out aliasing), so a
        chunk-at-a-time loop waited out a full memory latency per chunk."""
        EL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [p.EPI_WARPS, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, EL)
        COLS: gl.constexpr = gl.SliceLayout(0, EL)
        NR: gl.constexpr = p.BM // SUB_R
        dt = p.out_ptr.dtype.element_ty
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.N, p.BN)
        total = n_m * n_n
        r0, nt, end = _tile_rows(p, pid, n_m, n_n, total)
        nxt = _load_pre(p, r0, 0, nt, end, ROWS, COLS)
        j = 0
        for t in range(pid, total, nprog):
            r0n, ntn, endn = _tile_rows(p, t + nprog, n_m, n_n, total)
            mbarrier.wait(p.c_ready, j & 1)
            for rc in gl.static_range(NR):
                gs, us = nxt
                if rc + 1 < NR:
                    nxt = _load_pre(p, r0, rc + 1, nt, end, ROWS, COLS)
                else:
                    nxt = _load_pre(p, r0n, 0, ntn, endn, ROWS, COLS)
                rows = r0 + rc * SUB_R + gl.arange(0, SUB_R, layout=ROWS)
                keep = rows < end
                part = gl.zeros([SUB_R], gl.float32, layout=ROWS)
                for ch in gl.static_range(p.BN // SUB):
                    piece = p.c_smem.slice(rc * SUB_R, SUB_R, dim=0).slice(ch * SUB, SUB, dim=1)
                    h = piece.load(EL).to(gl.float32)
                    g = gs[ch].to(gl.float32)
                    u = us[ch].to(gl.float32)
                    cols = nt * p.BN + ch * SUB + gl.arange(0, SUB, layout=COLS)
                    cm = cols < p.N
                    sg = 1.0 / (1.0 + gl.exp(-g))
                    # masked loads gave g = u = 0 on padding rows: both derivatives are 0 there
                    d_g = h * u * sg * (1.0 + g * (1.0 - sg))
                    d_u = h * g * sg
                    dst = p.out_ptr + (rows[:, None] * p.stride_om + cols[None, :])
                    sm = (rows >= 0)[:, None] & cm[None, :]
                    gl.store(dst, d_g.to(dt), mask=sm)
                    gl.store(dst + p.N, d_u.to(dt), mask=sm)
                    if p.DW:
                        part += gl.sum(d_u * u, axis=1)
                if p.DW:
                    sl = gl.load(p.dw_slot_ptr + rows, mask=keep, other=-1)
                    gl.store(p.dw_ptr + sl.to(gl.int64) * n_n + nt, part, mask=keep & (sl >= 0))
            # every warp of this partition has read c_smem before the MMA partition rewrites it
            _partition_barrier()
            mbarrier.arrive(p.c_empty)
            r0 = r0n
            nt = ntn
            end = endn
            j += 1

    @gluon.jit
    def _epilogue_fwd(p):
        """Worker partition of the forward: ``h = silu(gate) * up`` from the tile's two halves
        in ``c_smem`` (and, with ``SAVE_GU``, gate and up themselves for the backward), zeros on
        padding rows. Stores only: nothing here waits on memory but the tile's row metadata,
        loaded before the tile is ready."""
        EL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [p.EPI_WARPS, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, EL)
        COLS: gl.constexpr = gl.SliceLayout(0, EL)
        NR: gl.constexpr = p.BM // SUB_R
        NB: gl.constexpr = p.BN // 2
        dt = p.out_ptr.dtype.element_ty
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.N, NB)
        total = n_m * n_n
        j = 0
        for t in range(pid, total, nprog):
            r0, nt, end = _tile_rows(p, t, n_m, n_n, total)
            mbarrier.wait(p.c_ready, j & 1)
            for rc in gl.static_range(NR):
                rows = r0 + rc * SUB_R + gl.arange(0, SUB_R, layout=ROWS)
                keep = (rows < end)[:, None]
                for ch in gl.static_range(NB // SUB):
                    chunk = p.c_smem.slice(rc * SUB_R, SUB_R, dim=0)
                    g = chunk.slice(ch * SUB, SUB, dim=1).load(EL).to(gl.float32)
                    u = chunk.slice(NB + ch * SUB, SUB, dim=1).load(EL).to(gl.float32)
                    # the staged padding rows are zeros already; this keeps h's zeros there
                    # whatever the A buffer held
                    g = gl.where(keep, g, 0.0)
                    u = gl.where(keep, u, 0.0)
                    cols = nt * NB + ch * SUB + gl.arange(0, SUB, layout=COLS)
                    sm = (rows >= 0)[:, None] & (cols < p.N)[None, :]
                    hv = g / (1.0 + gl.exp(-g)) * u
                    gl.store(p.out_ptr + (rows[:, None] * p.stride_om + cols[None, :]),
                             hv.to(dt), mask=sm)  # fmt: skip
                    if p.SAVE_GU:
                        dst = p.pre_ptr + (rows[:, None] * p.stride_pm + cols[None, :])
                        gl.store(dst, g.to(dt), mask=sm)
                        gl.store(dst + p.N, u.to(dt), mask=sm)
            # every warp of this partition has read c_smem before the MMA partition rewrites it
            _partition_barrier()
            mbarrier.arrive(p.c_empty)
            j += 1

    @gluon.jit
    def _tile_slots(p, r0, end, ROWS: gl.constexpr):
        """The slots of a tile's rows, one ``[SUB_R]`` vector per row chunk (-1 past ``end``)."""
        slots = ()
        for rc in gl.static_range(p.BM // SUB_R):
            rows = r0 + rc * SUB_R + gl.arange(0, SUB_R, layout=ROWS)
            slots = slots + (gl.load(p.dw_slot_ptr + rows, mask=rows < end, other=-1),)
        return slots

    @gluon.jit
    def _epilogue_rows(p):
        """Worker partition of the layer-1 kind (``ROWS``): each row of the tile goes to its
        slot, ``out[slot[r], cols] = c[r, cols]``; padding rows and dropped slots are never
        written. The next tile's slots are loaded before this one's are stored, so the stores
        never wait on a load."""
        EL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [p.EPI_WARPS, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, EL)
        COLS: gl.constexpr = gl.SliceLayout(0, EL)
        NR: gl.constexpr = p.BM // SUB_R
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.N, p.BN)
        total = n_m * n_n
        r0, nt, end = _tile_rows(p, pid, n_m, n_n, total)
        slots = _tile_slots(p, r0, end, ROWS)
        j = 0
        for t in range(pid, total, nprog):
            r0n, ntn, endn = _tile_rows(p, t + nprog, n_m, n_n, total)
            nxt = _tile_slots(p, r0n, endn, ROWS)
            mbarrier.wait(p.c_ready, j & 1)
            for rc in gl.static_range(NR):
                sl = slots[rc]
                dst = p.out_ptr + sl.to(gl.int64)[:, None] * p.stride_om
                for ch in gl.static_range(p.BN // SUB):
                    v = p.c_smem.slice(rc * SUB_R, SUB_R, dim=0).slice(ch * SUB, SUB, dim=1)
                    cols = nt * p.BN + ch * SUB + gl.arange(0, SUB, layout=COLS)
                    sm = (sl >= 0)[:, None] & (cols < p.N)[None, :]
                    gl.store(dst + cols[None, :], v.load(EL), mask=sm)
            # every warp of this partition has read c_smem before the MMA partition rewrites it
            _partition_barrier()
            mbarrier.arrive(p.c_empty)
            r0 = r0n
            nt = ntn
            end = endn
            slots = nxt
            j += 1

    @gluon.jit
    def _wg_tile(p, ti, pid, nprog, mine, per, n_mt, n_nt):
        """(first row, M tile, N tile, K steps, expert) of this program's ``ti``-th weight-gradient
        tile; an expert without rows takes one step (its epilogue stores zeros), and a tile past
        the program's last reads nothing."""
        ok = ti < mine
        t = pid + ti * nprog
        le = t // per
        mt, nt = _tile_of(t - le * per, n_mt, n_nt, p.GROUP_M)
        s0 = gl.load(p.row_l_ptr + le, mask=ok, other=0)
        e0 = gl.load(p.exp_end_ptr + le, mask=ok, other=0)
        return s0, mt, nt, gl.maximum(gl.cdiv(e0 - s0, p.BK), 1), le

    @gluon.jit
    def _wg_issue(p, ip, st, mine):
        """TMA loads of step ``ip`` (position ``st``) into stage ``ip % STAGES``: the expert's
        rows ``[s0 + kk * BK, + BK)`` of A's M tile and B's N tile (past its last real row, its
        own zero padding: ``BK`` divides BLOCK_M); nothing past the program's last tile."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        kk, ti, s0, mt, nt, nk, nxt = st
        go = ti < mine
        s = ip % STAGES
        nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        row = s0 + kk * p.BK
        mbarrier.expect(p.ready.index(s), nbytes, pred=go)
        _tma_load(p.a_desc, [row, mt * p.BM], p.ready.index(s), p.a_bufs.index(s), pred=go)
        _tma_load(p.b_desc, [row, nt * p.BN], p.ready.index(s), p.b_bufs.index(s), pred=go)

    @gluon.jit
    def _wg_next(p, st, pid, nprog, mine, per, n_mt, n_nt):
        """The issue position one step on (the next tile's position loaded a tile ahead)."""
        kk, ti, s0, mt, nt, nk, nxt = st
        kk += 1
        if kk == nk:
            kk = kk * 0
            ti += 1
            s0, mt, nt, nk = nxt
            s1, mt1, nt1, nk1, _ = _wg_tile(p, ti + 1, pid, nprog, mine, per, n_mt, n_nt)
            nxt = (s1, mt1, nt1, nk1)
        return kk, ti, s0, mt, nt, nk, nxt

    @gluon.jit
    def _mma_wgrad(p):
        """Default partition of ``WGRAD``: ``out[l] = a[rows of l]^T @ b[rows of l]`` tile by
        tile, each expert's K loop over its real rows only; the loads run ``STAGES - 1`` steps
        ahead across tiles (a tile's K steps are the expert's, so the count is carried, not
        computed), one wgmma in flight, the finished tile handed to the epilogue as in
        :func:`_mma`."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[p.MMA_WARPS, 1], instr_shape=[16, p.BN, 16]
        )
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_mt = gl.cdiv(p.KD, p.BM)
        n_nt = gl.cdiv(p.N, p.BN)
        per = n_mt * n_nt
        mine = gl.cdiv(gl.maximum(p.n_exp * per - pid, 0), nprog)
        s0, mt, nt, nk, _ = _wg_tile(p, 0, pid, nprog, mine, per, n_mt, n_nt)
        s1, mt1, nt1, nk1, _ = _wg_tile(p, 1, pid, nprog, mine, per, n_mt, n_nt)
        zero = pid * 0
        st = (zero, zero, s0, mt, nt, nk, (s1, mt1, nt1, nk1))
        for ip in gl.static_range(STAGES - 1):
            _wg_issue(p, ip, st, mine)
            st = _wg_next(p, st, pid, nprog, mine, per, n_mt, n_nt)
        acc = gl.zeros((p.BM, p.BN), gl.float32, layout=layout)
        ic = zero
        for j in range(mine):
            # The tile's step count, loaded here (the issue side loaded the same two ints a tile
            # ago: a cache hit). Trap (Triton 3.6, not 3.9): carried from the previous iteration
            # with no use but this loop's bound, the count was folded to tile 0's, so every tile
            # ran tile 0's step count against the issue side's own (a hang, or sums split across
            # tiles); found by review on the CPU from the TTGIR.
            _, _, _, cur, _ = _wg_tile(p, j, pid, nprog, mine, per, n_mt, n_nt)
            for kk in range(cur):
                s = ic % STAGES
                mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
                acc = warpgroup_mma(p.a_bufs.index(s).permute((1, 0)), p.b_bufs.index(s), acc,
                                    use_acc=kk > 0, is_async=True)  # fmt: skip
                # step ic - 1's wgmma is done: its stage takes step ic + STAGES - 1
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _wg_issue(p, ic + STAGES - 1, st, mine)
                st = _wg_next(p, st, pid, nprog, mine, per, n_mt, n_nt)
                ic += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.wait(p.c_empty, (j & 1) ^ 1)  # a fresh barrier passes phase 1
            p.c_smem.store(acc.to(p.out_ptr.dtype.element_ty))
            fence_async_shared()
            mbarrier.arrive(p.c_ready)

    @gluon.jit
    def _epilogue_wgrad(p):
        """Worker partition of ``WGRAD``: stores the tile into ``out [El, M, N]`` (``KD`` is M
        here), zeros for an expert without rows (its one step read another expert's rows)."""
        EL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [p.EPI_WARPS, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, EL)
        COLS: gl.constexpr = gl.SliceLayout(0, EL)
        NR: gl.constexpr = p.BM // SUB_R
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_mt = gl.cdiv(p.KD, p.BM)
        n_nt = gl.cdiv(p.N, p.BN)
        per = n_mt * n_nt
        mine = gl.cdiv(gl.maximum(p.n_exp * per - pid, 0), nprog)
        s0, mt, nt, nk, le = _wg_tile(p, 0, pid, nprog, mine, per, n_mt, n_nt)
        e0 = gl.load(p.exp_end_ptr + le, mask=mine > 0, other=0)
        for j in range(mine):
            s1, mt1, nt1, nk1, le1 = _wg_tile(p, j + 1, pid, nprog, mine, per, n_mt, n_nt)
            e1 = gl.load(p.exp_end_ptr + le1, mask=j + 1 < mine, other=0)
            empty = e0 == s0
            base = p.out_ptr + le.to(gl.int64) * p.KD * p.N
            mbarrier.wait(p.c_ready, j & 1)
            for rc in gl.static_range(NR):
                m = mt * p.BM + rc * SUB_R + gl.arange(0, SUB_R, layout=ROWS)
                dst = base + m.to(gl.int64)[:, None] * p.N
                for ch in gl.static_range(p.BN // SUB):
                    v = p.c_smem.slice(rc * SUB_R, SUB_R, dim=0).slice(ch * SUB, SUB, dim=1)
                    v = v.load(EL)
                    v = gl.where(empty, gl.zeros_like(v), v)
                    n = nt * p.BN + ch * SUB + gl.arange(0, SUB, layout=COLS)
                    sm = (m < p.KD)[:, None] & (n < p.N)[None, :]
                    gl.store(dst + n[None, :], v, mask=sm)
            # every warp of this partition has read c_smem before the MMA partition rewrites it
            _partition_barrier()
            mbarrier.arrive(p.c_empty)
            s0 = s1
            mt = mt1
            nt = nt1
            le = le1
            e0 = e1

    # n_exp (WGRAD's expert count) may be 1, which the launcher would otherwise turn into a
    # constexpr the aggregate does not take
    @gluon.jit(do_not_specialize=["n_exp"])
    def _moe_ws_kernel(
        a_desc,
        b_desc,
        pre_ptr,
        out_ptr,
        row_l_ptr,
        exp_end_ptr,
        n_tiles_ptr,
        dw_ptr,
        dw_slot_ptr,
        KD,
        N,
        stride_pm,
        stride_om,
        n_exp,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        DW: gl.constexpr,
        FWD: gl.constexpr,
        SAVE_GU: gl.constexpr,
        ROWS: gl.constexpr,
        B_KMAJOR: gl.constexpr,
        CARRY: gl.constexpr,
        WGRAD: gl.constexpr,
        EPI_WARPS: gl.constexpr,
        EPI_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        SPLIT: gl.constexpr = False,
        MMA_REGS: gl.constexpr = 160,
    ):
        dt: gl.constexpr = a_desc.dtype
        if WGRAD:  # the rows' A tiles [BK, BM], read transposed
            a_bufs = gl.allocate_shared_memory(dt, [STAGES, BK, BM], a_desc.layout)
        else:
            a_bufs = gl.allocate_shared_memory(dt, [STAGES, BM, BK], a_desc.layout)
        if B_KMAJOR:  # K-major weight tiles (the forward's: gate rows then up rows)
            b_bufs = gl.allocate_shared_memory(dt, [STAGES, BN, BK], b_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(dt, [STAGES, BK, BN], b_desc.layout)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dt)
        c_smem = gl.allocate_shared_memory(dt, [BM, BN], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # SPLIT: warp group 1 releases each stage (empty), and both halves of c_smem must be
        # stored before the epilogue reads it (c_ready counts two arrivals)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        mbarrier.init(c_ready, count=2 if SPLIT else 1)
        mbarrier.init(c_empty, count=1)
        p = _Args(a_desc, b_desc, a_bufs, b_bufs, c_smem, ready, c_ready, c_empty, empty,
                  pre_ptr, out_ptr, row_l_ptr, exp_end_ptr, n_tiles_ptr, dw_ptr, dw_slot_ptr,
                  KD, N, stride_pm, stride_om, n_exp, BM, BN, BK, GROUP_M, DW, FWD, SAVE_GU, ROWS,
                  B_KMAJOR, CARRY, WGRAD, SPLIT, num_warps, EPI_WARPS)  # fmt: skip
        if SPLIT:  # one partition per MMA warp group (num_warps 4), rows mode or layer 0's
            if FWD:
                gl.warp_specialize([(_mma_lo, (p,)), (_mma_hi, (p,)), (_epilogue_fwd, (p,))],
                                   [4, EPI_WARPS], [MMA_REGS, EPI_REGS])  # fmt: skip
            elif ROWS:
                gl.warp_specialize([(_mma_lo, (p,)), (_mma_hi, (p,)), (_epilogue_rows, (p,))],
                                   [4, EPI_WARPS], [MMA_REGS, EPI_REGS])  # fmt: skip
            else:
                gl.warp_specialize([(_mma_lo, (p,)), (_mma_hi, (p,)), (_epilogue, (p,))],
                                   [4, EPI_WARPS], [MMA_REGS, EPI_REGS])  # fmt: skip
        elif WGRAD:
            gl.warp_specialize([(_mma_wgrad, (p,)), (_epilogue_wgrad, (p,))], [EPI_WARPS],
                               [EPI_REGS])  # fmt: skip
        elif FWD:
            gl.warp_specialize([(_mma, (p,)), (_epilogue_fwd, (p,))], [EPI_WARPS], [EPI_REGS])
        elif ROWS:
            gl.warp_specialize([(_mma, (p,)), (_epilogue_rows, (p,))], [EPI_WARPS], [EPI_REGS])
        else:
            gl.warp_specialize([(_mma, (p,)), (_epilogue, (p,))], [EPI_WARPS], [EPI_REGS])


def _gl_dtype(t):
    return {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16}[str(t.dtype)]


def _launch(a_desc, b_desc, pre, out, layout, dw, slot, KD, N, cfg, n_programs, mode, save=False):
    """One launch of :func:`_moe_ws_kernel`. ``mode``: "swiglu" (``save``: gate/up too),
    "dact", "rows" (weights ``[El, KD, N]``) or "rows_t" (``[El, N, KD]``, K-major tiles).
    ``cfg["CARRY"]``, where set, picks the load-position path (:func:`_mma`) for every mode; by
    default only the backward's dispatch GEMM loads its position per step."""
    DW = dw is not None
    fwd = mode == "swiglu"
    rows = mode in ("rows", "rows_t")
    carry = cfg.get("CARRY")
    split = bool(cfg.get("SPLIT", False))
    _moe_ws_kernel[(n_programs,)](
        a_desc,
        b_desc,
        pre,
        out,
        layout.row_local_expert,
        layout.expert_end,
        layout.n_tiles,
        dw if DW else out,
        slot if slot is not None else layout.row_local_expert,
        KD,
        N,
        pre.stride(0),
        out.stride(0),
        0,
        BM=cfg["BM"],
        BN=cfg["BN"],
        BK=cfg["BK"],
        STAGES=cfg["STAGES"],
        GROUP_M=cfg["GM"],
        DW=DW,
        FWD=fwd,
        SAVE_GU=save,
        ROWS=rows,
        B_KMAJOR=fwd or mode == "rows_t",
        CARRY=bool(carry) if carry is not None else mode != "dact",
        WGRAD=False,
        EPI_WARPS=4,
        EPI_REGS=cfg["EPI_REGS"],
        # SPLIT: the default partition is warp group 0 alone, warp group 1 a worker
        num_warps=4 if split else 8,
        SPLIT=split,
        MMA_REGS=cfg.get("MMA_REGS", 160),
        maxnreg=cfg["MAXNREG"],
    )


def swiglu_ws(a_rows, w1, h, gu, layout, cfg: dict, n_programs: int):
    """Launch :func:`_moe_ws_kernel`'s forward: ``h = silu(gate) * up`` of
    ``a_rows @ w1[l]^T`` per local expert.

    a_rows  ``[R, H]``: the gathered x rows (padding rows zero), bf16 / fp16.
    w1      ``[El, 2F, H]`` contiguous, same dtype: gate rows ``[0, F)``, up rows ``[F, 2F)``.
    h       ``[R, F]``: written on every row of every tile (zeros on padding).
    gu      ``[R, 2F]`` or None: the gate and up pre-activations (rounded to the dtype, as ``h``
            is computed from them), for the backward.
    layout  the one-rank :class:`Layout` (``row_local_expert``, ``expert_end``, ``n_tiles``).
    cfg     ``BM`` (the layout's), ``BN`` (gate + up columns of a tile), ``BK``, ``STAGES``,
            ``GM``, ``EPI_REGS``, ``MAXNREG``.
    """
    R, H = a_rows.shape
    El, F2, _ = w1.shape
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    gdt = _gl_dtype(a_rows)
    a_lay = gl.NVMMASharedLayout.get_default_for([BM, BK], gdt)
    b_lay = gl.NVMMASharedLayout.get_default_for([BN // 2, BK], gdt)
    a_desc = TensorDescriptor.from_tensor(a_rows, [BM, BK], a_lay)
    b_desc = TensorDescriptor.from_tensor(w1.view(El * F2, H), [BN // 2, BK], b_lay)
    save = gu is not None
    _launch(a_desc, b_desc, gu if save else h, h, layout, None, None, H, F2 // 2, cfg,
            n_programs, "swiglu", save)  # fmt: skip
    return h


def dact_swiglu_ws(a_rows, w2, pre, out, layout, dw, dw_slot, cfg: dict, n_programs: int):
    """Launch :func:`_moe_ws_kernel`'s backward (``d gu``).

    a_rows  ``[R, H]``: the gathered rows ``dy * w`` (padding rows zero), bf16 / fp16.
    w2      ``[El, H, F]`` contiguous, same dtype.
    pre     ``[R, 2F]``: the saved gate (``[:, :F]``) and up pre-activations.
    out     ``[R, 2F]``: ``d gu``, written on every row of every tile (zeros on padding).
    layout  the one-rank :class:`Layout` (``row_local_expert``, ``expert_end``, ``n_tiles``).
    dw      ``[S, cdiv(F, BN)]`` fp32 partials or None; ``dw_slot [R]`` int32 with it.
    cfg     ``BM`` (the layout's), ``BN``, ``BK``, ``STAGES``, ``GM``, ``EPI_REGS``.
    """
    R, H = a_rows.shape
    El, _, F = w2.shape
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    gdt = _gl_dtype(a_rows)
    a_lay = gl.NVMMASharedLayout.get_default_for([BM, BK], gdt)
    b_lay = gl.NVMMASharedLayout.get_default_for([BK, BN], gdt)
    a_desc = TensorDescriptor.from_tensor(a_rows, [BM, BK], a_lay)
    b_desc = TensorDescriptor.from_tensor(w2.view(El * H, F), [BK, BN], b_lay)
    _launch(a_desc, b_desc, pre, out, layout, dw, dw_slot, H, F, cfg, n_programs, "dact")
    return out


def rows_ws(a_rows, w, out, row_slot, layout, cfg: dict, n_programs: int, w_kmajor: bool):
    """Launch :func:`_moe_ws_kernel`'s layer-1 kind: ``out[row_slot[r]] = a_rows[r] @ B[l(r)]``
    for every row ``r`` of an expert's tiles (padding rows are never stored).

    a_rows    ``[R, KD]`` contiguous, bf16 / fp16: layer 1's ``h`` or the backward's ``d gu``
              (rows in receive order).
    w         contiguous, same dtype. ``w_kmajor``: ``[El, N, KD]``, ``B[l] = w[l]^T`` (layer
              1's ``w2 [El, H, F]``); else ``[El, KD, N]``, ``B[l] = w[l]`` (the backward's
              combine with ``w1 [El, 2F, H]``).
    out       ``[S, N]``: row ``row_slot[r]`` gets row ``r``'s product rounded to the dtype;
              rows no slot names are left as they were.
    row_slot  ``[R]`` int32, the slot of each receive row (-1: not stored).
    layout    the one-rank :class:`Layout` (``row_local_expert``, ``expert_end``, ``n_tiles``).
    cfg       ``BM`` (the layout's), ``BN``, ``BK``, ``STAGES``, ``GM``, ``EPI_REGS``,
              ``MAXNREG`` (``CARRY`` optional).
    """
    R, KD = a_rows.shape
    N = out.shape[1]
    El = w.shape[0]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    gdt = _gl_dtype(a_rows)
    a_lay = gl.NVMMASharedLayout.get_default_for([BM, BK], gdt)
    a_desc = TensorDescriptor.from_tensor(a_rows, [BM, BK], a_lay)
    if w_kmajor:
        b_lay = gl.NVMMASharedLayout.get_default_for([BN, BK], gdt)
        b_desc = TensorDescriptor.from_tensor(w.view(El * N, KD), [BN, BK], b_lay)
    else:
        b_lay = gl.NVMMASharedLayout.get_default_for([BK, BN], gdt)
        b_desc = TensorDescriptor.from_tensor(w.view(El * KD, N), [BK, BN], b_lay)
    mode = "rows_t" if w_kmajor else "rows"
    _launch(a_desc, b_desc, out, out, layout, None, row_slot, KD, N, cfg, n_programs, mode)
    return out


def wgrad_ws(a_RM, b_RN, starts, ends, out, cfg: dict, n_programs: int):
    """Launch :func:`_moe_ws_kernel`'s ``WGRAD`` mode: ``out[l] = a_RM[starts[l]:ends[l]]^T @
    b_RN[starts[l]:ends[l]]``, the contraction stopped at each expert's real rows (as
    ``moe_wgrad.grouped_wgrad``, whose contract this keeps; the loads flow across tiles here).

    a_RM, b_RN  ``[R, M]`` / ``[R, N]`` contiguous bf16 / fp16, TMA-aligned; zero on each
                expert's padding rows up to its next multiple of ``BK``.
    starts, ends  ``[El]`` int32: each expert's first row (a multiple of ``BK``) and one past
                its last real row.
    out         ``[El, M, N]`` contiguous, the operands' dtype; every element written.
    cfg         ``BN``, ``BK``, ``STAGES``, ``GM``, ``EPI_REGS``, ``MAXNREG`` (``BM`` 128).
    """
    El, M, N = out.shape
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    gdt = _gl_dtype(a_RM)
    a_desc = TensorDescriptor.from_tensor(
        a_RM, [BK, BM], gl.NVMMASharedLayout.get_default_for([BK, BM], gdt)
    )
    b_desc = TensorDescriptor.from_tensor(
        b_RN, [BK, BN], gl.NVMMASharedLayout.get_default_for([BK, BN], gdt)
    )
    _moe_ws_kernel[(n_programs,)](
        a_desc,
        b_desc,
        out,
        out,
        starts,
        ends,
        ends,
        out,
        starts,
        M,
        N,
        N,
        N,
        El,
        BM=BM,
        BN=BN,
        BK=BK,
        STAGES=cfg["STAGES"],
        GROUP_M=cfg["GM"],
        DW=False,
        FWD=False,
        SAVE_GU=False,
        ROWS=False,
        B_KMAJOR=False,
        CARRY=True,
        WGRAD=True,
        EPI_WARPS=4,
        EPI_REGS=cfg["EPI_REGS"],
        num_warps=8,
        maxnreg=cfg["MAXNREG"],
    )
    return out


__all__ = ["HAVE_GLUON", "dact_swiglu_ws", "rows_ws", "swiglu_ws", "wgrad_ws"]
