"""The put transport of the MoE ops (``kernels/put.py``) on emulated multi-node worlds.

An emulated world given a topology of several nodes (``World.set_topology``) moves rows to
ranks of other nodes by the put path: staged in its own workspace, copied by ``put_signal``'s
emulated branch, announced on 64-bit signal words. Within a node it keeps the store path. So
these CPU tests run the count exchange, the layer-0 dispatch and the layer-1 combine over both
transports at once, forward and backward, against the float64 reference, and check that the
result is bitwise the single-node (store-only) one: the transport must not change a value.
The NVSHMEM call itself is compiled for sm_90 in tests/test_compile_sm90.py and run by
tests/multigpu/test_nvshmem_multigpu.py (FORCE_PUT) where several GPUs are lent.
"""

from __future__ import annotations

import pytest
import torch

import moe_overlap as mo
from moe_overlap import reference as ref
from moe_overlap.dispatch.layout import exchange_counts
from moe_overlap.testing import assert_close, randn, spawn
from moe_overlap.world.base import READY_SLOTS
from moe_overlap.world.topology import Topology

f64 = torch.float64


def _nodes(world, per_node: int):
    world.set_topology(Topology.from_local_world_size(world.world_size, per_node))


def test_count_exchange_over_puts_uses_the_signal_words():
    W, E = 4, 6

    def fn(world):
        _nodes(world, 2)
        c = (torch.arange(E, dtype=torch.int32) * 3 + 7 * world.rank + 1).contiguous()
        out = exchange_counts(c, world)
        pad = world._pad.local.view(torch.int32)
        flags = pad[READY_SLOTS : READY_SLOTS + W].clone()
        sig = pad[READY_SLOTS + 64 :].view(torch.int64)[:W].clone()
        return out, flags, sig, world.put_mask.tolist()

    for r, (out, flags, sig, mask) in enumerate(spawn(W, fn)):
        want = torch.stack([torch.arange(E, dtype=torch.int32) * 3 + 7 * s + 1 for s in range(W)])
        assert torch.equal(out, want)
        node = r // 2
        assert mask == [int(d // 2 != node) for d in range(W)]
        for s in range(W):
            far = s // 2 != node
            # A source on another node raised our 64-bit word, never the int32 flag.
            assert (int(flags[s]), int(sig[s])) == ((0, 1) if far else (1, 0)), (r, s)


CASES = [
    # W, ranks per node, tokens per rank, H, F, E, K, act, routing
    (2, 1, (9, 6), 24, 12, 4, 2, "swiglu", "uniform"),
    (4, 2, (7, 0, 11, 5), 20, 8, 8, 3, "gelu", "uniform"),
    (4, 1, (6, 6, 6, 6), 16, 8, 4, 4, "relu", "hot"),
    (3, 1, (5, 8, 3), 40, 12, 6, 1, "swiglu", "sparse"),
]


def _ids(routing, T, E, K, W, g):
    if routing == "hot":
        return torch.full((T, K), int(torch.randint(E, (1,), generator=g)), dtype=torch.int64)
    allowed = torch.arange(E - E // W) if routing == "sparse" else torch.arange(E)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    return torch.stack(
        [allowed[torch.randperm(allowed.numel(), generator=g)[:K]] for _ in range(T)]
    )


@pytest.mark.parametrize("W,per_node,tokens,H,F,E,K,act,routing", CASES)
def test_fused_experts_over_puts_matches_reference_and_store_path(
    W, per_node, tokens, H, F, E, K, act, routing
):
    g = torch.Generator().manual_seed(W * 100 + E * 10 + K)
    rows = 2 * F if act == "swiglu" else F
    w1 = randn((E, rows, H), torch.float32, generator=g, scale=H**-0.5)
    w2 = randn((E, H, F), torch.float32, generator=g, scale=F**-0.5)
    xs = [randn((T, H), torch.float32, generator=g) for T in tokens]
    ids = [_ids(routing, T, E, K, W, g) for T in tokens]
    wts = [torch.rand(T, K, generator=g) + 0.1 for T in tokens]
    gys = [randn((T, H), torch.float32, generator=g) for T in tokens]
    El = E // W

    def run(multi_node):
        def fn(world):
            if multi_node:
                _nodes(world, per_node)
                assert world.has_puts
            r = world.rank
            world.workspace(1 << 20).local.fill_(0xFF)  # poison: a row that never came is NaN
            world.barrier()
            x = xs[r].clone().requires_grad_()
            tw = wts[r].clone().requires_grad_()
            a = w1[r * El : (r + 1) * El].clone().requires_grad_()
            b = w2[r * El : (r + 1) * El].clone().requires_grad_()
            y = mo.fused_experts(x, ids[r], tw, a, b, world, activation=act)
            y.backward(gys[r])
            world.check()
            z = lambda t: torch.zeros_like(t) if t.grad is None else t.grad  # noqa: E731
            return y.detach(), z(x), z(tw), z(a), z(b)

        return spawn(W, fn, timeout=120)

    multi, single = run(True), run(False)
    # float64 reference over all ranks' tokens and the global experts
    w1d, w2d = w1.double().requires_grad_(), w2.double().requires_grad_()
    loss, leaves = 0.0, []
    for r in range(W):
        x = xs[r].double().requires_grad_()
        tw = wts[r].double().requires_grad_()
        y = ref.experts(x, ids[r], tw, w1d, w2d, act)
        loss = loss + (y * gys[r].double()).sum()
        leaves.append((x, tw, y.detach()))
    loss.backward()
    for r in range(W):
        sl = slice(r * El, (r + 1) * El)
        x, tw, y_ref = leaves[r]
        got = multi[r]
        names = ("y", "dx", "dtopk_weights", "dw1", "dw2")
        z = lambda t: torch.zeros_like(t) if t.grad is None else t.grad  # noqa: E731
        wants = (y_ref, z(x), z(tw), w1d.grad[sl], w2d.grad[sl])
        for name, g_, want in zip(names, got, wants):
            assert_close(g_, want, name=f"W{W} rank {r} {name} (puts)")
        for name, a_, b_ in zip(names, got, single[r]):
            assert torch.equal(a_, b_), f"W{W} rank {r} {name}: put path differs from stores"


def test_moe_layer_over_puts_equals_single_node():
    cfg = mo.MoEConfig(hidden_size=24, ffn_hidden_size=16, num_experts=4, top_k=2)
    W = 2
    g = torch.Generator().manual_seed(5)
    # Non-contiguous token rows (a transposed view): the layer must not assume a layout.
    x = torch.randn(W, 24, 10, generator=g).transpose(1, 2)

    def run(multi_node):
        def fn(world):
            if multi_node:
                _nodes(world, 1)
            layer = mo.MoELayer(cfg, world=world, generator=torch.Generator().manual_seed(3))
            xr = x[world.rank]
            assert not xr.is_contiguous()
            y = layer(xr)
            # The same layer on contiguous rows (the router's matmul may round differently).
            assert_close(y, layer(xr.contiguous()), name=f"rank {world.rank} strided x")
            return y.detach(), layer.expert_counts

        return spawn(W, fn, timeout=120)

    for (ya, ca), (yb, cb) in zip(run(True), run(False)):
        assert torch.equal(ya, yb) and torch.equal(ca, cb)


def test_op_without_put_path_refuses_a_multi_node_world():
    def fn(world):
        _nodes(world, 1)
        x = torch.randn(3, 8)
        w = torch.randn(5, 8)
        with pytest.raises(RuntimeError, match="no put path"):
            mo.all_gather_matmul(x, w, world)
        return True

    assert all(spawn(2, fn))
