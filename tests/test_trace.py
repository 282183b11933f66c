"""Per-tile traces of the fused MoE kernels (``trace=`` on ``layer0`` / ``layer1``)."""

import pytest
import torch

from moe_overlap.bench import trace as tr
from moe_overlap.experts import fused
from moe_overlap.testing import spawn


def _run(world, T, H, F, E, K):
    g = torch.Generator().manual_seed(7 + world.rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    El = E // world.world_size
    w1 = torch.randn(El, 2 * F, H, generator=g) * 0.1
    w2 = torch.randn(El, H, F, generator=g) * 0.1
    layout = fused.dispatch_layout(ids, E, world)
    buf0 = tr.new_buffer(256)
    buf1 = tr.new_buffer(256)
    h_plain = fused.layer0(x, layout, w1, world)
    h = fused.layer0(x, layout, w1, world, trace=buf0)
    y_plain = fused.layer1(h, layout, w, w2, world)
    y = fused.layer1(h, layout, w, w2, world, trace=buf1)
    n_m = int(layout.n_tiles)
    valid = layout.row_tok >= -1  # padding rows are never written
    return buf0, buf1, n_m, torch.equal(h_plain[valid], h[valid]), torch.equal(y_plain, y)


@pytest.mark.parametrize("W", [1, 2])
def test_trace_records_one_ordered_event_per_tile(W):
    T, H, F, E, K = 11, 24, 20, 4, 2
    res = spawn(W, _run, T, H, F, E, K)
    cfg0 = fused.layer0_config("swiglu", 4)
    cfg1 = fused.layer1_config(4)
    for rank, (b0, b1, n_m, same_h, same_y) in enumerate(res):
        assert same_h and same_y, "tracing changed the results"
        for buf, n_n in ((b0, -(-F // cfg0["BN"])), (b1, -(-H // cfg1["BN"]))):
            ev = tr.valid_events(buf)
            assert ev.shape[0] == n_m * n_n, (rank, ev.shape, n_m, n_n)
            assert (ev[:, 0] == rank).all()
            assert sorted(ev[:, 2].tolist()) == list(range(n_m * n_n))  # every tile once
            assert (ev[:, 3] <= ev[:, 4]).all() and (ev[:, 4] < ev[:, 5]).all()
    chrome = tr.to_chrome(res[0][0])
    assert chrome["traceEvents"], "no events in the Chrome trace"


def test_trace_buffer_is_validated():
    world = spawn(1, lambda w: w)[0]
    ids = torch.zeros(3, 1, dtype=torch.long)
    layout = fused.dispatch_layout(ids, 2, world)
    x = torch.randn(3, 8)
    w1 = torch.randn(2, 8, 8)
    for bad in (
        torch.zeros(4, 5, dtype=torch.int64),
        torch.zeros(4, 6, dtype=torch.int32),
        torch.zeros(1, 6, dtype=torch.int64),
    ):
        with pytest.raises(ValueError, match="trace"):
            fused.layer0(x, layout, w1, world, trace=bad)
