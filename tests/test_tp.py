"""CPU tests of dense TP: all_gather_matmul, matmul_reduce_scatter, Column/RowParallelLinear.

Emulated worlds (threads) on the Triton interpreter, fp32, against float64 autograd references.
Shapes are tiny and odd (the interpreter is slow and the blocks are 16x32x32): cases are chosen
pairwise over world size, shape class and bias rather than as a full product.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from moe_overlap import CommTimeoutError
from moe_overlap.testing import assert_close, spawn
from moe_overlap.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_matmul,
    matmul_reduce_scatter,
    sync_sequence_parallel_grads,
)
from moe_overlap.world import ROLE_CONSUMER, interpreted, launch_lock, local_world

pytestmark = pytest.mark.skipif(
    not interpreted(), reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py)"
)

F32 = torch.float32


def _gen(*key) -> torch.Generator:
    # crc32, not hash(): str hashes change per process and the data must be reproducible.
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _poison_workspace(world):
    """NaN-fill this rank's shared workspace (0xFF bytes are NaN in every float dtype), so a
    chunk or partial that never arrives shows. Safe before an op: peers may only write into it
    after this rank publishes its ready epoch in ``begin_op``."""
    world.workspace(1).local.fill_(255)


def _grads_for(mode):
    return {"all": (True, True, True), "x": (True, False, False), "w": (False, True, True)}[mode]


# ---------------------------------------------------------------------------- all_gather_matmul
AG_CASES = [
    # W, Ms, N, K, bias, grads
    (1, 5, 11, 13, False, "all"),
    (2, 5, 11, 13, True, "all"),
    (3, 17, 37, 45, False, "all"),
    (4, 3, 7, 9, True, "all"),
    (2, 1, 1, 1, True, "w"),
    (3, 16, 32, 32, True, "x"),
    (2, 17, 40, 13, False, "w"),
]


@pytest.mark.parametrize("W,Ms,N,K,bias,grads", AG_CASES)
def test_all_gather_matmul_forward_backward(W, Ms, N, K, bias, grads):
    gen = _gen("ag", W, Ms, N, K, bias)
    M = W * Ms
    xs = [_randn(gen, Ms, K) for _ in range(W)]
    ws = [_randn(gen, N, K, scale=1 / math.sqrt(K)) for _ in range(W)]
    bs = [_randn(gen, N) if bias else None for _ in range(W)]
    gys = [_randn(gen, M, N) for _ in range(W)]
    need_x, need_w, need_b = _grads_for(grads)

    def fn(world):
        r = world.rank
        _poison_workspace(world)
        x = xs[r].clone().requires_grad_(need_x)
        w = ws[r].clone().requires_grad_(need_w)
        b = bs[r].clone().requires_grad_(need_b) if bias else None
        y = all_gather_matmul(x, w, world, b)
        y.backward(gys[r])
        return y.detach(), x.grad, w.grad, None if b is None else b.grad

    outs = spawn(W, fn)

    X = [x.double().requires_grad_() for x in xs]
    Wd = [w.double().requires_grad_() for w in ws]
    Bd = [b.double().requires_grad_() if bias else None for b in bs]
    loss = 0
    for r in range(W):
        y_ref = torch.cat(X) @ Wd[r].T + (Bd[r] if bias else 0)
        assert_close(outs[r][0], y_ref, dtype=F32, name=f"y rank {r}")
        loss = loss + (y_ref * gys[r].double()).sum()
    loss.backward()
    for r in range(W):
        y, gx, gw, gb = outs[r]
        if need_x:
            assert_close(gx, X[r].grad, dtype=F32, name=f"dx rank {r}")
        else:
            assert gx is None
        if need_w:
            assert_close(gw, Wd[r].grad, dtype=F32, name=f"dw rank {r}")
        else:
            assert gw is None
        if bias and need_b:
            assert_close(gb, Bd[r].grad, dtype=F32, name=f"db rank {r}")


# ---------------------------------------------------------------------------- matmul_reduce_scatter
RS_CASES = [
    # W, Ms, N, K, bias, grads
    (1, 5, 11, 13, True, "all"),
    (2, 5, 11, 13, False, "all"),
    (3, 17, 37, 45, True, "all"),
    (4, 3, 7, 9, False, "all"),
    (2, 1, 1, 1, False, "x"),
    (3, 16, 32, 32, False, "w"),
    (4, 5, 33, 20, True, "w"),
]


@pytest.mark.parametrize("W,Ms,N,K,bias,grads", RS_CASES)
def test_matmul_reduce_scatter_forward_backward(W, Ms, N, K, bias, grads):
    gen = _gen("rs", W, Ms, N, K, bias)
    M = W * Ms
    xs = [_randn(gen, M, K) for _ in range(W)]
    ws = [_randn(gen, N, K, scale=1 / math.sqrt(K)) for _ in range(W)]
    bs = [_randn(gen, N) if bias else None for _ in range(W)]
    gys = [_randn(gen, Ms, N) for _ in range(W)]
    need_x, need_w, need_b = _grads_for(grads)

    def fn(world):
        r = world.rank
        _poison_workspace(world)
        x = xs[r].clone().requires_grad_(need_x)
        w = ws[r].clone().requires_grad_(need_w)
        b = bs[r].clone().requires_grad_(need_b) if bias else None
        y = matmul_reduce_scatter(x, w, world, b)
        y.backward(gys[r])
        return y.detach(), x.grad, w.grad, None if b is None else b.grad

    outs = spawn(W, fn)

    X = [x.double().requires_grad_() for x in xs]
    Wd = [w.double().requires_grad_() for w in ws]
    Bd = [b.double().requires_grad_() if bias else None for b in bs]
    total = sum(X[r] @ Wd[r].T for r in range(W))
    loss = 0
    for r in range(W):
        y_ref = total[r * Ms : (r + 1) * Ms] + (Bd[r] if bias else 0)
        assert_close(outs[r][0], y_ref, dtype=F32, name=f"y rank {r}")
        loss = loss + (y_ref * gys[r].double()).sum()
    loss.backward()
    for r in range(W):
        y, gx, gw, gb = outs[r]
        if need_x:
            assert_close(gx, X[r].grad, dtype=F32, name=f"dx rank {r}")
        else:
            assert gx is None
        if need_w:
            assert_close(gw, Wd[r].grad, dtype=F32, name=f"dw rank {r}")
        else:
            assert gw is None
        if bias and need_b:
            assert_close(gb, Bd[r].grad, dtype=F32, name=f"db rank {r}")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bf16(op):
    """bf16 in the interpreter (its bf16 ``tl.dot`` is fixed in ``kernels/launch.py``)."""
    W, Ms, N, K = 2, 5, 24, 40
    gen = _gen("bf16", op)
    xs = [_randn(gen, Ms if op == "ag" else W * Ms, K).bfloat16() for _ in range(W)]
    ws = [_randn(gen, N, K, scale=1 / math.sqrt(K)).bfloat16() for _ in range(W)]
    fused = all_gather_matmul if op == "ag" else matmul_reduce_scatter

    def fn(world):
        x = xs[world.rank].clone().requires_grad_()
        w = ws[world.rank].clone().requires_grad_()
        y = fused(x, w, world)
        y.float().square().sum().backward()
        return y.detach(), x.grad, w.grad

    outs = spawn(W, fn)
    X = [x.double().requires_grad_() for x in xs]
    Wd = [w.double().requires_grad_() for w in ws]
    if op == "ag":
        ys = [torch.cat(X) @ Wd[r].T for r in range(W)]
    else:
        full = sum(X[r] @ Wd[r].T for r in range(W))
        ys = list(full.split(Ms))
    sum(y.square().sum() for y in ys).backward()
    for r, (y, gx, gw) in enumerate(outs):
        assert y.dtype == torch.bfloat16
        assert_close(y, ys[r], dtype=torch.bfloat16, name=f"y rank {r}")
        assert_close(gx, X[r].grad, dtype=torch.bfloat16, name=f"dx rank {r}")
        assert_close(gw, Wd[r].grad, dtype=torch.bfloat16, name=f"dw rank {r}")


def test_reduce_scatter_is_deterministic():
    gen = _gen("det")
    W, M, N, K = 3, 9, 21, 40
    xs = [_randn(gen, M, K) for _ in range(W)]
    ws = [_randn(gen, N, K) for _ in range(W)]

    def fn(world):
        return [matmul_reduce_scatter(xs[world.rank], ws[world.rank], world) for _ in range(2)]

    for a, b in spawn(W, fn):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- back to back
def test_back_to_back_ops_with_workspace_growth():
    """Alternating ops and shapes on one world: ready epochs, flag resets and workspace growth
    between calls. Every op's workspace is poisoned first, so stale data cannot pass."""
    W = 3
    gen = _gen("b2b")
    shapes = [(4, 9, 7), (6, 70, 50), (2, 5, 3)]  # (Ms, N, K); the second grows the workspace
    data = []
    for Ms, N, K in shapes:
        data.append(
            dict(
                ag_x=[_randn(gen, Ms, K) for _ in range(W)],
                rs_x=[_randn(gen, W * Ms, K) for _ in range(W)],
                w=[_randn(gen, N, K) for _ in range(W)],
            )
        )

    def fn(world):
        r = world.rank
        out = []
        for _ in range(2):
            for d in data:
                _poison_workspace(world)
                ag = all_gather_matmul(d["ag_x"][r], d["w"][r], world)
                _poison_workspace(world)
                rs = matmul_reduce_scatter(d["rs_x"][r], d["w"][r], world)
                out.append((ag, rs))
        return out

    outs = spawn(W, fn)
    for r in range(W):
        for it in range(2 * len(shapes)):
            d = data[it % len(shapes)]
            Ms = shapes[it % len(shapes)][0]
            ag_ref = torch.cat(d["ag_x"]).double() @ d["w"][r].double().T
            total = sum(d["rs_x"][s].double() @ d["w"][s].double().T for s in range(W))
            assert_close(outs[r][it][0], ag_ref, dtype=F32, name=f"ag rank {r} call {it}")
            assert_close(
                outs[r][it][1],
                total[r * Ms : (r + 1) * Ms],
                dtype=F32,
                name=f"rs rank {r} call {it}",
            )


def test_no_grad_and_noncontiguous_inputs():
    """Transposed weights (no copy, strides go to the kernel) and a non-contiguous x."""
    W, Ms, N, K = 2, 6, 10, 12
    gen = _gen("strides")
    xs = [_randn(gen, K, Ms) for _ in range(W)]  # used as x.t()
    wts = [_randn(gen, K, N) for _ in range(W)]  # used as w.t() -> [N, K], strides (1, N)

    def fn(world):
        r = world.rank
        with torch.no_grad():
            ag = all_gather_matmul(xs[r].t(), wts[r].t(), world)
            rs = matmul_reduce_scatter(torch.cat([xs[r].t()] * W), wts[r].t(), world)
        return ag, rs

    outs = spawn(W, fn)
    gathered = torch.cat([x.t() for x in xs]).double()
    total = sum(torch.cat([xs[s].t()] * W).double() @ wts[s].double() for s in range(W))
    for r in range(W):
        assert_close(outs[r][0], gathered @ wts[r].double(), dtype=F32)
        assert_close(outs[r][1], total[r * Ms : (r + 1) * Ms], dtype=F32)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_weight_spanning_more_than_2_to_the_31_elements(op):
    """A weight whose element offsets pass 2**31 (a 256k x 12288 LM head at one rank) is
    addressed in int64: with int32 offsets its third row wrapped around (a segfault on the
    CPU, wrong rows or an illegal address on a GPU). Three rows of a view with a row stride
    of 2**30 + 64 stand for it; only those rows of the 4 GiB allocation are ever touched."""
    from moe_overlap.kernels.ag_matmul import needs_int64

    S, N, K = 2**30 + 64, 3, 16
    base = torch.empty(2 * S + K, dtype=torch.float16)
    w = base.as_strided((N, K), (S, 1))
    assert needs_int64(w) and not needs_int64(w[:2]) and not needs_int64(w[:0])
    gen = _gen("span")
    with torch.no_grad():
        for i in range(N):
            w[i].copy_(_randn(gen, K).half())
    x = _randn(gen, 5, K).half().requires_grad_(True)
    fn = all_gather_matmul if op == "ag" else matmul_reduce_scatter
    y = fn(x, w, local_world("cpu"))
    assert_close(y, x.double() @ w.double().t(), dtype=torch.float16)
    dy = _randn(gen, 5, N).half()
    y.backward(dy)  # the dgrad is the other op with w.t(): the same span, transposed
    assert_close(x.grad, dy.double() @ w.double(), dtype=torch.float16, name="dx")


# ---------------------------------------------------------------------------- bad input
def test_rows_not_divisible_by_world_size():
    def fn(world):
        x = torch.randn(7, 4)
        w = torch.randn(3, 4)
        with pytest.raises(ValueError, match="not a multiple of world_size 2"):
            matmul_reduce_scatter(x, w, world)
        return True

    assert spawn(2, fn) == [True, True]


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ranks_with_different_sizes_raise_on_every_rank(op):
    """Rank 0 with 5 rows and rank 1 with 6 used to return [10, N] and [12, N] (the gathered
    rows written past each other's offsets) with no error. Every rank raises before any
    launch, also after calls whose sizes agreed (every call exchanges its sizes)."""
    W = 2
    fn_ = all_gather_matmul if op == "ag" else matmul_reduce_scatter

    def fn(world):
        # a K (rs) or N (ag) of each rank's own may differ: that is this rank's shard
        own = dict(ag=(torch.randn(4, 8), torch.randn(3 + world.rank, 8)))
        own["rs"] = (torch.randn(4, 8 + world.rank), torch.randn(6, 8 + world.rank))
        for _ in range(2):
            fn_(*own[op], world)
        rows = 2 * (5 + world.rank) if op == "rs" else 5 + world.rank
        with pytest.raises(ValueError, match="disagree on (rows|M)") as ei:
            fn_(torch.randn(rows, 8), torch.randn(6, 8), world)
        msg = str(ei.value)
        assert "rank 0:" in msg and "rank 1:" in msg and "dtype" not in msg, msg
        with pytest.raises(ValueError, match="disagree on dtype") as ei:
            x = torch.randn(4, 8).to(torch.float16 if world.rank else torch.float32)
            fn_(x, torch.randn(6, 8).to(x.dtype), world)
        assert "float16" in str(ei.value) and "float32" in str(ei.value)
        return True

    assert spawn(W, fn) == [True] * W


def test_ranks_in_different_ops_raise_on_every_rank():
    """The op's name travels with the sizes: ranks that call different ops at the same point
    fail together instead of pairing one op's exchange with the other's."""

    def fn(world):
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        with pytest.raises(ValueError, match="not all in this op"):
            (all_gather_matmul if world.rank == 0 else matmul_reduce_scatter)(x, w, world)
        return True

    assert spawn(2, fn) == [True, True]


def test_real_worlds_check_sizes_only_when_asked(monkeypatch):
    """Each check is a host all-gather and sync: real (multi-process) worlds skip it unless
    MOE_OVERLAP_CHECK_SIZES=1 or MOE_OVERLAP_DEBUG=1; emulated worlds always check."""
    from moe_overlap.world.base import World

    world = local_world("cpu")
    assert world.checks_sizes
    monkeypatch.setenv("MOE_OVERLAP_CHECK_SIZES", "0")
    assert not world.checks_sizes
    assert World.checks_sizes.fget(world) is False  # the real worlds' rule, debug off
    monkeypatch.setenv("MOE_OVERLAP_CHECK_SIZES", "1")
    assert World.checks_sizes.fget(world) is True


@pytest.mark.parametrize(
    "op,x,w,b,err,match",
    [
        ("ag", torch.randn(4, 3).int(), torch.randn(5, 3).int(), None, TypeError, "float32"),
        ("rs", torch.randn(4, 3), torch.randn(5, 3).half(), None, TypeError, "weight dtype"),
        ("ag", torch.randn(4, 3), torch.randn(5, 4), None, ValueError, "K mismatch"),
        ("rs", torch.randn(4, 3), torch.randn(5, 4), None, ValueError, "K mismatch"),
        ("ag", torch.randn(4), torch.randn(5, 4), None, ValueError, "2-D"),
        ("rs", torch.randn(4, 3), torch.randn(2, 5, 3), None, ValueError, "2-D"),
        ("ag", torch.randn(4, 3), torch.randn(5, 3), torch.randn(4), ValueError, "bias"),
        ("rs", torch.randn(4, 3), torch.randn(5, 3), torch.randn(5).half(), TypeError, "bias"),
        ("ag", torch.randn(4, 3, device="meta"), torch.randn(5, 3), None, ValueError, "meta"),
        ("rs", torch.randn(4, 3), torch.randn(5, 3, device="meta"), None, ValueError, "meta"),
        ("ag", [[1.0]], torch.randn(5, 3), None, TypeError, "x_shard"),
    ],
)
def test_bad_input_raises_before_launch(op, x, w, b, err, match):
    world = local_world("cpu")
    fn = all_gather_matmul if op == "ag" else matmul_reduce_scatter
    with pytest.raises(err, match=match):
        fn(x, w, world, b)


def test_bad_world_raises():
    with pytest.raises(TypeError, match="World"):
        all_gather_matmul(torch.randn(2, 3), torch.randn(4, 3), "not a world")


def test_pinned_config(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_TP_CONFIG", "32,16,16,1,1")
    gen = _gen("pin")
    W, Ms, N, K = 2, 35, 20, 18
    xs = [_randn(gen, Ms, K) for _ in range(W)]
    ws = [_randn(gen, N, K) for _ in range(W)]
    outs = spawn(W, lambda world: all_gather_matmul(xs[world.rank], ws[world.rank], world))
    for r in range(W):
        assert_close(outs[r], torch.cat(xs).double() @ ws[r].double().T, dtype=F32)
    monkeypatch.setenv("MOE_OVERLAP_TP_CONFIG", "32,16")
    with pytest.raises(ValueError, match="MOE_OVERLAP_TP_CONFIG"):
        all_gather_matmul(xs[0], ws[0], local_world("cpu"))
    monkeypatch.setenv("MOE_OVERLAP_TP_CONFIG", "24,16,16,1,1")
    with pytest.raises(ValueError, match="power of two"):
        all_gather_matmul(xs[0], ws[0], local_world("cpu"))


# ---------------------------------------------------------------------------- timeouts
def _skip_producers_on(rank_to_skip):
    def patch(world):
        if world.rank != rank_to_skip:
            return

        def run_fused_without_producers(launch):
            world.barrier()
            world.barrier()
            with launch_lock():
                launch(ROLE_CONSUMER)

        world.run_fused = run_fused_without_producers

    return patch


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_missing_producer_times_out_with_nan_and_error(op):
    """Rank 1 never produces: rank 0's waits give up, its affected tiles are NaN, and the
    host raises CommTimeoutError naming the stage (6 AG, 7 RS)."""
    W, Ms, N, K = 2, 5, 9, 7
    patch = _skip_producers_on(1)

    def fn(world):
        world.wait_budget = 5
        patch(world)
        world.end_op = lambda: None  # inspect the output before raising
        x = torch.randn(Ms if op == "ag" else W * Ms, K)
        w = torch.randn(N, K)
        y = (all_gather_matmul if op == "ag" else matmul_reduce_scatter)(x, w, world)
        try:
            world.check()
        except CommTimeoutError as e:
            return y, e
        return y, None

    outs = spawn(W, fn)
    y0, e0 = outs[0]
    assert isinstance(e0, CommTimeoutError)
    assert e0.rank == 0 and e0.stage == (6 if op == "ag" else 7)
    assert "timed out" in str(e0)
    if op == "ag":
        assert torch.isfinite(y0[:Ms]).all()  # own block needs no wait
        assert torch.isnan(y0[Ms:]).all()
    else:
        assert torch.isnan(y0).all()


# ---------------------------------------------------------------------------- parallel linears
def _full_mlp(H, Fdim, gen, bias):
    w1 = _randn(gen, Fdim, H, scale=1 / math.sqrt(H))
    w2 = _randn(gen, H, Fdim, scale=1 / math.sqrt(Fdim))
    b1 = _randn(gen, Fdim) if bias else None
    b2 = _randn(gen, H) if bias else None
    return w1, b1, w2, b2


@pytest.mark.parametrize("W,bias", [(2, True), (3, False), (4, True)])
def test_sequence_parallel_mlp_matches_full(W, bias):
    """Column(gather) -> gelu -> Row(scatter) on sequence shards == the unsharded MLP."""
    S, B, H = 3 * W, 2, 10
    Fdim = 4 * W
    gen = _gen("mlp", W, bias)
    w1, b1, w2, b2 = _full_mlp(H, Fdim, gen, bias)
    x_full = _randn(gen, S, B, H)
    g_full = _randn(gen, S, B, H)
    s = S // W

    def fn(world):
        r = world.rank
        col = ColumnParallelLinear.from_full(w1, world, b1)
        row = RowParallelLinear.from_full(w2, world, b2)
        x = x_full[r * s : (r + 1) * s].clone().requires_grad_()
        h = col(x)
        assert h.shape == (S, B, Fdim // W)
        out = row(F.gelu(h))
        assert out.shape == (s, B, H)
        out.backward(g_full[r * s : (r + 1) * s])
        n = sync_sequence_parallel_grads(row)
        assert n == (1 if bias else 0)
        return (
            out.detach(),
            x.grad,
            col.weight.grad,
            row.weight.grad,
            col.bias.grad if bias else None,
            row.bias.grad if bias else None,
        )

    outs = spawn(W, fn)

    X = x_full.double().requires_grad_()
    W1, W2 = w1.double().requires_grad_(), w2.double().requires_grad_()
    B1 = b1.double().requires_grad_() if bias else None
    B2 = b2.double().requires_grad_() if bias else None
    ref = F.linear(F.gelu(F.linear(X, W1, B1)), W2, B2)
    (ref * g_full.double()).sum().backward()
    f = Fdim // W
    for r, (out, gx, gw1, gw2, gb1, gb2) in enumerate(outs):
        rows = slice(r * s, (r + 1) * s)
        assert_close(out, ref[rows], dtype=F32, name=f"out rank {r}")
        assert_close(gx, X.grad[rows], dtype=F32, name=f"dx rank {r}")
        assert_close(gw1, W1.grad[r * f : (r + 1) * f], dtype=F32, name=f"dw1 rank {r}")
        assert_close(gw2, W2.grad[:, r * f : (r + 1) * f], dtype=F32, name=f"dw2 rank {r}")
        if bias:
            assert_close(gb1, B1.grad[r * f : (r + 1) * f], dtype=F32, name=f"db1 rank {r}")
            assert_close(gb2, B2.grad, dtype=F32, name=f"db2 rank {r}")


def test_tensor_parallel_mlp_without_sequence_parallel():
    """Column(gather_input=False) -> Row(scatter_output=False): replicated input and output."""
    W, S, H, Fdim = 2, 5, 7, 6
    gen = _gen("mlp-nosp")
    w1, b1, w2, b2 = _full_mlp(H, Fdim, gen, True)
    x_full = _randn(gen, S, H)
    g_full = _randn(gen, S, H)

    def fn(world):
        col = ColumnParallelLinear.from_full(w1, world, b1, gather_input=False)
        row = RowParallelLinear.from_full(w2, world, b2, scatter_output=False)
        x = x_full.clone().requires_grad_()
        out = row(torch.tanh(col(x)))
        out.backward(g_full)
        assert sync_sequence_parallel_grads(row) == 0
        return out.detach(), x.grad, col.weight.grad, row.weight.grad, row.bias.grad

    outs = spawn(W, fn)
    X = x_full.double().requires_grad_()
    W1, W2, B1, B2 = (t.double().requires_grad_() for t in (w1, w2, b1, b2))
    ref = F.linear(torch.tanh(F.linear(X, W1, B1)), W2, B2)
    (ref * g_full.double()).sum().backward()
    f = Fdim // W
    for r, (out, gx, gw1, gw2, gb2) in enumerate(outs):
        assert_close(out, ref, dtype=F32)
        assert_close(gx, X.grad, dtype=F32)
        assert_close(gw1, W1.grad[r * f : (r + 1) * f], dtype=F32)
        assert_close(gw2, W2.grad[:, r * f : (r + 1) * f], dtype=F32)
        assert_close(gb2, B2.grad, dtype=F32)


def test_layers_built_without_a_world_share_the_default_one():
    """TP linears and MoE layers built without a world take one process-wide world (one
    workspace), not one each."""
    from moe_overlap import MoEConfig, MoELayer
    from moe_overlap.world import default_world

    col, row = ColumnParallelLinear(16, 16), RowParallelLinear(16, 16)
    moe = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2))
    assert col.world is row.world is moe.world is default_world()


def test_parallel_linear_construction_and_errors():
    def fn(world):
        with pytest.raises(ValueError, match="out_features 5"):
            ColumnParallelLinear(4, 5, world)
        with pytest.raises(ValueError, match="in_features 3"):
            RowParallelLinear(3, 4, world)
        with pytest.raises(TypeError, match="World"):
            ColumnParallelLinear(4, 4, world="w")
        col = ColumnParallelLinear(6, 4, world, bias=True)
        row = RowParallelLinear(4, 6, world, bias=True)
        assert col.weight.shape == (2, 6) and col.bias.shape == (2,)
        assert row.weight.shape == (6, 2) and row.bias.shape == (6,)
        assert row.bias.sequence_parallel
        assert (row.bias == 0).all() and col.weight.abs().max() <= 1 / math.sqrt(6)
        with pytest.raises(ValueError, match="features"):
            col(torch.randn(3, 5))
        with pytest.raises(ValueError, match="multiple of world_size"):
            row(torch.randn(3, 2))
        # the unfused paths refuse what the fused ones refuse, before any collective
        plain_col = ColumnParallelLinear(6, 4, world, gather_input=False)
        plain_row = RowParallelLinear(4, 6, world, scatter_output=False)
        for layer, k in ((col, 6), (row, 2), (plain_col, 6), (plain_row, 2)):
            with pytest.raises(TypeError, match="dtype"):
                layer(torch.randn(4, k, dtype=torch.float16))
        with pytest.raises(ValueError, match="meta"):
            plain_row(torch.randn(4, 2, device="meta"))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts x itself
            assert plain_col(torch.randn(4, 6)).dtype == torch.bfloat16
        with pytest.raises(TypeError, match="bias_full must be a tensor"):
            ColumnParallelLinear.from_full(torch.randn(4, 4), world, bias_full=[0.0] * 4)
        with pytest.raises(TypeError, match="floating"):
            RowParallelLinear.from_full(torch.ones(4, 4, dtype=torch.int64), world)
        return col.weight.detach().clone()

    w0, w1 = spawn(2, fn)
    assert not torch.equal(w0, w1)  # shards are drawn from per-rank streams


def test_copy_programs_knob_is_checked(monkeypatch):
    from moe_overlap.kernels import ag_matmul

    for bad in ("-1", "two"):
        monkeypatch.setenv("MOE_OVERLAP_TP_COPY_PROGRAMS", bad)
        with pytest.raises(ValueError, match="MOE_OVERLAP_TP_COPY_PROGRAMS"):
            ag_matmul._copy_programs()
    monkeypatch.setenv("MOE_OVERLAP_TP_COPY_PROGRAMS", "3")
    assert ag_matmul._copy_programs() == 3
    monkeypatch.delenv("MOE_OVERLAP_TP_COPY_PROGRAMS")
    assert ag_matmul._copy_programs() == 0
