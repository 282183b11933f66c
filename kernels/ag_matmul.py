"""AllGather + GEMM with the gather in the GEMM prologue: ``y = AllGather_rows(x) @ w^T``.

Every rank holds ``x_shard [Ms, K]``; the gathered ``x [M, K]`` (``M = W * Ms``) has rank r's
shard at rows ``[r * Ms, (r + 1) * Ms)``. Each rank multiplies the gathered rows by its own
``w [N, K]`` (any strides, so ``w.t()`` views from the backward need no copy).

Why communication tiles and not the copy engine
-----------------------------------------------
Flux moves AllGather chunks with host-issued peer copies (copy engine) and per-chunk flags
written by ``cuStreamWriteValue32``. That path cannot run in the Triton interpreter, so the
emulated CPU tests could never exercise it. Here a few *copier* programs of the same persistent
kernel push the chunks with plain loads/stores and raise the flags with release atomics: one
code path runs in the interpreter, on one GPU (emulated ranks) and over NVLink. The price is
SMs spent on copying; a copy-engine variant (GPU only, same flags and consumer) can come later.
Neither has been measured against the other yet.

Measured (one H200, bf16, world_size 1 so no copy, do_bench): 8192x8192x8192 1.70 ms
(646 TFLOP/s) against torch.mm 1.44 ms (761); M=4096 N=12288 K=4096 0.77 ms (537) against
0.54 ms (771); M=8192 N=4096 K=14336 1.60 ms (603) against 1.24 ms (779). The persistent
claim loop and the rank-block M tiling cost 15-30% against cuBLAS: closing it (grouped tile
order for L2, TMA loads, 2 CTAs per SM for short K) is the next step.

Buffers and flags (per op, from the world's shared workspace and signal pad)
----------------------------------------------------------------------------
* ``g [M, K]`` symmetric (x.dtype): peer s's chunks land at rows ``[s * Ms, (s + 1) * Ms)``.
  The local shard is never copied into it: consumer tiles of the own block read ``x_shard``.
* flags ``[W * n_mb]`` int32 on the owner, ``n_mb = cdiv(Ms, BM)``: flag ``s * n_mb + c`` means
  "chunk c (rows ``[c * BM, (c + 1) * BM)`` of rank s's shard) has landed here". Chunks are
  exactly the GEMM's M-tiles, so a tile waits for one flag.
* three int32 work counters after the flags (local, zeroed by ``World.begin_op``): copier
  tickets, copy tasks claimed, GEMM tiles claimed.

Protocol (rank r)
-----------------
* copier: claims copy tasks ``q`` in order; task q -> step ``j = 1 + q // n_mb`` and chunk
  ``c = q % n_mb``, destination ``d = (r - j) mod W``. At step j every rank writes to a
  different peer, and peer ``r - 1`` (which needs our block right after its own) is served
  first. Before writing into d it waits for d's ready epoch (``World.begin_op``), so d is done
  reading the previous op's buffer. It copies the chunk (contiguous rows, one flat copy) and
  ``signal_set``s flag ``r * n_mb + c`` in d's pad.
* GEMM: claims tiles in rank-rotated order: all tiles of block r (local, no wait), then block
  r + 1, ... Tile (b, i, j) of a remote block waits for flag ``b * n_mb + i`` (bounded,
  stage 6), then runs the K loop with fp32 accumulation. A timed-out tile stores NaN.
  With ``SAVE_A`` the ``j == 0`` tile of each M-tile also writes its A rows (a load pass of
  its own before the K loop, see the kernel) into an ordinary ``[M, K]`` tensor: autograd
  keeps the gathered input for the weight gradient without a second gather (the workspace is
  reused by the next op).
* ``DO_GEMM = False`` is a plain AllGather: one tile per M-tile, only the A copy-out.

Roles: ``ROLE_BOTH`` (real worlds, emulated concurrent): the first ``n_copiers`` programs to run
(tickets, not program ids, so a program that the hardware schedules late never holds a chunk
others wait for) copy, then join the GEMM; the rest start on the GEMM at once. Work is claimed
through counters, so every claimed task belongs to a running program and the consumers'
waits depend only on copier work: no deadlock even if the grid is not co-resident; the grid is
still capped at ``max_programs``. ``ROLE_PRODUCER`` / ``ROLE_CONSUMER``: emulated sequential
mode, every program copies / every program computes.

Traps
-----
* Every flag written into a rank during an op must be waited for by that rank in the same op,
  or the next op's ``begin_op`` reset races with a late flag. So the consumer always has at
  least one N-tile per M-tile (``N == 0`` still waits), and ``Ms == 0`` launches nothing.
* Ints equal to 1 are specialized as constexpr by Triton, and Triton ints have no ``.to``: the
  stage and target passed to ``wait_geq`` are made tensors explicitly. ``rank`` and ``budget``
  are ``do_not_specialize`` so every rank runs the same binary (a peer that JIT-compiles while
  we spin eats the wait budget).
* Every rank must pick the same block config (it sets the flag layout): configs are functions
  of shapes and of ``MOE_OVERLAP_TP_CONFIG`` only.
"""

import os
from typing import NamedTuple

import triton
import triton.language as tl

from .launch import launch
from .signals import peer_ptr, signal_set, wait_geq

STAGE_READY = tl.constexpr(1)
STAGE_AG = tl.constexpr(6)
N_COUNTERS = 3


class TileConfig(NamedTuple):
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int


def parse_config(text: str, name: str) -> TileConfig:
    """``"BM,BN,BK,warps,stages"`` -> TileConfig; ValueError naming ``name`` when malformed."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 5:
        raise ValueError(f"{name} must be 'BM,BN,BK,warps,stages' (5 ints), got {text!r}")
    cfg = TileConfig(*vals)
    for field in ("BM", "BN", "BK"):
        v = getattr(cfg, field)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: {field} must be a power of two >= 16, got {v}")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(f"{name}: warps must be 1/2/4/8/16 and stages >= 1, got {text!r}")
    return cfg


def pinned_config(kernel_env: str) -> TileConfig | None:
    """A config pinned by ``kernel_env`` (per kernel) or ``MOE_OVERLAP_TP_CONFIG`` (both)."""
    for name in (kernel_env, "MOE_OVERLAP_TP_CONFIG"):
        text = os.environ.get(name)
        if text:
            return parse_config(text, name)
    return None


def ag_matmul_config(
    m_local: int, n: int, k: int, element_size: int, interpreted: bool
) -> TileConfig:
    """Block config of the AllGather+GEMM kernel (pin: ``MOE_OVERLAP_TP_AG_CONFIG``).

    Interpreter: tiny blocks (numpy does the work, small tiles keep the tests' odd shapes
    multi-tile). GPU: 128x256x64 / 8 warps / 3 stages for 16-bit (the shape of the plain Triton
    grouped GEMM in ANCHORS.md, 667 TFLOP/s on the H200), narrower for fp32 (tf32) and for short
    shards. BM is also the chunk size of the gather.
    """
    return tile_config("MOE_OVERLAP_TP_AG_CONFIG", m_local, n, element_size, interpreted)


def tile_config(env: str, m_local: int, n: int, element_size: int, interpreted: bool):
    """The pinned config under ``env`` if set, else the default for these sizes (shared by the
    AllGather+GEMM and GEMM+ReduceScatter kernels)."""
    pinned = pinned_config(env)
    if pinned is not None:
        return pinned
    if interpreted:
        return TileConfig(16, 32, 32, 1, 1)
    bm = 64 if m_local <= 64 else 128
    if element_size >= 4:
        # 4 warps: with 8, fp32 (tf32 dot) tiles that also stored their A tile for the backward
        # (SAVE_A) came out wrong on the H200, Triton 3.6 (max error 0.8 on unit data; 4 warps
        # and every bf16 config then tested exact to 3e-3, 2026-12-02). Likely the same fault
        # as bf16 BM 64 (2026-12-03), gone since SAVE_A is a pass of its own; 4 warps stay
        # until 8 is measured again. tests/gpu/test_tp_gpu.py covers both.
        return TileConfig(bm, 128, 32, 4, 3)
    bn = 256 if n >= 2048 and bm == 128 else 128
    return TileConfig(bm, bn, 64, 8 if bn == 256 else 4, 3)


def needs_int64(w) -> bool:
    """Whether ``[N, K]`` weight ``w``'s element offsets can pass 2**31 (an LM head of 256k x
    12288 at one rank does): its tile offsets are then formed in int64, otherwise in int32."""
    n, k = w.shape
    span = (n - 1) * abs(w.stride(0)) + (k - 1) * abs(w.stride(1)) if n and k else 0
    return span >= 2**31


@triton.jit
def w_offsets(cols, ks, swn, swk, W64: tl.constexpr):
    """Element offsets of a ``[BK, BN]`` tile of ``w [N, K]`` (strides ``swn``, ``swk``)."""
    # One return after an if/else on the constexpr: compiled Triton (3.6) visits a return that
    # follows an early one and refuses the two offset types (int64 / int32), where the
    # interpreter takes the early return and never sees the second.
    if W64:
        c = cols.to(tl.int64)
        k = ks.to(tl.int64)
    else:
        c = cols
        k = ks
    return c[None, :] * swn + k[:, None] * swk


@triton.jit(do_not_specialize=["rank", "budget"])
def _ag_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    gout_ptr,
    g_local,
    g_table,
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
    n_copiers,
    rank,
    budget,
    W: tl.constexpr,
    ROLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    COPY_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W64: tl.constexpr,
    SAVE_A: tl.constexpr,
    DO_GEMM: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    n_mb = tl.cdiv(Ms, BM)
    one = tl.full((), 1, tl.int32)

    # ------------------------------------------------------------ copier role
    if ROLE != 2:
        if ROLE == 0:
            is_copier = tl.atomic_add(ctr_ptr, 1) < n_copiers
        else:
            is_copier = one > 0
        if is_copier:
            epoch = tl.load(epoch_ptr)
            stage_ready = tl.full((), STAGE_READY, tl.int32)
            n_copy = (W - 1) * n_mb
            q = tl.atomic_add(ctr_ptr + 1, 1)
            while q < n_copy:
                j = 1 + q // n_mb
                c = q % n_mb
                d = (rank + W - j) % W
                ok = wait_geq(
                    pad_local + d, epoch, err_ptr, rank, stage_ready, d, budget, USE_TIMER
                )
                if ok:
                    row0 = c * BM
                    n_el = tl.minimum(BM, Ms - row0) * K
                    src = x_ptr + row0.to(tl.int64) * K
                    dst = peer_ptr(g_table, d, dtype) + (rank * Ms + row0).to(tl.int64) * K
                    for e in range(0, n_el, COPY_BLOCK):
                        offs = e + tl.arange(0, COPY_BLOCK)
                        m = offs < n_el
                        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
                    signal_set(peer_ptr(flag_table, d, tl.int32) + rank * n_mb + c, 1)
                q = tl.atomic_add(ctr_ptr + 1, 1)

    # ------------------------------------------------------------ GEMM role
    if ROLE != 1:
        stage_ag = tl.full((), STAGE_AG, tl.int32)
        if DO_GEMM:
            n_n = tl.maximum(tl.cdiv(N, BN), 1)
        else:
            n_n = one
        per_block = n_mb * n_n
        n_tiles = W * per_block
        t = tl.atomic_add(ctr_ptr + 2, 1)
        while t < n_tiles:
            b = (rank + t // per_block) % W
            rem = t % per_block
            i = rem // n_n
            jn = rem % n_n
            rows = i * BM + tl.arange(0, BM)
            rmask = rows < Ms
            grows = (b * Ms + rows).to(tl.int64)
            cols = jn * BN + tl.arange(0, BN)
            cmask = cols < N
            ok = b == rank
            if b != rank:
                ok = wait_geq(
                    flags_local + b * n_mb + i,
                    one,
                    err_ptr,
                    rank,
                    stage_ag,
                    b * n_mb + i,
                    budget,
                    USE_TIMER,
                )
            a_base = g_local + (b * Ms).to(tl.int64) * K
            if b == rank:
                a_base = x_ptr
            save = jn == 0
            if ok:
                if SAVE_A:
                    # A pass of its own, not a store of the GEMM's A operand: storing the tile
                    # that also feeds tl.dot gave wrong GEMM results on the H200 (Triton 3.6:
                    # bf16 BM 64 / 4 warps, fp32 8 warps; 2026-12-03, tests/gpu/test_tp_gpu.py
                    # hybrid shapes). The reload hits L2, once per M-tile.
                    if save:
                        for k0 in range(0, K, BK):
                            ks = k0 + tl.arange(0, BK)
                            amask = rmask[:, None] & (ks < K)[None, :]
                            a = tl.load(
                                a_base + rows.to(tl.int64)[:, None] * K + ks[None, :],
                                mask=amask,
                                other=0.0,
                            )
                            tl.store(gout_ptr + grows[:, None] * K + ks[None, :], a, mask=amask)
                if DO_GEMM:
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
                    for k0 in range(0, K, BK):
                        ks = k0 + tl.arange(0, BK)
                        kmask = ks < K
                        amask = rmask[:, None] & kmask[None, :]
                        a = tl.load(
                            a_base + rows.to(tl.int64)[:, None] * K + ks[None, :],
                            mask=amask,
                            other=0.0,
                        )
                        bt = tl.load(
                            w_ptr + w_offsets(cols, ks, swn, swk, W64),
                            mask=kmask[:, None] & cmask[None, :],
                            other=0.0,
                        )
                        acc = tl.dot(a, bt, acc)
                    if HAS_BIAS:
                        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
                        acc += bias.to(tl.float32)[None, :]
                    tl.store(
                        y_ptr + grows[:, None] * N + cols[None, :],
                        acc.to(dtype),
                        mask=rmask[:, None] & cmask[None, :],
                    )
            else:
                # Mark the damage: the host raises CommTimeoutError at the next check.
                if DO_GEMM:
                    nan = tl.full((BM, BN), float("nan"), tl.float32).to(dtype)
                    tl.store(
                        y_ptr + grows[:, None] * N + cols[None, :],
                        nan,
                        mask=rmask[:, None] & cmask[None, :],
                    )
                if SAVE_A:
                    if save:
                        for k0 in range(0, K, BK):
                            ks = k0 + tl.arange(0, BK)
                            nan_a = tl.full((BM, BK), float("nan"), tl.float32).to(dtype)
                            tl.store(
                                gout_ptr + grows[:, None] * K + ks[None, :],
                                nan_a,
                                mask=rmask[:, None] & (ks < K)[None, :],
                            )
            t = tl.atomic_add(ctr_ptr + 2, 1)


def ag_matmul_flags(m_local: int, world_size: int, cfg: TileConfig) -> int:
    """Flag words one op needs on every rank (chunk flags + work counters)."""
    return world_size * triton.cdiv(m_local, cfg.BM) + N_COUNTERS


def _copy_programs() -> int:
    """``MOE_OVERLAP_TP_COPY_PROGRAMS`` (0 or unset: an eighth of the grid). A negative or
    non-integer value would leave no copier, and every remote tile would time out."""
    text = os.environ.get("MOE_OVERLAP_TP_COPY_PROGRAMS", "0")
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"MOE_OVERLAP_TP_COPY_PROGRAMS must be an int >= 0, got {text!r}")
    return n


def launch_ag_matmul(
    role,
    x,
    w,
    bias,
    y,
    gout,
    g_local,
    g_table,
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
    n_copiers=None,
    do_gemm=True,
    interpreted=False,
):
    """Launch one role (0 both, 1 producer/copier, 2 consumer/GEMM) of AllGather+GEMM.

    x [Ms, K] contiguous; w [N, K] any strides; bias [N] or None; y [M, N] contiguous (unused
    when ``do_gemm`` is False); gout [M, K] contiguous or None (no copy-out); g_local [M, K]
    symmetric; flags_local int32 [W * n_mb + 3] (work counters at the end, zeroed).
    """
    Ms, K = x.shape
    N = w.shape[0]
    n_mb = triton.cdiv(Ms, cfg.BM)
    n_n = max(triton.cdiv(N, cfg.BN), 1) if do_gemm else 1
    n_copy = (world_size - 1) * n_mb
    n_tiles = world_size * n_mb * n_n
    tasks = {0: n_copy + n_tiles, 1: n_copy, 2: n_tiles}[role]
    if tasks == 0:
        return
    cap = 2 if interpreted else max_programs
    grid = max(1, min(cap, tasks))
    if n_copiers is None:
        n_copiers = _copy_programs() or max(1, grid // 8)
    ctr = flags_local[world_size * n_mb :]
    launch(
        _ag_matmul_kernel,
        (grid,),
        x,
        w,
        bias if bias is not None else x,
        y,
        gout if gout is not None else x,
        g_local,
        g_table,
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
        n_copiers,
        rank,
        budget,
        W=world_size,
        ROLE=role,
        BM=cfg.BM,
        BN=cfg.BN,
        BK=cfg.BK,
        COPY_BLOCK=1024 if interpreted else 4096,
        HAS_BIAS=bias is not None,
        W64=needs_int64(w),
        SAVE_A=gout is not None,
        DO_GEMM=do_gemm,
        USE_TIMER=use_timer,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
