"""The toy fused op ``moe_overlap.toy.push_allreduce`` on emulated worlds (CPU, interpreter).

Fresh random inputs per rank and per call, the shared workspace poisoned (NaN bytes) and stale
flags planted before every op, results against a float64 sum; every rank must also get bitwise
the same result (rank-order summation).
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import local_world
from moe_overlap.testing import assert_close, poison_, spawn
from moe_overlap.toy import push_allreduce
from moe_overlap.world.base import READY_SLOTS

WORLD_SIZES = [1, 2, 3, 4, 8]
SHAPES = [(1, 1), (17, 33), (40, 7)]
DTYPES = [torch.float32, torch.float16]


def make_input(rank: int, call: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * call + 31 * rank + shape[0] * 7 + shape[1])
    return torch.randn(shape, generator=g).to(dtype)


def reference(world_size: int, call: int, shape, dtype) -> torch.Tensor:
    return sum(make_input(r, call, shape, dtype).double() for r in range(world_size))


def poison_world(world, nbytes: int = 1 << 20):
    """NaN bytes in this rank's workspace and 1s in its op flags (a stale earlier op).

    Collective (the first call allocates). 0xFF bytes are NaN in fp32, fp16 and bf16; a consumer
    that read a slot nobody wrote, or trusted a flag begin_op failed to reset, returns NaN."""
    ws = world.workspace(nbytes)
    ws.local.fill_(0xFF)
    pad = world.signal_pad(1)
    pad.local.view(torch.int32)[READY_SLOTS:].fill_(1)
    world.barrier()


def run_calls(world, calls, dtype):
    outs = []
    for call, shape in calls:
        poison_world(world)
        x = make_input(world.rank, call, shape, dtype)
        x_before = x.clone()
        out = push_allreduce(x, world)
        assert torch.equal(x, x_before), "push_allreduce modified its input"
        outs.append(out)
    return outs


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_push_allreduce_matches_float64_sum(W, shape, dtype):
    per_rank = spawn(W, run_calls, [(0, shape)], dtype)
    ref = reference(W, 0, shape, dtype)
    for r, (out,) in enumerate(per_rank):
        assert out.shape == shape and out.dtype == dtype and out.device.type == "cpu"
        assert_close(out, ref, dtype=dtype, name=f"rank {r}")
        assert torch.equal(out, per_rank[0][0]), f"rank {r} differs bitwise from rank 0"
    if W == 1:
        assert torch.equal(per_rank[0][0], make_input(0, 0, shape, dtype))


@pytest.mark.parametrize("W", [2, 3, 4])
def test_back_to_back_calls_reset_flags(W):
    # Same world, several ops in a row with changing shapes (so flag counts and workspace views
    # change) and fresh inputs each time: a flag left over from the previous op, or a consumer
    # reading the previous op's data, shows as a wrong or NaN result.
    calls = [(1, (17, 33)), (2, (17, 33)), (3, (1, 1)), (4, (40, 7)), (5, (17, 33))]
    dtype = torch.float32
    per_rank = spawn(W, run_calls, calls, dtype)
    for i, (call, shape) in enumerate(calls):
        ref = reference(W, call, shape, dtype)
        for r in range(W):
            assert_close(per_rank[r][i], ref, name=f"call {call} rank {r}")


def test_back_to_back_without_poisoning_between_calls():
    # No barrier or poisoning between ops: only the op's own protocol separates them.
    W, shape = 3, (20, 40)

    def fn(world):
        outs = []
        for call in range(4):
            outs.append(push_allreduce(make_input(world.rank, call, shape, torch.float32), world))
        return outs

    per_rank = spawn(W, fn)
    for call in range(4):
        ref = reference(W, call, shape, torch.float32)
        for r in range(W):
            assert_close(per_rank[r][call], ref, name=f"call {call} rank {r}")


def test_workspace_growth_between_calls():
    # Another op grows the shared workspace between two toy ops (the old buffer is freed): the
    # next toy op must fetch the new workspace and its new pointer tables, not reuse stale ones.
    W, shape = 2, (17, 33)

    def fn(world):
        outs, sizes = [], []
        for call in range(3):
            outs.append(push_allreduce(make_input(world.rank, call, shape, torch.float32), world))
            sizes.append(world.workspace(0).local.numel())
            world.workspace((2 + call) << 20).local.fill_(0xFF)  # grow, poison
            world.barrier()
        return outs, sizes

    per_rank = spawn(W, fn)
    assert per_rank[0][1] == [1 << 20, 2 << 20, 3 << 20]
    for call in range(3):
        ref = reference(W, call, shape, torch.float32)
        for r in range(W):
            assert per_rank[r][1] == per_rank[0][1]
            assert_close(per_rank[r][0][call], ref, name=f"call {call} rank {r}")


def test_bfloat16_and_noncontiguous_input():
    W, shape = 2, (17, 33)

    def fn(world):
        x = make_input(world.rank, 9, (shape[1], shape[0]), torch.bfloat16).t()
        assert not x.is_contiguous()
        return push_allreduce(x, world)

    ref = sum(make_input(r, 9, (shape[1], shape[0]), torch.bfloat16).t().double() for r in range(W))
    for out in spawn(W, fn):
        assert out.shape == shape
        assert_close(out, ref, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_input(shape):
    outs = spawn(2, lambda w: push_allreduce(torch.empty(shape), w))
    assert all(o.shape == shape for o in outs)


def test_output_is_a_fresh_tensor_each_call():
    # Outputs never alias the workspace or each other: autograd may keep them.
    def fn(world):
        a = push_allreduce(make_input(world.rank, 1, (17, 33), torch.float32), world)
        a_copy = a.clone()
        b = push_allreduce(make_input(world.rank, 2, (17, 33), torch.float32), world)
        ws = world.workspace(0).local
        lo, hi = ws.data_ptr(), ws.data_ptr() + ws.numel()
        assert not lo <= a.data_ptr() < hi and not lo <= b.data_ptr() < hi
        return torch.equal(a, a_copy), a.data_ptr() != b.data_ptr()

    assert all(same and fresh for same, fresh in spawn(2, fn))


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "x,exc,match",
    [
        (torch.ones(3, 4, dtype=torch.float64), TypeError, "float32"),
        (torch.ones(3, 4, dtype=torch.int32), TypeError, "float32"),
        (torch.ones(12), ValueError, "2-D"),
        (torch.ones(2, 3, 4), ValueError, "2-D"),
        (torch.ones(()), ValueError, "2-D"),
        (torch.empty(3, 4, device="meta"), ValueError, "device|world"),
        ([[1.0, 2.0]], TypeError, "torch.Tensor"),
    ],
    ids=["float64", "int32", "1-D", "3-D", "0-D", "wrong-device", "list"],
)
def test_bad_input_raises_before_any_launch(x, exc, match):
    world = local_world(device="cpu")
    with pytest.raises(exc, match=match):
        push_allreduce(x, world)
    assert world._pad is None and world._ws is None, "validation must precede any allocation"
    # The world is still usable.
    y = torch.randn(3, 4)
    assert torch.equal(push_allreduce(y, world), y)


def test_bad_input_on_every_rank_does_not_hang():
    def fn(world):
        try:
            push_allreduce(torch.ones(5), world)
        except ValueError:
            return "raised"

    assert spawn(3, fn, timeout=30) == ["raised"] * 3


def test_poison_helper_marks_floats_and_ints():
    f = poison_(torch.zeros(3))
    i = poison_(torch.zeros(3, dtype=torch.int32))
    assert torch.isnan(f).all() and (i != 0).all()
