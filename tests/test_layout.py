"""The one-rank routing layout (``_build_layout_one_rank``) against the general one at W = 1."""

import pytest
import torch

from moe_overlap.dispatch import layout as L
from moe_overlap.world import init_world

FIELDS = (
    "counts", "cnt_all", "sorted_assign", "slot_of", "n_kept", "n_chunks", "row_tok",
    "row_src", "row_local_expert", "row_slot", "expert_end", "expert_start", "slice_off",
    "slice_cnt", "n_tiles", "recv_rows",
)  # fmt: skip


def _ids(T, E, K, routing, seed):
    g = torch.Generator().manual_seed(seed)
    if routing == "hot":  # every assignment on one expert (ids may repeat within a token)
        return torch.full((T, K), E - 1, dtype=torch.int64)
    ids = torch.randint(0, E, (T, K), generator=g)  # repeats allowed, K may exceed E
    if routing == "drop":
        ids[torch.rand(T, K, generator=g) < 0.3] = -1
    if routing == "empty":  # experts 0 and E-1 get nothing
        ids = ids % max(E - 2, 1) + 1 if E > 2 else ids
    return ids


@pytest.mark.parametrize("T,E,K,bm", [(0, 4, 2, 16), (1, 1, 1, 16), (37, 8, 3, 16),
                                      (300, 4, 8, 16), (64, 5, 2, 128)])  # fmt: skip
@pytest.mark.parametrize("routing", ["uniform", "drop", "hot", "empty"])
@pytest.mark.parametrize("static", [False, True])
def test_one_rank_layout_equals_general(T, E, K, bm, routing, static):
    world = init_world()
    ids = _ids(T, E, K, routing, seed=T + E)
    tm = T + 3 if static else None
    fast = L._build_layout_one_rank(ids, E, bm, tm)
    gen = L._build_layout_world(ids, E, world, bm, tm)
    if not static and fast.rows_cap != gen.rows_cap:
        # the sync-free bound: the general layout's rows are a prefix of the fast one's
        assert 4 * E * (bm - 1) <= T * K and fast.rows_cap >= gen.rows_cap
        assert fast.slots_cap_max >= gen.slots_cap_max
    else:
        assert (fast.rows_cap, fast.slots_cap_max, fast.chunks_cap, fast.tiles_cap) == (
            gen.rows_cap, gen.slots_cap_max, gen.chunks_cap, gen.tiles_cap)  # fmt: skip
    R = gen.rows_cap
    for f in FIELDS:
        a, b = getattr(fast, f), getattr(gen, f)
        assert a.dtype == b.dtype, f
        if f in ("row_tok", "row_src", "row_local_expert", "row_slot"):
            assert torch.equal(a[:R], b[:R]), f
            # rows past the general layout's are tail padding of the last expert
            assert (a[R:] == {"row_tok": -2, "row_src": -1, "row_slot": -1,
                              "row_local_expert": E - 1}[f]).all(), f  # fmt: skip
        else:
            assert torch.equal(a, b), f


def test_one_rank_layout_sizes_without_sync_only_when_padding_is_small():
    ids = _ids(512, 8, 2, "uniform", 0)
    small = L._build_layout_one_rank(ids, 8, 16, None)  # 8 * 15 * 4 <= 1024: bound
    assert small.rows_cap == -(-(1024 + 8 * 15) // 16) * 16
    big = L._build_layout_one_rank(ids[:20], 8, 16, None)  # 40 rows: exact
    assert big.rows_cap == int(((big.counts.long() + 15) // 16 * 16).sum())


@pytest.mark.parametrize("T,E,K,bm", [(0, 4, 2, 16), (1, 1, 1, 16), (37, 8, 3, 16),
                                      (300, 4, 8, 16), (64, 5, 2, 128), (50, 40, 6, 16),
                                      (23, 130, 4, 16), (41, 6, 3, 24)])  # fmt: skip
@pytest.mark.parametrize("routing", ["uniform", "drop", "hot", "empty"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_one_rank_layout_kernels_equal_torch(T, E, K, bm, routing, static, id_dtype):
    # The five-kernel layout (interpreter here, the GPU's path) against the torch one: every
    # field bitwise, rows and all. Fields start as garbage: a value no kernel wrote shows.
    ids = _ids(T, E, K, routing, seed=T * 7 + E).to(id_dtype)
    tm = T + 5 if static else None
    want = L._build_layout_one_rank(ids, E, bm, tm)
    real_empty = torch.empty

    def poisoned(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(-777) if t.dtype == torch.int32 else t

    torch.empty = poisoned
    try:
        got = L._build_layout_one_rank_kernels(ids, E, bm, tm)
    finally:
        torch.empty = real_empty
    for f in ("rows_cap", "rows_cap_max", "slots_cap_max", "chunks_cap", "tiles_cap"):
        assert getattr(got, f) == getattr(want, f), f
    for f in FIELDS + ("chunks",):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f"{f}: {a.tolist()} != {b.tolist()}"


def test_build_layout_takes_the_kernels_in_the_interpreter(monkeypatch):
    calls = []
    real = L._build_layout_one_rank_kernels
    monkeypatch.setattr(L, "_build_layout_one_rank_kernels", lambda *a: calls.append(1) or real(*a))
    L.build_layout(_ids(9, 4, 2, "uniform", 1), 4, init_world(), 16)
    assert calls


def test_layout_kernel_fields_are_16_byte_aligned():
    # odd T x K: unpadded, every field after slot_of would start off a 16-byte boundary
    lay = L._build_layout_one_rank_kernels(_ids(7, 5, 3, "uniform", 2), 5, 16, None)
    for f in FIELDS:
        t = getattr(lay, f)
        assert t.data_ptr() % 16 == 0 or t.numel() == 0, f


def test_large_expert_counts_take_the_torch_layout(monkeypatch):
    def boom(*a):
        raise AssertionError("kernels used above LAYOUT_KERNELS_MAX_E")

    monkeypatch.setattr(L, "_build_layout_one_rank_kernels", boom)
    E = L.LAYOUT_KERNELS_MAX_E + 1
    lay = L.build_layout(_ids(5, E, 2, "uniform", 3), E, init_world(), 16)
    assert lay.counts.shape == (E,)


def test_layout_kernels_reject_ids_out_of_range():
    ids = _ids(6, 4, 2, "uniform", 4)
    ids[3, 1] = 4
    with pytest.raises(ValueError, match="out of range"):
        L._build_layout_one_rank_kernels(ids, 4, 16, None)


def test_static_sizing_with_bounds_that_differ_between_ranks_raises():
    """Each rank sizes its receive buffer from its own ``max_tokens_per_rank``: a peer with a
    larger bound can send more rows than fit. Rank 0 must raise (it used to corrupt the heap in
    ``repeat_interleave``), rank 1, whose bound covers everything, builds."""
    from moe_overlap.testing import spawn

    Ts = (2, 20)

    def fn(world):
        T = Ts[world.rank]
        ids = torch.zeros(T, 2, dtype=torch.int64)  # every assignment on rank 0's expert
        try:
            lay = L.build_layout(ids, 2, world, 4, max_tokens_per_rank=T)
        except RuntimeError as e:
            return str(e)
        return int(lay.n_tiles[0])

    got = spawn(2, fn, timeout=60)
    assert "max_tokens_per_rank=2" in got[0] and "same on every rank" in got[0], got[0]
    assert got[1] == 0  # rank 1's expert gets nothing


def test_static_sizing_survives_negative_counts(monkeypatch):
    """A timed-out count exchange returns -1 for the missing source (its error is raised at the
    op's end); the static layout must stay in bounds meanwhile (no host check there)."""
    from moe_overlap.testing import spawn

    real = L.exchange_counts

    def timed_out(counts, world):
        out = real(counts, world)
        out[1] = -1
        return out

    monkeypatch.setattr(L, "exchange_counts", timed_out)
    E, K, T = 4, 2, 5

    def fn(world):
        g = torch.Generator().manual_seed(world.rank)
        ids = torch.randint(0, E, (T, K), generator=g)
        lay = L.build_layout(ids, E, world, 4, max_tokens_per_rank=8)
        return lay.slice_cnt.tolist(), int(lay.n_tiles[0]), lay.rows_cap

    for slice_cnt, n_tiles, rows_cap in spawn(2, fn, timeout=60):
        assert all(c == 0 for c in slice_cnt[1])  # source 1's -1s read as nothing
        assert min(min(r) for r in slice_cnt) >= 0 and 0 <= n_tiles * 4 <= rows_cap


@pytest.mark.parametrize("T,E,K,bm", [(0, 4, 2, 16), (1, 1, 1, 16), (37, 8, 3, 16),
                                      (300, 4, 8, 16), (64, 5, 2, 128)])  # fmt: skip
@pytest.mark.parametrize("routing", ["uniform", "drop", "hot", "empty"])
@pytest.mark.parametrize("W,static", [(1, False), (1, True), (2, False), (2, True)])
def test_expert_sum_equals_float64_row_sums(T, E, K, bm, routing, W, static):
    """The bias gradients' per-expert row sum (block sums, then float64 prefix differences)
    against a float64 sum over each expert's real rows, with empty experts, one hot expert,
    dropped assignments, no tokens, and static (worst-case) sizing."""
    from moe_overlap.experts.fused import _expert_sum
    from moe_overlap.testing import spawn

    if E % W:
        pytest.skip("experts must split over the ranks")

    def fn(world):
        ids = _ids(T, E, K, routing, seed=T + E + world.rank)
        lay = L.build_layout(ids, E, world, bm, max_tokens_per_rank=T + 3 if static else None)
        g = torch.Generator().manual_seed(7 + world.rank)
        rows = torch.randn(lay.rows_cap, 33, generator=g) * 4 + 1
        real = lay.row_tok >= -1
        rows[~real] = 0  # padding rows are zero, as the backward masks them
        want = torch.zeros(lay.local_experts, 33, dtype=torch.float64)
        want.index_add_(0, lay.row_local_expert.long()[real], rows[real].double())
        got = _expert_sum(rows, lay)
        return got, want, int(real.sum())

    for got, want, n_real in spawn(W, fn, timeout=60):
        assert got.dtype == torch.float32 and got.shape == want.shape
        err = (got.double() - want).abs().max().item() if want.numel() else 0.0
        assert err <= 1e-5 * max(want.abs().max().item() if want.numel() else 0.0, 1.0), err
        if n_real == 0:
            assert not got.any()
