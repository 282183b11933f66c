"""``kernels.row_dot`` (the combine weights' gradient) against float64 torch, in the interpreter."""

import pytest
import torch

from moe_overlap.kernels.row_dot import row_dot
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
