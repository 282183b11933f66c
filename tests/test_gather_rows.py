"""The one-pass row gather the wgrads use, against its torch formula (bitwise)."""

import pytest
import torch

from moe_overlap.kernels.gather_rows import gather_rows, row_scale


def torch_gather(x, tok, recv, scale):
    t = tok.long()
    local = x.index_select(0, t.clamp(min=0)) if x.shape[0] else x.new_zeros(t.numel(), x.shape[1])
    if scale is not None:
        local = (local.float() * scale[:, None]).to(x.dtype)
    rows = local if recv is None else torch.where((t >= 0)[:, None], local, recv[: t.numel()])
    return torch.where((t >= -1)[:, None], rows, torch.zeros_like(rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,R,H", [(9, 21, 13), (0, 7, 40), (33, 50, 1)])
@pytest.mark.parametrize("with_recv,with_scale", [(True, True), (False, True), (True, False)])
def test_gather_rows_equals_torch_bitwise(dtype, T, R, H, with_recv, with_scale):
    g = torch.Generator().manual_seed(T * 100 + R + H)
    x = torch.randn(T, H, generator=g).to(dtype)
    tok = torch.randint(-2, max(T, 1), (R,), generator=g).to(torch.int32)
    if not with_recv:
        tok = torch.where(tok == -1, torch.full_like(tok, -2), tok)
    if T == 0:
        tok = torch.where(tok >= 0, torch.full_like(tok, -1 if with_recv else -2), tok)
    recv = torch.randn(R + 3, H, generator=g).to(dtype) if with_recv else None
    scale = torch.rand(R, generator=g) * 3 if with_scale else None
    out = gather_rows(x, tok, recv, scale, interpreted=True)
    want = torch_gather(x, tok, recv, scale)
    assert out.dtype == dtype and out.shape == (R, H)
    if dtype == torch.bfloat16 and with_scale:
        # The interpreter rounds fp32 -> bf16 differently from torch (1 ulp at most); compiled
        # Triton rounds to nearest even like torch (covered by the GPU suite).
        torch.testing.assert_close(out, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, want), (out - want).abs().max()


@pytest.mark.parametrize("which", ["x", "recv"])
def test_gather_rows_refuses_strided_columns(which):
    # The kernel steps columns by 1: a column-strided input read the wrong elements.
    x, recv = torch.randn(6, 8), torch.randn(5, 8)
    if which == "x":
        x = torch.randn(6, 16)[:, ::2]
    else:
        recv = torch.randn(8, 5).t()
    tok = torch.tensor([0, -1, 3, -2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous rows"):
        gather_rows(x, tok, recv, interpreted=True)


@pytest.mark.parametrize("R,A", [(1, 1), (37, 20), (64, 0), (5, 9)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_row_scale_equals_torch(R, A, wdtype):
    # w[sorted_assign[row_slot[r]]] for local rows, 1 for rows from peers, 0 for padding
    g = torch.Generator().manual_seed(R * 10 + A)
    tok = torch.randint(-2, 5, (R,), generator=g).to(torch.int32)
    if A == 0:
        tok = torch.where(tok >= 0, torch.full_like(tok, -1), tok)
    slot = torch.randint(0, max(A, 1), (R,), generator=g).to(torch.int32)
    slot = torch.where(tok >= 0, slot, torch.full_like(slot, -7))  # never read there
    sorted_a = torch.randperm(max(A, 1), generator=g)[:A].to(torch.int32)
    w = (torch.rand(A, generator=g) + 0.1).to(wdtype)
    got = row_scale(tok, slot, sorted_a, w, interpreted=True)
    t = tok.long()
    want = torch.where(t == -1, 1.0, 0.0)
    if A:
        wl = w.float()[sorted_a.long()[slot.long().clamp(min=0)]]
        want = torch.where(t >= 0, wl, want)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
