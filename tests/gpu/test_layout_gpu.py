"""The one-rank layout kernels (``kernels/moe_layout.py``) against the torch layout on the GPU,
at benchmark sizes (the CPU suite covers small ones in the interpreter)."""

import pytest
import torch

from moe_overlap.dispatch import layout as L

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FIELDS = (
    "counts", "cnt_all", "sorted_assign", "slot_of", "n_kept", "n_chunks", "chunks", "row_tok",
    "row_src", "row_local_expert", "row_slot", "expert_end", "expert_start", "slice_off",
    "slice_cnt", "n_tiles", "recv_rows",
)  # fmt: skip


@pytest.mark.parametrize(
    "T,E,K,bm",
    [
        (16384, 128, 8, 128),
        (8192, 256, 8, 128),
        (16384, 8, 2, 128),
        (1000, 64, 6, 64),
        (131072, 128, 8, 128),  # 1M assignments: 8192 blocks in the scan
        (1000, 64, 6, 96),  # BM not a power of two: the per-row expert search
        (4096, 1022, 4, 128),  # the largest E the kernels take
    ],
)
@pytest.mark.parametrize("routing", ["uniform", "drop", "hot"])
@pytest.mark.parametrize("static", [False, True])
def test_layout_kernels_equal_torch_on_gpu(T, E, K, bm, routing, static):
    g = torch.Generator(device="cuda").manual_seed(T + E + K)
    if routing == "hot":
        ids = torch.full((T, K), E // 2, device="cuda", dtype=torch.int64)
    else:
        ids = torch.randint(0, E, (T, K), generator=g, device="cuda")
        if routing == "drop":
            ids[torch.rand(T, K, generator=g, device="cuda") < 0.2] = -1
    tm = T if static else None
    want = L._build_layout_one_rank(ids, E, bm, tm)
    got = L._build_layout_one_rank_kernels(ids, E, bm, tm)
    assert (got.rows_cap, got.slots_cap_max, got.tiles_cap) == (
        want.rows_cap, want.slots_cap_max, want.tiles_cap)  # fmt: skip
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f
