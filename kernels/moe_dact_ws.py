"""The backward's dispatch GEMM at one rank, warp-specialized (Hopper, Gluon).

``d gu = dact(gu) * ((dy * w)[rows] @ w2[l])``: the GEMM of layer 1's backward (``d h``) with
SwiGLU's derivative at the saved pre-activations in its epilogue, as ``_layer0_kernel`` does it
with ``DACT`` = 0 (see ``moe_layer0.py``), but with the epilogue off the tensor cores' path.

When it wins: one rank, SwiGLU, a Hopper GPU (the host takes it there; ``fused._dact_ws_usable``
says exactly when). That epilogue reads the saved gate and up tiles and writes ``d gu`` (8 bytes
per output element against ``2 H`` FLOPs); in the one-partition Triton kernel it runs between
two main loops, so the tensor cores idle while it waits on memory: 1.05 ms at qwen3-30b-a3b
where ``torch._grouped_mm`` does the bare GEMM in 0.78 (H200, 2026-12-04; an L2 prefetch of the
tile, more column slices, two programs per SM and Triton 3.6's automatic warp specialization,
which gave wrong results, did not close it).

How (one persistent program per SM, two partitions, 12 warps):

* *MMA* (the default partition, 2 warp groups, ``m64nBNk16`` wgmmas): issues the TMA loads of
  the A tile (the gathered, weight-scaled dy rows, ``[BM, BK]``) and the B tile (``w2`` viewed
  ``[El * H, F]``, ``[BK, BN]``) ``STAGES - 1`` K steps ahead into a ring (``ready[s]``
  completes with the bytes; A columns past H are TMA's zero fill, so B rows read past the expert
  meet zeros), keeps one wgmma in flight, and refills a stage once the wgmma that read it is
  done. At a tile's end it rounds the accumulator to the input dtype into ``c_smem [BM, BN]``
  (once ``c_empty`` says the epilogue has read the previous one) and signals ``c_ready``.
* *epilogue* (4 warps): per ``[16, 64]`` piece of ``c_smem``, with the saved gate and up
  (loaded a row chunk ahead, across tiles too), writes ``d gate = dh * up * silu'(gate)`` and
  ``d up = dh * silu(gate)`` (zeros on padding rows), and with ``DW`` sums ``d up * up`` per row
  into one partial per (slot, column tile), as the Triton kernel does
  (``row_dot.weights_grad_from_partials`` finishes it).

So tile ``i``'s epilogue runs while tile ``i + 1``'s main loop does. The waits are the CTA's own
mbarriers on its TMA loads and its two partitions, never on another program or rank, so there
is no spin budget to bound. ``d h`` is rounded to the input dtype before the derivative (the
unfused pipeline rounds it too: ``grouped_mm`` writes bf16); the Triton kernel keeps fp32
there, so the two agree to bf16 rounding (2.8e-3 relative), not bitwise.

Budget (Triton 3.6, sm_90a): 128x256x64, 3 stages: 3 x 48 KiB ring + 64 KiB ``c_smem`` =
208 KiB of shared memory. An ``m64n256`` wgmma needs >= 154 registers a thread at compile
time, so ``maxnreg`` is 168 and the kernel has at most 12 warps (65536 / 168 / 32); a third
partition for the loads (a loader warp) would make 13, rounded to 16 warps at 128 registers:
ptxas refused. Of the 12, ``setmaxnreg`` gives the epilogue warp group ``EPI_REGS`` = 184 and
the MMA warp groups 160 (ptxas: 8 bytes of spills a thread; 438 at 152, 1.8 KB at 128).

Measured on the H200 (``tests/gpu/ab_layers.py``, L2 flushed, medians of 2-3 rounds,
2026-12-04), qwen3-30b-a3b / olmoe, against ``torch._grouped_mm`` on the bare GEMM (0.78 /
0.94 ms) and the Triton kernel (1.05 / 1.30-1.35 ms):

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
        pre_ptr: gl.tensor
        out_ptr: gl.tensor
        row_l_ptr: gl.tensor
        exp_end_ptr: gl.tensor
        n_tiles_ptr: gl.tensor
        dw_ptr: gl.tensor
        dw_slot_ptr: gl.tensor
        H: gl.tensor
        F: gl.tensor
        stride_pm: gl.tensor
        stride_om: gl.tensor
        BM: gl.constexpr
        BN: gl.constexpr
        BK: gl.constexpr
        GROUP_M: gl.constexpr
        DW: gl.constexpr
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
            pre_ptr,
            out_ptr,
            row_l_ptr,
            exp_end_ptr,
            n_tiles_ptr,
            dw_ptr,
            dw_slot_ptr,
            H,
            F,
            stride_pm,
            stride_om,
            BM,
            BN,
            BK,
            GROUP_M,
            DW,
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
            self.pre_ptr = pre_ptr
            self.out_ptr = out_ptr
            self.row_l_ptr = row_l_ptr
            self.exp_end_ptr = exp_end_ptr
            self.n_tiles_ptr = n_tiles_ptr
            self.dw_ptr = dw_ptr
            self.dw_slot_ptr = dw_slot_ptr
            self.H = H
            self.F = F
            self.stride_pm = stride_pm
            self.stride_om = stride_om
            self.BM = gl.constexpr(BM)
            self.BN = gl.constexpr(BN)
            self.BK = gl.constexpr(BK)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.DW = gl.constexpr(DW)
            self.MMA_WARPS = gl.constexpr(MMA_WARPS)
            self.EPI_WARPS = gl.constexpr(EPI_WARPS)

    @gluon.jit
    def _tile_of(t, n_m, n_n, GROUP_M: gl.constexpr):
        # the same grouped order as moe_layer0.tile_coords
        group = GROUP_M * n_n
        first_m = (t // group) * GROUP_M
        gsize = gl.minimum(n_m - first_m, GROUP_M)
        return first_m + (t % group) % gsize, (t % group) // gsize

    @gluon.jit
    def _issue(p, ip, n_iter, pid, nprog, n_m, n_n, n_k):
        """TMA loads of this program's K step ``ip`` (over all its tiles) into stage
        ``ip % STAGES``; nothing past the last step."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        go = ip < n_iter
        ti = ip // n_k
        kk = ip - ti * n_k
        mt, nt = _tile_of(pid + ti * nprog, n_m, n_n, p.GROUP_M)
        r0 = mt * p.BM
        # A columns past H are TMA's zero fill, so B rows read past the expert meet zeros
        brow = gl.load(p.row_l_ptr + r0, mask=go, other=0) * p.H
        s = ip % STAGES
        mbarrier.expect(p.ready.index(s), nbytes, pred=go)
        _tma_load(p.a_desc, [r0, kk * p.BK], p.ready.index(s), p.a_bufs.index(s), pred=go)
        _tma_load(p.b_desc, [brow + kk * p.BK, nt * p.BN], p.ready.index(s), p.b_bufs.index(s),
                  pred=go)  # fmt: skip

    @gluon.jit
    def _mma(p):
        """Default partition: issues the loads STAGES - 1 steps ahead and the wgmmas; hands
        each finished tile to the epilogue through ``c_smem``."""
        STAGES: gl.constexpr = p.a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[p.MMA_WARPS, 1], instr_shape=[16, p.BN, 16]
        )
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.load(p.n_tiles_ptr)
        n_n = gl.cdiv(p.F, p.BN)
        n_k = gl.cdiv(p.H, p.BK)
        n_iter = gl.cdiv(gl.maximum(n_m * n_n - pid, 0), nprog) * n_k
        for ip in gl.static_range(STAGES - 1):
            _issue(p, ip, n_iter, pid, nprog, n_m, n_n, n_k)
        acc = gl.zeros((p.BM, p.BN), gl.float32, layout=layout)
        j = 0
        for ic in range(n_iter):
            s = ic % STAGES
            kk = ic % n_k
            mbarrier.wait(p.ready.index(s), (ic // STAGES) & 1)
            acc = warpgroup_mma(
                p.a_bufs.index(s), p.b_bufs.index(s), acc, use_acc=kk > 0, is_async=True
            )
            # step ic - 1's wgmma is done: its stage takes step ic + STAGES - 1
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _issue(p, ic + STAGES - 1, n_iter, pid, nprog, n_m, n_n, n_k)
            if kk == n_k - 1:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.wait(p.c_empty, (j & 1) ^ 1)  # a fresh barrier passes phase 1
                p.c_smem.store(acc.to(p.out_ptr.dtype.element_ty))
                fence_async_shared()
                mbarrier.arrive(p.c_ready)
                j += 1

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
            m2 = keep[:, None] & (cols < p.F)[None, :]
            src = p.pre_ptr + (rows[:, None] * p.stride_pm + cols[None, :])
            gs = gs + (gl.load(src, mask=m2, other=0.0),)
            us = us + (gl.load(src + p.F, mask=m2, other=0.0),)
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
        n_n = gl.cdiv(p.F, p.BN)
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
                    cm = cols < p.F
                    sg = 1.0 / (1.0 + gl.exp(-g))
                    # masked loads gave g = u = 0 on padding rows: both derivatives are 0 there
                    d_g = h * u * sg * (1.0 + g * (1.0 - sg))
                    d_u = h * g * sg
                    dst = p.out_ptr + (rows[:, None] * p.stride_om + cols[None, :])
                    sm = (rows >= 0)[:, None] & cm[None, :]
                    gl.store(dst, d_g.to(dt), mask=sm)
                    gl.store(dst + p.F, d_u.to(dt), mask=sm)
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
    def _dact_ws_kernel(
        a_desc,
        b_desc,
        pre_ptr,
        out_ptr,
        row_l_ptr,
        exp_end_ptr,
        n_tiles_ptr,
        dw_ptr,
        dw_slot_ptr,
        H,
        F,
        stride_pm,
        stride_om,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        DW: gl.constexpr,
        EPI_WARPS: gl.constexpr,
        EPI_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        dt: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dt, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dt, [STAGES, BK, BN], b_desc.layout)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dt)
        c_smem = gl.allocate_shared_memory(dt, [BM, BN], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        mbarrier.init(c_ready, count=1)
        mbarrier.init(c_empty, count=1)
        p = _Args(a_desc, b_desc, a_bufs, b_bufs, c_smem, ready, c_ready, c_empty,
                  pre_ptr, out_ptr, row_l_ptr, exp_end_ptr, n_tiles_ptr, dw_ptr, dw_slot_ptr,
                  H, F, stride_pm, stride_om, BM, BN, BK, GROUP_M, DW, num_warps,
                  EPI_WARPS)  # fmt: skip
        gl.warp_specialize([(_mma, (p,)), (_epilogue, (p,))], [EPI_WARPS], [EPI_REGS])


def dact_swiglu_ws(a_rows, w2, pre, out, layout, dw, dw_slot, cfg: dict, n_programs: int):
    """Launch :func:`_dact_ws_kernel`.

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
    gdt = {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16}[str(a_rows.dtype)]
    a_lay = gl.NVMMASharedLayout.get_default_for([BM, BK], gdt)
    b_lay = gl.NVMMASharedLayout.get_default_for([BK, BN], gdt)
    a_desc = TensorDescriptor.from_tensor(a_rows, [BM, BK], a_lay)
    b_desc = TensorDescriptor.from_tensor(w2.view(El * H, F), [BK, BN], b_lay)
    DW = dw is not None
    _dact_ws_kernel[(n_programs,)](
        a_desc,
        b_desc,
        pre,
        out,
        layout.row_local_expert,
        layout.expert_end,
        layout.n_tiles,
        dw if DW else out,
        dw_slot if DW else layout.row_local_expert,
        H,
        F,
        pre.stride(0),
        out.stride(0),
        BM=BM,
        BN=BN,
        BK=BK,
        STAGES=cfg["STAGES"],
        GROUP_M=cfg["GM"],
        DW=DW,
        EPI_WARPS=4,
        EPI_REGS=cfg["EPI_REGS"],
        num_warps=8,
        maxnreg=cfg["MAXNREG"],
    )
    return out


__all__ = ["HAVE_GLUON", "dact_swiglu_ws"]
