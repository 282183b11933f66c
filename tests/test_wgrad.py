"""The weight-gradient kernel (``kernels/moe_wgrad.py``) in the interpreter against float64:
experts with no rows, one row, exactly one block, a block and one row, several blocks; ragged
M and N tiles; fp32 and fp16; every output element written (the output starts as NaN)."""

import pytest
import torch

from moe_overlap import local_world
from moe_overlap.experts import fused
from moe_overlap.kernels.moe_wgrad import grouped_wgrad
from moe_overlap.testing import assert_close

CFG = dict(BM=16, BN=16, BK=16, GM=2, num_warps=4, num_stages=1)


def _padded(counts, M, N, dtype, block, g):
    """Rows of each expert at a multiple of ``block``, random where real, zero in the padding
    (as the layout leaves them), and some garbage past the last range."""
    starts, ends, pos = [], [], 0
    for c in counts:
        starts.append(pos)
        ends.append(pos + c)
        pos += -(-c // block) * block
    R = pos + block  # rows past the last range are unspecified: fill them
    a = torch.zeros(R, M, dtype=dtype)
    b = torch.zeros(R, N, dtype=dtype)
    for s, e in zip(starts, ends):
        a[s:e] = torch.randn(e - s, M, generator=g).to(dtype)
        b[s:e] = torch.randn(e - s, N, generator=g).to(dtype)
    a[pos:] = torch.randn(R - pos, M, generator=g).to(dtype)
    b[pos:] = torch.randn(R - pos, N, generator=g).to(dtype)
    i32 = torch.int32
    return a, b, torch.tensor(starts, dtype=i32), torch.tensor(ends, dtype=i32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N", [(24, 40), (16, 8), (40, 24)])
@pytest.mark.parametrize("programs", [1, 3])
def test_wgrad_kernel_matches_reference(M, N, dtype, programs):
    g = torch.Generator().manual_seed(M * 100 + N)
    counts = [0, 1, 16, 17, 33, 5]
    a, b, starts, ends = _padded(counts, M, N, dtype, 16, g)
    out = torch.full((len(counts), M, N), float("nan"), dtype=dtype)
    grouped_wgrad(a, b, starts, ends, out, CFG, programs)
    for le, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        want = a[s:e].double().t() @ b[s:e].double()
        assert_close(out[le], want, dtype=dtype, name=f"expert {le} ({e - s} rows)")


def test_wgrad_kernel_block_of_32_takes_two_k_steps_per_block():
    # BK 16 inside 32-row blocks: an expert's last step may read a whole padding step of zeros
    g = torch.Generator().manual_seed(3)
    a, b, starts, ends = _padded([3, 32, 45], 24, 16, torch.float32, 32, g)
    out = torch.full((3, 24, 16), float("nan"))
    grouped_wgrad(a, b, starts, ends, out, CFG, 2)
    for le, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        assert_close(out[le], a[s:e].double().t() @ b[s:e].double(), name=f"expert {le}")


def test_wgrad_switch(monkeypatch):
    # auto (the default): the Gluon kernel where every warp-specialized kernel runs, else
    # grouped_mm; grouped_mm forces it; a bad value fails before any launch
    lay = type("L", (), {"block_m": 16})()
    a = torch.zeros(32, 8)
    cfg = fused.wgrad_config()
    assert fused._wgrad_env() == "auto"
    assert not fused._wgrad_ws_usable(a, a, type("L", (), {"block_m": 128})(), None)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "grouped_mm")
    assert not fused._wgrad_kernel_usable(a, a, lay, a.dtype, cfg)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "kernel")
    assert fused._wgrad_kernel_usable(a, a, lay, a.dtype, cfg)
    assert not fused._wgrad_kernel_usable(a, a, lay, torch.float16, cfg)  # output dtype
    b = torch.zeros(32, 7)  # 28-byte rows: no TMA
    assert not fused._wgrad_kernel_usable(b, b, lay, b.dtype, cfg)
    assert not fused._wgrad_kernel_usable(a, a, type("L", (), {"block_m": 8})(), a.dtype, cfg)
    # the Gluon mode: only where every warp-specialized kernel runs (one rank, Hopper, ...)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "ws")
    assert fused._wgrad_kernel_usable(a, a, lay, a.dtype, cfg)  # its fallback here
    world = local_world(torch.device("cpu"))
    lay128 = type("L", (), {"block_m": 128})()
    assert not fused._wgrad_ws_usable(a, a, lay128, world)
    monkeypatch.setattr(fused, "_ws_common_ok", lambda *a: True)
    assert fused._wgrad_ws_usable(a, a, lay128, world)
    assert not fused._wgrad_ws_usable(a, a, type("L", (), {"block_m": 32})(), world)  # BK 64
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "kernel")
    assert not fused._wgrad_ws_usable(a, a, lay128, world)
    monkeypatch.delenv("MOE_OVERLAP_WGRAD")  # auto takes it where usable
    assert fused._wgrad_ws_usable(a, a, lay128, world)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "grouped_mm")
    assert not fused._wgrad_ws_usable(a, a, lay128, world)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", "cutlass")
    with pytest.raises(ValueError, match="MOE_OVERLAP_WGRAD"):
        fused._wgrad_kernel_usable(a, a, lay, a.dtype, cfg)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD_GRID", "tiles")
    assert fused.wgrad_config()["GRID"] == "tiles"
    monkeypatch.setenv("MOE_OVERLAP_WGRAD_GRID", "all")
    with pytest.raises(ValueError, match="MOE_OVERLAP_WGRAD_GRID"):
        fused.wgrad_config()
