"""``kernels.row_dot`` (the combine weights' gradient) against float64 torch, in the interpreter."""

import pytest
import torch

from moe_overlap.kernels.row_dot import DW_MIN_WEIGHT, row_dot, weights_grad_from_partials
from moe_overlap.testing import assert_close


@pytest.mark.parametrize("T,K,H", [(1, 1, 1), (7, 2, 33), (19, 8, 130), (5, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("drop", [0.0, 0.3, 1.0])
def test_row_dot_matches_torch(T, K, H, dtype, drop):
    g = torch.Generator().manual_seed(T * 100 + K * 10 + H)
    TK = T * K
    S = TK + 3  # more slots than kept rows, as a static layout has
    slot_of = torch.randperm(S, generator=g)[:TK].to(torch.int32)
    slot_of[torch.rand(TK, generator=g) < drop] = -1
    o = torch.randn(S, H, generator=g).to(dtype)
    dy = torch.randn(T, H, generator=g).to(dtype)
    got = row_dot(o, dy, slot_of, K, interpreted=True)
    j = slot_of.long()
    ref = (o.double()[j.clamp(min=0)] * dy.double().repeat_interleave(K, 0)).sum(1)
    ref = torch.where(j >= 0, ref, torch.zeros_like(ref))
    assert got.dtype == torch.float32
    assert_close(got, ref.float(), torch.float32, name=f"row_dot T{T} K{K} H{H} {dtype}")


def test_row_dot_rejects_bad_shapes():
    o, dy = torch.randn(4, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="entries"):
        row_dot(o, dy, torch.zeros(3, dtype=torch.int32), 2, interpreted=True)
    with pytest.raises(ValueError, match="columns"):
        row_dot(torch.randn(4, 6), dy, torch.zeros(4, dtype=torch.int32), 2, interpreted=True)
    with pytest.raises(ValueError, match="row-contiguous"):
        row_dot(o.t().contiguous().t(), dy, torch.zeros(4, dtype=torch.int32), 2, True)


@pytest.mark.parametrize("T,K,H,NN", [(1, 1, 1, 1), (7, 2, 33, 3), (19, 8, 130, 2)])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_weights_grad_from_partials_matches_row_dot(T, K, H, NN, drop):
    # The partials hold w * <o, dy> split over NN column tiles; zero and tiny weights (which
    # cannot be divided out) must come from the o rows instead.
    g = torch.Generator().manual_seed(T * 100 + K * 10 + H + NN)
    TK = T * K
    S = TK + 2
    slot_of = torch.randperm(S, generator=g)[:TK].to(torch.int32)
    slot_of[torch.rand(TK, generator=g) < drop] = -1
    o = torch.randn(S, H, generator=g)
    dy = torch.randn(T, H, generator=g)
    w = torch.rand(TK, generator=g) + 0.1
    w[::3] = 0.0
    w[1::4] = DW_MIN_WEIGHT / 8
    j = slot_of.long()
    dot = (o.double()[j.clamp(min=0)] * dy.double().repeat_interleave(K, 0)).sum(1)
    ref = torch.where(j >= 0, dot, torch.zeros_like(dot))
    split = torch.rand(TK, NN, generator=g, dtype=torch.float64)
    split = split / split.sum(1, keepdim=True)
    part = torch.full((S, NN), float("nan"), dtype=torch.float64)  # unused slots: never read
    kept = j >= 0
    part[j[kept]] = (w.double() * dot)[kept, None] * split[kept]
    got = weights_grad_from_partials(part.float(), w, o, dy, slot_of, K, interpreted=True)
    assert_close(got, ref.float(), torch.float32, name=f"dw partials T{T} K{K} H{H} NN{NN}")


def test_weights_grad_from_partials_rejects_bad_input():
    o, dy, s = torch.randn(4, 8), torch.randn(2, 8), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp32"):
        weights_grad_from_partials(torch.zeros(4, 2, dtype=torch.float64), s.float(), o, dy, s, 2)
    with pytest.raises(ValueError, match="entries"):
        weights_grad_from_partials(torch.zeros(4, 2), torch.ones(3), o, dy, s, 2)
