"""GPU tests of dense TP (compiled Triton, bf16): emulated ranks on one GPU.

* sequential mode (every rank on one stream, producers before consumers): forward only. A
  backward node in that mode would meet a host barrier on autograd's single CUDA worker thread.
* concurrent mode (one stream per rank, both roles in one launch): forward and backward, with
  one rank's stream delayed by ``torch.cuda._sleep`` before the op, so the others' tiles really
  wait on flags. The data is checked, not only the flags: a missing ``debug_barrier`` before a
  publish or after a poll shows up here as wrong tiles.

Status on the H200 (torch 2.11, Triton 3.6): the sequential tests pass. In concurrent mode the
first call of every new kernel variant stalls (the 10 s wait budget ran out, then later tests
hung) while the same cases pass once the variants are loaded (W=2, rank 1 delayed, forward and
backward). Likely cause: CUDA lazy module loading, which may synchronize the context, so one
emulated rank's first launch waits for another rank's spinning kernel (a documented lazy-loading
deadlock). Run these tests with ``CUDA_MODULE_LOADING=EAGER`` set before CUDA initializes
(not yet verified).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.testing import assert_close, spawn
from moe_overlap.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_matmul,
    matmul_reduce_scatter,
    sync_sequence_parallel_grads,
)
from moe_overlap.world import interpreted, local_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(interpreted(), reason="GPU tests run compiled (without TRITON_INTERPRET)"),
]

BF16 = torch.bfloat16
SLEEP_CYCLES = 50_000_000  # ~25 ms at H200 clocks: far longer than the op itself
# Waits may span a peer's first JIT compile of a new variant (measured on the H200: a 10 s
# budget ran out while the backward variants compiled on autograd's worker thread), so the
# concurrent tests wait long; they check data, not timeouts.
WAIT_NS = int(float(os.environ.get("MOE_OVERLAP_TEST_WAIT_S", "30")) * 1e9)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _ag_data(key, W, Ms, N, K, bias):
    gen = _gen("ag", key, W, Ms, N, K, bias)
    return dict(
        x=[_randn(gen, Ms, K) for _ in range(W)],
        w=[_randn(gen, N, K, scale=1 / math.sqrt(K)) for _ in range(W)],
        b=[_randn(gen, N) if bias else None for _ in range(W)],
        gy=[_randn(gen, W * Ms, N) for _ in range(W)],
    )


def _rs_data(key, W, Ms, N, K, bias):
    gen = _gen("rs", key, W, Ms, N, K, bias)
    return dict(
        x=[_randn(gen, W * Ms, K) for _ in range(W)],
        w=[_randn(gen, N, K, scale=1 / math.sqrt(K)) for _ in range(W)],
        b=[_randn(gen, N) if bias else None for _ in range(W)],
        gy=[_randn(gen, Ms, N) for _ in range(W)],
    )


def _to(t, dtype, requires_grad=False):
    if t is None:
        return None
    return t.to(device="cuda", dtype=dtype).requires_grad_(requires_grad)


def _ag_reference(d, bias):
    W = len(d["x"])
    X = [x.double().requires_grad_() for x in d["x"]]
    Wd = [w.double().requires_grad_() for w in d["w"]]
    Bd = [b.double().requires_grad_() if bias else None for b in d["b"]]
    ys, loss = [], 0
    for r in range(W):
        y = torch.cat(X) @ Wd[r].T + (Bd[r] if bias else 0)
        ys.append(y.detach())
        loss = loss + (y * d["gy"][r].double()).sum()
    loss.backward()
    return ys, [x.grad for x in X], [w.grad for w in Wd], [b.grad if bias else None for b in Bd]


def _rs_reference(d, bias):
    W = len(d["x"])
    Ms = d["gy"][0].shape[0]
    X = [x.double().requires_grad_() for x in d["x"]]
    Wd = [w.double().requires_grad_() for w in d["w"]]
    Bd = [b.double().requires_grad_() if bias else None for b in d["b"]]
    total = sum(X[r] @ Wd[r].T for r in range(W))
    ys, loss = [], 0
    for r in range(W):
        y = total[r * Ms : (r + 1) * Ms] + (Bd[r] if bias else 0)
        ys.append(y.detach())
        loss = loss + (y * d["gy"][r].double()).sum()
    loss.backward()
    return ys, [x.grad for x in X], [w.grad for w in Wd], [b.grad if bias else None for b in Bd]


def _run(op, d, dtype, mode, backward, delayed=None):
    W = len(d["x"])
    fn_op = all_gather_matmul if op == "ag" else matmul_reduce_scatter

    def fn(world):
        r = world.rank
        world.wait_budget = WAIT_NS
        x = _to(d["x"][r], dtype, backward)
        w = _to(d["w"][r], dtype, backward)
        b = _to(d["b"][r], dtype, backward)
        if delayed is not None and r == delayed:
            torch.cuda._sleep(SLEEP_CYCLES)  # this rank's producers start late
        y = fn_op(x, w, world, b)
        if backward:
            if delayed is not None and r == (delayed + 1) % W:
                torch.cuda._sleep(SLEEP_CYCLES)  # and in backward another rank is late
            y.backward(_to(d["gy"][r], dtype))
        world.check()
        grads = (x.grad, w.grad, None if b is None else b.grad) if backward else (None,) * 3
        return (y.detach(), *grads)

    return spawn(W, fn, device="cuda", mode=mode)


def _check(outs, ref, dtype, backward, bias, what):
    ys, gxs, gws, gbs = ref
    for r, (y, gx, gw, gb) in enumerate(outs):
        assert_close(y, ys[r], dtype=dtype, name=f"{what} y rank {r}")
        if backward:
            assert_close(gx, gxs[r], dtype=dtype, name=f"{what} dx rank {r}")
            assert_close(gw, gws[r], dtype=dtype, name=f"{what} dw rank {r}")
            if bias:
                assert_close(gb, gbs[r], dtype=dtype, name=f"{what} db rank {r}")


# ---------------------------------------------------------------------------- sequential mode
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "W,Ms,N,K,bias",
    [
        (1, 200, 300, 520, True),
        (2, 200, 300, 520, False),
        (4, 77, 1000, 136, True),
        (3, 129, 2100, 264, False),
    ],
)
def test_sequential_forward(op, W, Ms, N, K, bias):
    d = (_ag_data if op == "ag" else _rs_data)("seq", W, Ms, N, K, bias)
    ref = (_ag_reference if op == "ag" else _rs_reference)(d, bias)
    outs = _run(op, d, BF16, "sequential", backward=False)
    _check(outs, ref, BF16, False, bias, op)


# ---------------------------------------------------------------------------- concurrent mode
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("W,delayed", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_concurrent_delayed_producer_forward_backward(op, W, delayed, bias):
    Ms, N, K = 300, 520, 264
    d = (_ag_data if op == "ag" else _rs_data)("conc", W, Ms, N, K, bias)
    ref = (_ag_reference if op == "ag" else _rs_reference)(d, bias)
    outs = _run(op, d, BF16, "concurrent", backward=True, delayed=delayed)
    _check(outs, ref, BF16, True, bias, op)


@pytest.mark.parametrize(
    "op,W,Ms,N,K",
    [("ag", 2, 64, 96, 64), ("rs", 2, 64, 64, 32), ("ag", 4, 32, 48, 64), ("rs", 4, 32, 64, 16)],
)
def test_concurrent_backward_short_shards(op, W, Ms, N, K):
    """The hybrid block's attention shapes (BM 64, K below BK): with the gathered input saved
    for the weight gradient, the forward GEMM came out wrong on the H200 while the A tile fed to
    tl.dot was also stored (2026-12-03); the save is now a load pass of its own."""
    d = (_ag_data if op == "ag" else _rs_data)("short", W, Ms, N, K, False)
    ref = (_ag_reference if op == "ag" else _rs_reference)(d, False)
    outs = _run(op, d, BF16, "concurrent", backward=True, delayed=W - 1)
    _check(outs, ref, BF16, True, False, op)


def test_concurrent_back_to_back_with_rotating_delays():
    """Ready epochs under real concurrency: each call delays another rank, alternating ops
    and shapes, so a producer that ran ahead must wait for its peer's previous op."""
    W = 4
    shapes = [(130, 300, 200), (64, 256, 128), (257, 520, 72)]
    ag = [_ag_data("b2b", W, *s, False) for s in shapes]
    rs = [_rs_data("b2b", W, *s, False) for s in shapes]

    def fn(world):
        r = world.rank
        world.wait_budget = WAIT_NS
        out = []
        for it in range(6):
            da, dr = ag[it % 3], rs[it % 3]
            if r == it % W:
                torch.cuda._sleep(SLEEP_CYCLES // 4)
            ya = all_gather_matmul(_to(da["x"][r], BF16), _to(da["w"][r], BF16), world)
            if r == (it + 1) % W:
                torch.cuda._sleep(SLEEP_CYCLES // 4)
            yr = matmul_reduce_scatter(_to(dr["x"][r], BF16), _to(dr["w"][r], BF16), world)
            out.append((ya, yr))
        world.check()
        return out

    outs = spawn(W, fn, device="cuda", mode="concurrent")
    for it in range(6):
        ya_ref = _ag_reference(ag[it % 3], False)[0]
        yr_ref = _rs_reference(rs[it % 3], False)[0]
        for r in range(W):
            assert_close(outs[r][it][0], ya_ref[r], dtype=BF16, name=f"ag call {it} rank {r}")
            assert_close(outs[r][it][1], yr_ref[r], dtype=BF16, name=f"rs call {it} rank {r}")


def test_concurrent_large_shapes():
    """Many tiles per rank (persistent loop, many copy chunks), W=2."""
    W, Ms, N, K = 2, 2048, 2048, 1024
    d = _ag_data("large", W, Ms, N, K, False)
    ref = _ag_reference(d, False)
    outs = _run("ag", d, BF16, "concurrent", backward=False, delayed=1)
    _check(outs, ref, BF16, False, False, "ag")
    d = _rs_data("large", W, Ms, N, K, False)
    ref = _rs_reference(d, False)
    outs = _run("rs", d, BF16, "concurrent", backward=False, delayed=0)
    _check(outs, ref, BF16, False, False, "rs")


# ---------------------------------------------------------------------------- one rank
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_local_world_forward_backward(op, dtype):
    d = (_ag_data if op == "ag" else _rs_data)("local", 1, 333, 250, 190, True)
    ref = (_ag_reference if op == "ag" else _rs_reference)(d, True)
    world = local_world("cuda")
    x, w, b = (_to(d[k][0], dtype, True) for k in ("x", "w", "b"))
    y = (all_gather_matmul if op == "ag" else matmul_reduce_scatter)(x, w, world, b)
    y.backward(_to(d["gy"][0], dtype))
    world.check()
    _check([(y.detach(), x.grad, w.grad, b.grad)], ref, dtype, True, True, op)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_weight_spanning_more_than_2_to_the_31_elements(op):
    """The compiled kernels address a weight whose element offsets pass 2**31 (a 256k x 12288
    LM head at one rank) in int64 (``W64``); with int32 offsets its third row wraps around to
    an illegal address or wrong rows. Three rows of a view with a row stride of 2**30 + 64
    stand for it (a 4 GiB allocation, only those rows touched), forward and backward."""
    from moe_overlap.kernels.ag_matmul import needs_int64

    S, N, K = 2**30 + 64, 3, 64
    base = torch.empty(2 * S + K, dtype=BF16, device="cuda")
    w = base.as_strided((N, K), (S, 1))
    assert needs_int64(w)
    gen = _gen("span-gpu", op)
    w_ref = _randn(gen, N, K).to(BF16)
    with torch.no_grad():
        for i in range(N):
            w[i].copy_(w_ref[i])
    x_ref = _randn(gen, 37, K).to(BF16)
    dy_ref = _randn(gen, 37, N).to(BF16)
    x = x_ref.cuda().requires_grad_(True)
    fn = all_gather_matmul if op == "ag" else matmul_reduce_scatter
    y = fn(x, w, local_world("cuda"))
    y.backward(dy_ref.cuda())
    torch.cuda.synchronize()
    assert_close(y.cpu(), x_ref.double() @ w_ref.double().t(), dtype=BF16)
    assert_close(x.grad.cpu(), dy_ref.double() @ w_ref.double(), dtype=BF16, name="dx")
    del base, w


# ---------------------------------------------------------------------------- MLP
@pytest.mark.parametrize("W", [2, 4])
def test_sequence_parallel_mlp_concurrent(W):
    S, B, H, Fdim = 64 * W, 3, 256, 128 * W
    gen = _gen("mlp", W)
    w1 = _randn(gen, Fdim, H, scale=1 / math.sqrt(H))
    w2 = _randn(gen, H, Fdim, scale=1 / math.sqrt(Fdim))
    b1, b2 = _randn(gen, Fdim), _randn(gen, H)
    x_full, g_full = _randn(gen, S, B, H), _randn(gen, S, B, H)
    s, f = S // W, Fdim // W

    def fn(world):
        r = world.rank
        world.wait_budget = WAIT_NS
        col = ColumnParallelLinear.from_full(w1.to(BF16), world, b1.to(BF16))
        row = RowParallelLinear.from_full(w2.to(BF16), world, b2.to(BF16))
        x = _to(x_full[r * s : (r + 1) * s], BF16, True)
        if r == W - 1:
            torch.cuda._sleep(SLEEP_CYCLES)
        out = row(F.gelu(col(x)))
        out.backward(_to(g_full[r * s : (r + 1) * s], BF16))
        sync_sequence_parallel_grads(row)
        world.check()
        return out.detach(), x.grad, col.weight.grad, row.weight.grad, row.bias.grad

    outs = spawn(W, fn, device="cuda", mode="concurrent")
    X = x_full.double().requires_grad_()
    W1, W2, B1, B2 = (t.double().requires_grad_() for t in (w1, w2, b1, b2))
    ref = F.linear(F.gelu(F.linear(X, W1, B1)), W2, B2)
    (ref * g_full.double()).sum().backward()
    for r, (out, gx, gw1, gw2, gb2) in enumerate(outs):
        rows = slice(r * s, (r + 1) * s)
        assert_close(out, ref[rows], dtype=BF16, name=f"out rank {r}")
        assert_close(gx, X.grad[rows], dtype=BF16, name=f"dx rank {r}")
        assert_close(gw1, W1.grad[r * f : (r + 1) * f], dtype=BF16, name=f"dw1 rank {r}")
        assert_close(gw2, W2.grad[:, r * f : (r + 1) * f], dtype=BF16, name=f"dw2 rank {r}")
        assert_close(gb2, B2.grad, dtype=BF16, name=f"db2 rank {r}")
