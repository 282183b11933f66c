"""GEMM + ReduceScatter with the scatter in the GEMM epilogue: ``y = RS_rows(x @ w^T)``.

Every rank holds ``x [M, K]`` and its own ``w [N, K]`` (any strides); the sum over ranks of
``x @ w^T`` is split into W row blocks of ``Ms = M / W`` rows, block b owned by rank b.

Buffers and flags (per op, from the world's shared workspace and signal pad)
----------------------------------------------------------------------------
* ``buf [W, Ms, N]`` symmetric, x.dtype: on owner b, slot ``[s]`` holds rank s's partial of
  block b. Partials travel in the input dtype (half the NVLink bytes of fp32, as PyTorch's
  fused_matmul_reduce_scatter does); the reduction accumulates in fp32.
* flags ``[W * n_mb * n_n]`` int32 on the owner: flag ``s * per_block + u`` means "rank s's
  partial tile u of my block has landed" (``u = i * n_n + j``).
* two int32 work counters after the flags (local, zeroed by ``World.begin_op``): GEMM tiles
  claimed, reduction tiles claimed.

Protocol (rank r)
-----------------
* producer (GEMM): claims tiles in rank-swizzled order: every tile of the block owned by
  ``r + 1``, then ``r + 2``, ..., own block last. At each step every rank writes to a different
  peer (no two ranks hammer the same NVLink port), and the own block, which needs no transfer,
  closes the loop while the last remote stores drain. Per tile: K loop with fp32 accumulation,
  wait for the owner's ready epoch (stage 1; the owner has finished reading the previous op's
  buffer), store the tile straight into the owner's slot ``[r]``, ``signal_set`` the owner's flag.
* consumer (reduction, on the owner): claims tiles u of its block; for s = 0..W-1 waits for
  flag ``s * per_block + u`` (bounded, stage 7) and adds slot s in fp32 in rank order:
  deterministic, no float atomics, bitwise identical on every run. Bias is added once, after
  the sum. A tile with a timed-out wait stores NaN.

Roles: ``ROLE_BOTH``: every program claims GEMM tiles until none are left, then reduction
tiles. GEMM tiles wait only for ready epochs, never for other programs, so claiming keeps the
kernel deadlock-free whatever the residency. ``ROLE_PRODUCER`` / ``ROLE_CONSUMER`` split them for
the emulated sequential mode.

Measured (one H200, bf16, world_size 1): 8192x8192x8192 1.87 ms (588 TFLOP/s) against
torch.mm 1.44 ms (761); the partial round trip through the workspace is included.

Traps: the same as ``ag_matmul`` (flag contract, Triton's int specialization, same config on
every rank). The reduction of a block can only finish once its last contributor (the owner
itself, in this order) has computed it, so the reduction is mostly a tail after the GEMM;
what overlaps is the scatter traffic with the GEMM.
"""

import triton
import triton.language as tl

from .ag_matmul import TileConfig, needs_int64, tile_config, w_offsets
from .launch import launch
from .signals import peer_ptr, signal_set, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_RS = tl.constexpr(7)
N_COUNTERS = 2


def matmul_rs_config(
    m_local: int, n: int, k: int, element_size: int, interpreted: bool
) -> TileConfig:
    """Block config of the GEMM+ReduceScatter kernel (pin: ``MOE_OVERLAP_TP_RS_CONFIG``).

    BM x BN is also the flag granularity and the reduction tile.
    """
    return tile_config("MOE_OVERLAP_TP_RS_CONFIG", m_local, n, element_size, interpreted)


@triton.jit(do_not_specialize=["rank", "budget"])
def _matmul_rs_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    buf_local,
    buf_table,
    flag_table,
    flags_local,
    ctr_ptr,
    pad_local,
    epoch_ptr,
    err_ptr,
    Ms,
    N,
    K,
    swn,
    swk,
    rank,
    budget,
    W: tl.constexpr,
    ROLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W64: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    n_mb = tl.cdiv(Ms, BM)
    n_n = tl.maximum(tl.cdiv(N, BN), 1)
    per_block = n_mb * n_n
    one = tl.full((), 1, tl.int32)

    # ------------------------------------------------------------ producer: GEMM + scatter
    if ROLE != 2:
        epoch = tl.load(epoch_ptr)
        stage_ready = tl.full((), STAGE_READY, tl.int32)
        t = tl.atomic_add(ctr_ptr, 1)
        while t < W * per_block:
            b = (rank + 1 + t // per_block) % W
            u = t % per_block
            i = u // n_n
            jn = u % n_n
            rows = i * BM + tl.arange(0, BM)
            rmask = rows < Ms
            grows = (b * Ms + rows).to(tl.int64)
            cols = jn * BN + tl.arange(0, BN)
            cmask = cols < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < K
                a = tl.load(
                    x_ptr + grows[:, None] * K + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :],
                    other=0.0,
                )
                bt = tl.load(
                    w_ptr + w_offsets(cols, ks, swn, swk, W64),
                    mask=kmask[:, None] & cmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(a, bt, acc)
            ok = wait_geq(pad_local + b, epoch, err_ptr, rank, stage_ready, b, budget, USE_TIMER)
            if ok:
                dst = peer_ptr(buf_table, b, dtype)
                slot_rows = (rank * Ms + rows).to(tl.int64)
                tl.store(
                    dst + slot_rows[:, None] * N + cols[None, :],
                    acc.to(dtype),
                    mask=rmask[:, None] & cmask[None, :],
                )
                signal_set(peer_ptr(flag_table, b, tl.int32) + rank * per_block + u, 1)
            t = tl.atomic_add(ctr_ptr, 1)

    # ------------------------------------------------------------ consumer: ordered reduction
    if ROLE != 1:
        stage_rs = tl.full((), STAGE_RS, tl.int32)
        u = tl.atomic_add(ctr_ptr + 1, 1)
        while u < per_block:
            i = u // n_n
            jn = u % n_n
            rows = i * BM + tl.arange(0, BM)
            rmask = rows < Ms
            cols = jn * BN + tl.arange(0, BN)
            cmask = cols < N
            mask = rmask[:, None] & cmask[None, :]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            nbad = tl.zeros((), tl.int32)
            for s in range(W):
                ok = wait_geq(
                    flags_local + s * per_block + u,
                    one,
                    err_ptr,
                    rank,
                    stage_rs,
                    s * per_block + u,
                    budget,
                    USE_TIMER,
                )
                nbad += tl.where(ok, 0, 1)
                srows = (s * Ms + rows).to(tl.int64)
                part = tl.load(buf_local + srows[:, None] * N + cols[None, :], mask=mask, other=0.0)
                acc += part.to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            if nbad > 0:
                acc = tl.full((BM, BN), float("nan"), tl.float32)
            tl.store(
                y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(dtype), mask=mask
            )
            u = tl.atomic_add(ctr_ptr + 1, 1)


def matmul_rs_flags(m_local: int, n: int, world_size: int, cfg: TileConfig) -> int:
    """Flag words one op needs on every rank (tile flags + work counters)."""
    per_block = triton.cdiv(m_local, cfg.BM) * max(triton.cdiv(n, cfg.BN), 1)
    return world_size * per_block + N_COUNTERS


def launch_matmul_rs(
    role,
    x,
    w,
    bias,
    y,
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
    use_timer,
    cfg,
    max_programs,
    interpreted=False,
):
    """Launch one role (0 both, 1 producer/GEMM, 2 consumer/reduction) of GEMM+ReduceScatter.

    x [M, K] contiguous; w [N, K] any strides; bias [N] or None; y [Ms, N] contiguous;
    buf_local [W, Ms, N] symmetric; flags_local int32 [W * per_block + 2] (counters at the end).
    """
    M, K = x.shape
    N = w.shape[0]
    Ms = M // world_size
    per_block = triton.cdiv(Ms, cfg.BM) * max(triton.cdiv(N, cfg.BN), 1)
    tasks = {0: world_size * per_block, 1: world_size * per_block, 2: per_block}[role]
    if tasks == 0:
        return
    cap = 2 if interpreted else max_programs
    grid = max(1, min(cap, tasks))
    ctr = flags_local[world_size * per_block :]
    launch(
        _matmul_rs_kernel,
        (grid,),
        x,
        w,
        bias if bias is not None else x,
        y,
        buf_local,
        buf_table,
        flag_table,
        flags_local,
        ctr,
        pad_local,
        epoch,
        err,
        Ms,
        N,
        K,
        w.stride(0),
        w.stride(1),
        rank,
        budget,
        W=world_size,
        ROLE=role,
        BM=cfg.BM,
        BN=cfg.BN,
        BK=cfg.BK,
        HAS_BIAS=bias is not None,
        W64=needs_int64(w),
        USE_TIMER=use_timer,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
