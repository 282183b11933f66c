"""Signal primitives and the error path (CPU, Triton interpreter).

Every wait is bounded: a wait on a flag nobody sets must come back within its budget, leave an
error record naming rank, stage, flag index, expected and seen values, and surface as
``CommTimeoutError`` from ``world.check()`` / the next op, never as a hang.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_overlap import CommTimeoutError, local_world
from moe_overlap.errors import ERR_FIELDS, STAGES
from moe_overlap.kernels import signals as sig
from moe_overlap.kernels.toy_allreduce import launch_push_allreduce
from moe_overlap.testing import spawn
from moe_overlap.toy import push_allreduce
from moe_overlap.world import ROLE_CONSUMER, ROLE_PRODUCER, launch_lock
from moe_overlap.world.base import READY_SLOTS, default_wait_budget

# Stage codes of errors.STAGES (part of the device protocol, so fixed numbers here).
STAGE_READY, STAGE_CONSUME, STAGE_TEST = 1, 2, 8


def test_stage_table():
    assert "ready" in STAGES[STAGE_READY]
    assert "push_allreduce" in STAGES[STAGE_CONSUME]
    assert "nobody sets" in STAGES[STAGE_TEST]


def wait(world, flag, target, index=0, stage=STAGE_TEST, budget=None):
    """One bounded wait on ``flag[0] >= target``; returns the kernel's ok word."""
    out = torch.full((1,), -1, dtype=torch.int32, device=world.device)
    budget = world.wait_budget if budget is None else budget
    with launch_lock():
        sig.wait_flag(
            flag, target, world.error_buffer, out, world.rank, stage, index, budget, world.use_timer
        )
    return int(out[0])


@triton.jit(do_not_specialize=["rank"])
def _add_to_every_peer_kernel(table_ptr, rank, W: tl.constexpr):
    # One program: add 1 to counter [0] of every peer and set flag [1 + rank] to rank + 10.
    for p in range(W):
        base = sig.peer_ptr(table_ptr, p, tl.int32)
        sig.signal_add(base, 1)
        sig.signal_set(base + 1 + rank, rank + 10)


# ------------------------------------------------------------------------------ wait_geq
def test_wait_on_a_flag_nobody_sets_raises_comm_timeout(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", "25")
    world = local_world(device="cpu")
    assert world.wait_budget == 25
    flags = torch.zeros(8, dtype=torch.int32)
    flags[3] = 2  # set, but below the target
    assert wait(world, flags[3:], target=5, index=3) == 0
    rec = dict(zip(ERR_FIELDS, world.error_buffer.tolist()))
    assert rec == dict(code=1, rank=0, stage=STAGE_TEST, index=3, expected=5, seen=2)
    with pytest.raises(CommTimeoutError) as ei:
        world.check()
    e = ei.value
    assert (e.rank, e.stage, e.index, e.expected, e.seen) == (0, STAGE_TEST, 3, 5, 2)
    msg = str(e)
    for part in ("rank 0", STAGES[STAGE_TEST], "flag 3", "expected >= 5", "saw 2"):
        assert part in msg, f"{part!r} missing from: {msg}"
    # Raising consumed the record: the world is usable again.
    assert not world.error_buffer.any()
    world.check()


@pytest.mark.parametrize(
    "value,target",
    [(1, 1), (7, 3), (2**31 - 1, 2**31 - 1), (-(2**31), 2**31 - 1), (-(2**31) + 5, 2**31 - 3)],
)  # the last two: the int32 epoch has wrapped past the target
def test_wait_on_a_set_flag_passes(value, target):
    world = local_world(device="cpu")
    flags = torch.tensor([value], dtype=torch.int32)
    assert wait(world, flags, target) == 1
    assert not world.error_buffer.any()
    world.check()


def test_a_flag_before_the_wrap_does_not_pass_a_target_after_it():
    """The ready epoch is an int32 that wraps: a peer still at ``INT32_MAX`` has not reached
    ``INT32_MIN`` (a plain ``>=`` let producers write into a destination not ready yet)."""
    world = local_world(device="cpu")
    world.wait_budget = 3
    assert wait(world, torch.tensor([2**31 - 1], dtype=torch.int32), -(2**31)) == 0
    with pytest.raises(CommTimeoutError):
        world.check()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ops_across_the_epoch_wrap(op):
    """Back-to-back TP ops while every rank's epoch wraps: right results, no false timeout."""
    from moe_overlap.testing import spawn
    from moe_overlap.tp import all_gather_matmul, matmul_reduce_scatter

    W, Ms, N, K = 2, 4, 8, 8
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(Ms if op == "ag" else W * Ms, K, generator=g) for _ in range(W)]
    ws = [torch.randn(N, K, generator=g) for _ in range(W)]
    fused = all_gather_matmul if op == "ag" else matmul_reduce_scatter

    def fn(world):
        world._epoch.fill_(2**31 - 2)
        world.barrier()
        ys = [fused(xs[world.rank], ws[world.rank], world) for _ in range(3)]
        return int(world._epoch), ys

    for r, (epoch, ys) in enumerate(spawn(W, fn)):
        assert epoch == -(2**31) + 1  # wrapped
        if op == "ag":
            want = torch.cat(xs) @ ws[r].T
        else:
            want = sum(xs[q] @ ws[q].T for q in range(W)).split(Ms)[r]
        for y in ys:
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_wait_budget_is_an_argument_too():
    world = local_world(device="cpu")
    world.wait_budget = 3
    assert wait(world, torch.zeros(1, dtype=torch.int32), 1) == 0
    with pytest.raises(CommTimeoutError):
        world.check()
    # The same flag, once set, passes with the same tiny budget.
    assert wait(world, torch.ones(1, dtype=torch.int32), 1) == 1
    world.check()


def test_first_timeout_wins_the_record():
    world = local_world(device="cpu")
    world.wait_budget = 2
    z = torch.zeros(4, dtype=torch.int32)
    assert wait(world, z[1:], 4, index=1) == 0
    assert wait(world, z[2:], 9, index=2, stage=3) == 0
    with pytest.raises(CommTimeoutError) as ei:
        world.check()
    assert (ei.value.index, ei.value.expected, ei.value.stage) == (1, 4, STAGE_TEST)


@pytest.mark.parametrize("W", [2, 3])
def test_timeout_record_names_the_waiting_rank(W):
    def fn(world):
        world.wait_budget = 5
        flag = torch.zeros(1, dtype=torch.int32)
        ok = wait(world, flag, 1 + world.rank, index=10 + world.rank)
        try:
            world.check()
        except CommTimeoutError as e:
            return ok, (e.rank, e.index, e.expected, e.seen)
        return ok, None

    for r, (ok, rec) in enumerate(spawn(W, fn)):
        assert ok == 0
        assert rec == (r, 10 + r, 1 + r, 0)


def test_default_budgets_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", "123")
    monkeypatch.setenv("MOE_OVERLAP_WAIT_TIMEOUT_S", "0.5")
    assert default_wait_budget(torch.device("cpu")) == 123
    # Under the interpreter even a CUDA world budgets in iterations (no %globaltimer there).
    assert default_wait_budget(torch.device("cuda")) == 123
    monkeypatch.delenv("MOE_OVERLAP_WAIT_ITERS")
    assert default_wait_budget(torch.device("cpu")) == 200
    for bad in ("abc", "0", "-5"):  # named, not int()'s bare message
        monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", bad)
        with pytest.raises(ValueError, match="MOE_OVERLAP_WAIT_ITERS must be a positive int"):
            default_wait_budget(torch.device("cpu"))


# ------------------------------------------------------------------------------ publish
@pytest.mark.parametrize("W", [1, 2, 4])
def test_publish_ready_bumps_the_epoch_in_every_peer(W):
    def fn(world):
        pad = world.alloc((READY_SLOTS,), torch.int32)
        pad.local.zero_()
        epoch = torch.zeros(1, dtype=torch.int32)
        world.barrier()
        seen = []
        for _ in range(3):
            with launch_lock():
                sig.publish_ready(pad.ptrs, epoch, world.rank, W)
            world.barrier()
            seen.append(pad.local[:W].tolist())
            world.barrier()
        return seen, int(epoch), pad.local[W:].clone()

    for seen, epoch, rest in spawn(W, fn):
        assert seen == [[k] * W for k in (1, 2, 3)]
        assert epoch == 3
        assert not rest.any(), "publish_ready wrote outside the ready slots"


@pytest.mark.parametrize("W", [1, 3, 8])
def test_signal_add_and_set_through_the_table(W):
    def fn(world):
        s = world.signals(1 + W)
        with launch_lock():
            _add_to_every_peer_kernel[(1,)](s.ptrs, world.rank, W=W)
        world.barrier()
        return s.local.tolist()

    for got in spawn(W, fn):
        assert got == [W] + [r + 10 for r in range(W)]


# ------------------------------------------------------------------------------ toy op paths
def _consumer_only(world, x, budget):
    """Launch only the toy op's consumer role with its flags at zero: no producer ever ran."""
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
    return out, n_tiles


@pytest.mark.parametrize("W", [1, 2])
def test_toy_consumer_without_producers_marks_nan_and_raises(W):
    def fn(world):
        x = torch.randn(20, 40, generator=world.generator)
        out, n_tiles = _consumer_only(world, x, budget=10)
        try:
            world.check()
        except CommTimeoutError as e:
            return out, n_tiles, e
        return out, n_tiles, None

    for r, (out, n_tiles, e) in enumerate(spawn(W, fn)):
        assert torch.isnan(out).all(), "a consumer that timed out must mark its whole tile"
        assert isinstance(e, CommTimeoutError)
        # The interpreter runs program 0 first and it gives up on source 0's flag first.
        assert (e.rank, e.stage, e.index, e.expected, e.seen) == (r, STAGE_CONSUME, 0, 1, 0)
        assert n_tiles == 4


@pytest.mark.parametrize("W", [1, 3])
def test_toy_producer_waits_for_the_ready_handshake(W):
    # Producers may write into a destination only after it published the current epoch. With
    # this rank's epoch ahead of every ready slot, no producer writes, and the record names the
    # ready stage, the first destination, the epoch expected and the slot value seen.
    def fn(world):
        M, N = 5, 6
        x = torch.randn(M, N, generator=world.generator)
        buf = world.alloc((W, M, N), x.dtype)
        buf.local.fill_(7.0)
        flags = world.signals(W)
        world.signal_pad(1)
        pad_local, _ = world.ready_args()
        epoch = torch.full((1,), 4, dtype=torch.int32)
        world.barrier()
        with launch_lock():
            launch_push_allreduce(
                x,
                torch.empty_like(x),
                buf.local,
                buf.ptrs,
                flags.ptrs,
                flags.local,
                pad_local,
                epoch,
                world.error_buffer,
                world.rank,
                W,
                3,
                ROLE_PRODUCER,
                world.use_timer,
            )
        world.barrier()
        untouched = bool((buf.local == 7.0).all()) and not flags.local.any()
        try:
            world.check()
        except CommTimeoutError as e:
            return untouched, e
        return untouched, None

    for r, (untouched, e) in enumerate(spawn(W, fn)):
        assert untouched, "a producer wrote before its destination was ready"
        assert isinstance(e, CommTimeoutError)
        assert (e.rank, e.stage, e.index, e.expected, e.seen) == (r, STAGE_READY, 0, 4, 0)


def test_toy_op_with_a_peer_that_never_produces(monkeypatch):
    # Rank 1 keeps the emulated protocol's two barriers but launches nothing: rank 0's
    # consumers wait on rank 1's flags and give up; on the CPU end_op raises at once.
    monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", "20")
    M, N = 17, 33
    n_tiles = triton.cdiv(M, 16) * triton.cdiv(N, 32)

    def fn(world):
        # A good op first: its flags are all set, so only begin_op's owner reset stops the
        # second op's consumers from trusting them.
        good = push_allreduce(torch.ones(M, N), world)
        assert torch.equal(good, torch.full((M, N), 2.0))
        x = torch.randn(M, N, generator=world.generator)
        if world.rank == 1:
            world.run_fused = lambda launch: (world.barrier(), world.barrier())
        try:
            push_allreduce(x, world)
        except CommTimeoutError as e:
            return e
        return None

    e0, e1 = spawn(2, fn, timeout=60)
    assert e1 is None, "rank 1 waited on nothing"
    assert isinstance(e0, CommTimeoutError)
    assert (e0.rank, e0.stage, e0.expected, e0.seen) == (0, STAGE_CONSUME, 1, 0)
    assert e0.index == 1 * n_tiles + 0, "first missing flag: source 1, tile 0"


@pytest.mark.parametrize("W", [1, 3])
def test_begin_op_resets_flags_and_publishes_ready(W):
    def fn(world):
        world.signal_pad(10).local[READY_SLOTS:].fill_(5)  # stale flags of an earlier op
        world.barrier()
        flags = world.begin_op(10)
        world.barrier()
        pad = world.signal_pad(10).local
        return flags.local.clone(), pad[:READY_SLOTS].clone(), int(world._epoch)

    for flags, ready, epoch in spawn(W, fn):
        assert flags.shape == (10,) and not flags.any(), "begin_op must reset the op's flags"
        assert epoch == 1
        assert ready[:W].tolist() == [1] * W and not ready[W:].any()


def test_pending_error_surfaces_at_the_next_op():
    # The lazy path: nobody called check(); the next op of the world raises, then the world
    # works again.
    world = local_world(device="cpu")
    world.wait_budget = 4
    assert wait(world, torch.zeros(1, dtype=torch.int32), 1, index=6) == 0
    x = torch.randn(5, 9)
    with pytest.raises(CommTimeoutError) as ei:
        push_allreduce(x, world)
    assert ei.value.index == 6
    out = push_allreduce(x, world)
    assert torch.equal(out, x)


def test_end_op_on_cpu_checks_at_once():
    world = local_world(device="cpu")
    world.error_buffer[:6] = torch.tensor([1, 0, 5, 42, 3, 1])
    with pytest.raises(CommTimeoutError) as ei:
        world.end_op()
    assert (ei.value.stage, ei.value.index, ei.value.expected, ei.value.seen) == (5, 42, 3, 1)
    assert "combine" in str(ei.value)
    world.end_op()  # cleared


def test_unknown_stage_still_has_a_message():
    e = CommTimeoutError(rank=3, stage=999, index=1, expected=2, seen=0)
    assert "stage 999" in str(e) and "rank 3" in str(e)
    assert isinstance(e, RuntimeError)
