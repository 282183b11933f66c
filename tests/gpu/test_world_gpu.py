"""World protocol, signals and the toy op on one CUDA GPU (compiled Triton).

Run with ``MOE_OVERLAP_COMPILED=1 python -m pytest -m "gpu or multigpu" tests``.

* Emulated world, ``sequential`` mode (every rank on one stream, producers before consumers).
* Emulated world, ``concurrent`` mode (one stream per rank, both roles in one launch): one rank's
  stream is delayed by ``torch.cuda._sleep`` right before its launch (``world.producer_delay_
  cycles``: a delay issued before the op would be absorbed by the host barrier the concurrent
  mode holds after compiling and loading the op's kernels), so the other ranks' consumers wait
  on its flags for real. The *data* of every rank is checked: a missing ``debug_barrier`` around
  a publish or a poll shows up as wrong tiles, never in the flags.
* The timeout path with a 50 ms budget (``%globaltimer``): ``CommTimeoutError`` from
  ``world.check()``, from the next op (lazy) and from ``end_op`` in debug mode.
* A ``torch_symm`` world at world_size 1 (a one-process NCCL group made in this process).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import triton
import triton.language as tl

from moe_overlap import CommTimeoutError, init_world, local_world
from moe_overlap.errors import ERR_FIELDS
from moe_overlap.kernels import signals as sig
from moe_overlap.kernels.signals import peer_ptr
from moe_overlap.kernels.toy_allreduce import launch_push_allreduce
from moe_overlap.testing import assert_close, free_port, spawn
from moe_overlap.toy import push_allreduce
from moe_overlap.world import ROLE_CONSUMER, launch_lock
from moe_overlap.world.base import READY_SLOTS

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 50_000_000  # ~25 ms at H200 clocks: far longer than one toy op
LATE_CYCLES = 1_000_000_000  # ~0.5 s: a peer far later than BUDGET_NS
BUDGET_NS = 50_000_000  # 50 ms: the timeout tests' wait budget
STAGE_CONSUME, STAGE_TEST = 2, 8
SHAPES = [(1, 1), (17, 33), (40, 7), (64, 96)]


# ------------------------------------------------------------------------------ helpers
@triton.jit(do_not_specialize=["rank"])
def _put_rows_kernel(src_ptr, table_ptr, rank, N: tl.constexpr, BN: tl.constexpr):
    # Program p writes row p of src into row [rank] of peer p's buffer.
    p = tl.program_id(0)
    cols = tl.arange(0, BN)
    mask = cols < N
    vals = tl.load(src_ptr + p * N + cols, mask=mask)
    dst = peer_ptr(table_ptr, p, src_ptr.dtype.element_ty)
    tl.store(dst + rank * N + cols, vals, mask=mask)


def put_rows(src_WN, table, rank):
    W, N = src_WN.shape
    with launch_lock():
        _put_rows_kernel[(W,)](src_WN, table, rank, N=N, BN=triton.next_power_of_2(N))


def make_input(rank, call, shape, dtype=torch.float32):
    """Fresh random data, generated on the CPU (same values whatever the device)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((rank, call, tuple(shape))).encode()))
    return torch.randn(shape, generator=g).to(dtype)


def reference(W, call, shape, dtype=torch.float32):
    return sum(make_input(r, call, shape, dtype).double() for r in range(W))


def poison_workspace(world):
    """NaN bytes in this rank's workspace (collective: barriers on both sides, so no peer is
    writing into it while it is poisoned)."""
    world.barrier()
    world.workspace(1 << 20).local.fill_(0xFF)
    world.barrier()


def consumer_only(world, x, budget):
    """The toy op's consumer role alone, flags at zero: no producer ever runs."""
    M, N = x.shape
    W = world.world_size
    buf = world.alloc((W, M, N), x.dtype)
    buf.local.zero_()
    n_tiles = triton.cdiv(M, 16) * triton.cdiv(N, 32)
    flags = world.signals(W * n_tiles)
    world.signal_pad(1)
    pad_local, epoch = world.ready_args()
    out = torch.zeros_like(x)
    with launch_lock():
        launch_push_allreduce(
            x,
            out,
            buf.local,
            buf.ptrs,
            flags.ptrs,
            flags.local,
            pad_local,
            epoch,
            world.error_buffer,
            world.rank,
            W,
            budget,
            ROLE_CONSUMER,
            world.use_timer,
        )
    return out


# ------------------------------------------------------------------------------ emulated basics
def test_world_on_gpu_is_compiled():
    w = local_world(device="cuda")
    assert w.device.type == "cuda" and w.device.index is not None
    assert w.use_timer, "compiled GPU waits budget in %globaltimer nanoseconds"
    assert w.wait_budget >= 1_000_000_000, "default budget must cover a peer's JIT compile"


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_pointer_tables_address_the_right_peer(W, mode):
    N = 13

    def fn(world):
        buf = world.alloc((W, N), torch.float32)
        assert buf.ptrs.device == world.device
        assert int(buf.ptrs[world.rank]) == buf.local.data_ptr()
        buf.local.fill_(float("nan"))
        world.barrier()
        src = torch.stack([make_input(world.rank, d, (N,)) for d in range(W)]).to(world.device)
        put_rows(src, buf.ptrs, world.rank)
        world.barrier()
        return buf.local.cpu()

    for d, local in enumerate(spawn(W, fn, device="cuda", mode=mode)):
        for s in range(W):
            assert torch.equal(local[s], make_input(s, d, (N,))), f"rank {d} row {s}"


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_host_collectives_on_gpu(mode):
    W = 4

    def fn(world):
        t = make_input(world.rank, 0, (5, 7)).to(world.device)
        world.all_reduce(t)
        ints = world.all_gather_ints([world.rank, 2 * world.rank])
        send = [make_input(world.rank, d, (d + 1, 3)).to(world.device) for d in range(W)]
        recv = world.all_to_all(send)
        return t.cpu(), ints, [r.cpu() for r in recv]

    res = spawn(W, fn, device="cuda", mode=mode)
    ref = reference(W, 0, (5, 7))
    for d, (t, ints, recv) in enumerate(res):
        assert torch.equal(t, res[0][0])
        torch.testing.assert_close(t.double(), ref, rtol=1e-6, atol=1e-5)
        assert ints == [[s, 2 * s] for s in range(W)]
        for s in range(W):
            assert torch.equal(recv[s], make_input(s, d, (d + 1, 3)))


def test_generators_on_gpu_differ_per_rank_and_reproduce():
    def draw(world):
        assert world.generator.device.type == "cuda"
        return torch.randn(6, generator=world.generator, device=world.device).cpu()

    a, b = spawn(3, draw, device="cuda"), spawn(3, draw, device="cuda")
    for r in range(3):
        assert torch.equal(a[r], b[r])
        for s in range(r):
            assert not torch.equal(a[r], a[s])


# ------------------------------------------------------------------------------ toy, sequential
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_toy_sequential(W, dtype):
    calls = list(enumerate(SHAPES))

    def fn(world):
        outs = []
        for call, shape in calls:
            poison_workspace(world)
            outs.append(push_allreduce(make_input(world.rank, call, shape, dtype).cuda(), world))
        world.check()
        return [o.cpu() for o in outs]

    per_rank = spawn(W, fn, device="cuda")
    for i, (call, shape) in enumerate(calls):
        ref = reference(W, call, shape, dtype)
        for r in range(W):
            assert_close(per_rank[r][i], ref, dtype=dtype, name=f"W={W} call {call} rank {r}")
            assert torch.equal(per_rank[r][i], per_rank[0][i])


# ------------------------------------------------------------------------------ toy, concurrent
def _warm_up(world, dtype=torch.float32):
    """Compile the both-roles variant before any timed wait (JIT time is not wait time)."""
    push_allreduce(make_input(world.rank, 999, (17, 33), dtype).to(world.device), world)
    world.check()


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("delayed", ["first", "last"])
@pytest.mark.parametrize("shape", [(40, 7), (64, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_toy_concurrent_with_a_delayed_rank(W, delayed, shape):
    slow = 0 if delayed == "first" else W - 1

    def fn(world):
        assert world.concurrent and world.stream is not None
        _warm_up(world)
        outs = []
        for call in range(3):
            poison_workspace(world)
            x = make_input(world.rank, call, shape).to(world.device)
            world.producer_delay_cycles = SLEEP_CYCLES if world.rank == slow else 0
            outs.append(push_allreduce(x, world))
        world.check()
        return [o.cpu() for o in outs]

    per_rank = spawn(W, fn, device="cuda", mode="concurrent")
    for call in range(3):
        ref = reference(W, call, shape)
        for r in range(W):
            assert_close(per_rank[r][call], ref, name=f"W={W} slow={slow} call {call} rank {r}")
            assert torch.equal(per_rank[r][call], per_rank[0][call])


@pytest.mark.parametrize("W", [2, 4])
def test_toy_concurrent_back_to_back_with_rotating_delays(W):
    # No host barrier between ops: only the op protocol (owner reset, ready epochs, per-tile
    # flags) keeps a fast rank's next op from overwriting a slow rank's buffer mid-read.
    shape, ncalls = (64, 96), 2 * W

    def fn(world):
        _warm_up(world)
        world.barrier()
        outs = []
        for call in range(ncalls):
            x = make_input(world.rank, call, shape).to(world.device)
            world.producer_delay_cycles = SLEEP_CYCLES if world.rank == call % W else 0
            outs.append(push_allreduce(x, world))
        world.check()
        return [o.cpu() for o in outs]

    per_rank = spawn(W, fn, device="cuda", mode="concurrent")
    for call in range(ncalls):
        ref = reference(W, call, shape)
        for r in range(W):
            assert_close(per_rank[r][call], ref, name=f"call {call} rank {r}")


# ------------------------------------------------------------------------------ timeouts
def test_wait_on_a_flag_nobody_sets_times_out_on_gpu():
    world = local_world(device="cuda")
    world.wait_budget = BUDGET_NS
    flag = torch.full((4,), 2, dtype=torch.int32, device="cuda")
    out = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    with launch_lock():
        sig.wait_flag(flag[1:], 5, world.error_buffer, out, 0, STAGE_TEST, 1, BUDGET_NS, True)
    with pytest.raises(CommTimeoutError) as ei:
        world.check()
    e = ei.value
    assert (e.rank, e.stage, e.index, e.expected, e.seen) == (0, STAGE_TEST, 1, 5, 2)
    assert int(out[0]) == 0
    world.check()  # consumed
    # A set flag passes with the same budget; stage 1 specializes to a constexpr: compiled too.
    flag[1] = 5
    with launch_lock():
        sig.wait_flag(flag[1:], 5, world.error_buffer, out, 0, 1, 1, BUDGET_NS, True)
    world.check()
    assert int(out[0]) == 1


@pytest.mark.parametrize("W", [1, 2])
def test_toy_consumer_without_producers_times_out_on_gpu(W):
    def fn(world):
        x = make_input(world.rank, 0, (40, 70)).to(world.device)
        out = consumer_only(world, x, BUDGET_NS)
        try:
            world.check()
        except CommTimeoutError as e:
            return out.cpu(), e
        return out.cpu(), None

    for r, (out, e) in enumerate(spawn(W, fn, device="cuda")):
        assert torch.isnan(out).all()
        assert isinstance(e, CommTimeoutError)
        assert (e.rank, e.stage, e.expected, e.seen) == (r, STAGE_CONSUME, 1, 0)


def _late_peer(world, lazy: bool):
    """Both ranks run one good op; in the next, rank 1's launch comes ~0.5 s late while rank 0
    waits at most 50 ms: rank 0 gets NaN and a CommTimeoutError, rank 1 (default budget) the
    right sum."""
    shape = (40, 70)
    _warm_up(world)
    world.barrier()
    x = make_input(world.rank, 1, shape).to(world.device)
    if world.rank == 0:
        world.wait_budget = BUDGET_NS
    else:
        world.producer_delay_cycles = LATE_CYCLES
    out = push_allreduce(x, world)
    err, where = None, None
    if world.rank == 0:
        if lazy:
            torch.cuda.current_stream().synchronize()  # the error copy has landed
            try:
                push_allreduce(x, world)  # raises in begin_op, before any barrier or launch
            except CommTimeoutError as e:
                err, where = e, "next op"
        else:
            try:
                world.check()
            except CommTimeoutError as e:
                err, where = e, "check"
    else:
        world.check()
    world.barrier()  # rank 1's late producers are done before anyone leaves
    return out.cpu(), err, where


@pytest.mark.concurrent
@pytest.mark.parametrize("lazy", [False, True], ids=["check", "next-op"])
def test_toy_with_a_peer_that_is_too_late(lazy):
    shape, n_tiles = (40, 70), 3 * 3
    (out0, e, where), (out1, e1, _) = spawn(2, _late_peer, lazy, device="cuda", mode="concurrent")
    assert e1 is None
    assert_close(out1, reference(2, 1, shape), name="the late rank")
    assert isinstance(e, CommTimeoutError), f"rank 0 saw no timeout ({where})"
    assert torch.isnan(out0).all(), "a consumer that timed out must mark its tile"
    # Ready epochs were published before the late launch: only the consumers gave up.
    assert e.rank == 0 and e.stage == STAGE_CONSUME, str(e)
    assert e.index >= n_tiles and (e.expected, e.seen) == (1, 0), "rank 1's flags, unset"


def test_debug_mode_raises_at_the_end_of_the_op(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_DEBUG", "1")
    world = local_world(device="cuda")
    assert world.debug
    x = make_input(0, 0, (17, 33)).cuda()
    consumer_only(world, x, BUDGET_NS)
    with pytest.raises(CommTimeoutError):
        world.end_op()
    rec = dict(zip(ERR_FIELDS, world.error_buffer.tolist()))
    assert rec["code"] == 0, "raising consumed the record"


def test_ready_slots_survive_pad_growth_on_gpu():
    def fn(world):
        _warm_up(world)
        small = world.signal_pad(1).local.numel()
        before = world.signal_pad(1).local[:READY_SLOTS].cpu()
        world.signal_pad(4 * small)
        after = world.signal_pad(1).local[:READY_SLOTS].cpu()
        # The next op's handshake writes epoch 2 into the peers' slots: a rank that reached it
        # first changed a slower peer's "after" (seen as [2, 1, 2], H100 2026-12-07).
        world.barrier()
        out = push_allreduce(make_input(world.rank, 5, (17, 33)).cuda(), world)
        return before, after, out.cpu()

    res = spawn(3, fn, device="cuda")
    for before, after, out in res:
        assert before[:3].tolist() == [1, 1, 1]
        assert torch.equal(before, after)
        assert_close(out, reference(3, 5, (17, 33)))


# ------------------------------------------------------------------------------ torch_symm
@pytest.fixture(scope="module")
def symm_world():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    os.environ.update(WORLD_SIZE="1", RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield init_world()
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_torch_symm_world_size_1_basics(symm_world):
    w = symm_world
    assert w.backend == "torch_symm"
    assert (w.rank, w.world_size, w.device.type) == (0, 1, "cuda")
    assert w.concurrent and w.use_timer
    buf = w.alloc((1, 13), torch.float32)
    assert int(buf.ptrs[0]) == buf.local.data_ptr()
    src = make_input(0, 0, (1, 13)).cuda()
    put_rows(src, buf.ptrs, 0)
    w.barrier()
    assert torch.equal(buf.local.cpu(), src.cpu())
    assert w.all_gather_ints([3, -4]) == [[3, -4]]
    t = src.clone()
    w.all_reduce(t)
    assert torch.equal(t, src)
    recv = w.all_to_all([src[:, :5]])
    assert torch.equal(recv[0], src[:, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_symm_world_size_1_toy_op(symm_world, dtype):
    for call, shape in enumerate(SHAPES + [(300, 500)]):
        x = make_input(0, call, shape, dtype).cuda()
        out = push_allreduce(x, symm_world)
        assert torch.equal(out.cpu(), x.cpu()), f"call {call} shape {shape}"
    symm_world.check()


def test_torch_symm_timeout_path(symm_world):
    x = make_input(0, 0, (17, 33)).cuda()
    out = consumer_only(symm_world, x, BUDGET_NS)
    with pytest.raises(CommTimeoutError) as ei:
        symm_world.check()
    assert ei.value.stage == STAGE_CONSUME
    assert torch.isnan(out).all()
    # The world recovers: the next op is right.
    y = make_input(0, 1, (17, 33)).cuda()
    assert torch.equal(push_allreduce(y, symm_world), y)


def test_gpu_suite_loads_cuda_modules_eagerly():
    # tests/conftest.py asks before CUDA starts; concurrent emulated worlds rely on it.
    from moe_overlap.world.emulated import _driver_loading_mode

    torch.cuda.init()
    assert _driver_loading_mode() == 1, "CUDA loads modules lazily: see world/emulated.py"
