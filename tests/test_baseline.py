"""``baseline_experts`` on emulated worlds against ``reference.experts`` (forward and backward).

Each rank holds LOCAL expert weights that are slices of one GLOBAL set; the reference runs every
rank's tokens through the global weights with float64 autograd, so a local weight gradient must
equal its slice of the global gradient (it collects every rank's tokens).
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import reference as ref
from moe_overlap.config import ACTIVATIONS, w1_rows
from moe_overlap.dispatch.baseline import baseline_experts
from moe_overlap.testing import assert_close, randn, spawn

f64 = torch.float64
E, H, FF = 12, 7, 5  # E divisible by every W tested; odd H and F
TOKENS = {1: [6], 2: [9, 0], 3: [5, 0, 8], 4: [4, 9, 0, 3]}


def _problem(W, K, routing, activation, bias, dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed * 131 + W * 7 + K)
    rows = w1_rows(activation, FF)
    glob = dict(
        w1=randn((E, rows, H), dtype, generator=g, scale=0.5),
        w2=randn((E, H, FF), dtype, generator=g, scale=0.5),
        b1=randn((E, rows), dtype, generator=g) if bias else None,
        b2=randn((E, H), dtype, generator=g) if bias else None,
    )
    per_rank = []
    for T in TOKENS[W]:
        x = randn((T, H), dtype, generator=g)
        if routing == "random":  # distinct experts per token, some dropped
            ids = torch.zeros((T, K), dtype=torch.int64)
            for t in range(T):
                ids[t] = torch.randperm(E, generator=g)[:K]
            ids[torch.rand(T, K, generator=g) < 0.2] = -1
        elif routing == "one_expert":  # every token's first choice is the last expert
            ids = torch.full((T, K), -1, dtype=torch.int64)
            ids[:, 0] = E - 1
        else:  # "all_dropped_but_one": rank's tokens all -1 except token 0 on expert 0
            ids = torch.full((T, K), -1, dtype=torch.int64)
            if T:
                ids[0, 0] = 0
        wts = randn((T, K), dtype, generator=g)
        gy = randn((T, H), dtype, generator=g)  # upstream gradient
        per_rank.append((x, ids, wts, gy))
    return glob, per_rank


def _run_baseline(W, glob, per_rank, activation, dtype_cast=None):
    El = E // W

    def fn(world):
        r = world.rank
        x, ids, wts, gy = per_rank[r]
        sl = slice(r * El, (r + 1) * El)
        leaf = {k: (None if v is None else v[sl].clone().requires_grad_()) for k, v in glob.items()}
        x = x.clone().requires_grad_()
        wts = wts.clone().requires_grad_()
        y = baseline_experts(
            x, ids, wts, leaf["w1"], leaf["w2"], world, activation, leaf["b1"], leaf["b2"]
        )
        (y * gy).sum().backward()
        grads = {k: (None if v is None else v.grad) for k, v in leaf.items()}
        return y.detach(), x.grad, wts.grad, grads

    return spawn(W, fn)


def _run_reference(glob, per_rank, activation):
    leaf = {k: (None if v is None else v.clone().requires_grad_()) for k, v in glob.items()}
    outs, loss = [], 0
    xs, ws = [], []
    for x, ids, wts, gy in per_rank:
        x = x.clone().requires_grad_()
        wts = wts.clone().requires_grad_()
        y = ref.experts(x, ids, wts, leaf["w1"], leaf["w2"], activation, leaf["b1"], leaf["b2"])
        loss = loss + (y * gy).sum()
        outs.append(y.detach())
        xs.append(x)
        ws.append(wts)
    loss.backward()
    grads = {k: (None if v is None else v.grad) for k, v in leaf.items()}
    return outs, [x.grad for x in xs], [w.grad for w in ws], grads


def _compare(W, got, want, tol):
    El = E // W
    outs, xg, wg, gglob = want
    for r, (y, gx, gw, gloc) in enumerate(got):
        assert_close(y, outs[r], name=f"y rank {r}", **tol)
        if y.shape[0]:
            assert_close(gx, xg[r], name=f"x grad rank {r}", **tol)
            assert_close(gw, wg[r], name=f"topk_weights grad rank {r}", **tol)
        for k, gref in gglob.items():
            if gref is None:
                assert gloc[k] is None
                continue
            assert gloc[k] is not None, f"{k} grad missing on rank {r}"
            assert_close(gloc[k], gref[r * El : (r + 1) * El], name=f"{k} grad rank {r}", **tol)


TOL64 = dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_baseline_random_routing(W, activation, bias):
    K = 1 + (W + len(activation)) % 4  # K from 1 to 4, varied across cases
    glob, per_rank = _problem(W, K, "random", activation, bias)
    _compare(
        W,
        _run_baseline(W, glob, per_rank, activation),
        _run_reference(glob, per_rank, activation),
        TOL64,
    )


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "routing, K", [("one_expert", 2), ("all_dropped_but_one", 3), ("random", E)]
)
def test_baseline_skewed_routing(W, routing, K):
    glob, per_rank = _problem(W, K, routing, "swiglu", True, seed=1)
    _compare(
        W,
        _run_baseline(W, glob, per_rank, "swiglu"),
        _run_reference(glob, per_rank, "swiglu"),
        TOL64,
    )


@pytest.mark.parametrize("W", [2, 3])
def test_baseline_fp32_and_deterministic(W):
    glob, per_rank = _problem(W, 2, "random", "gelu", True, dtype=torch.float32, seed=2)
    a = _run_baseline(W, glob, per_rank, "gelu")
    b = _run_baseline(W, glob, per_rank, "gelu")
    for (ya, *_), (yb, *_) in zip(a, b):
        assert torch.equal(ya, yb)  # bitwise, run after run
    g64 = {k: None if v is None else v.double() for k, v in glob.items()}
    p64 = [tuple(t if t.dtype == torch.int64 else t.double() for t in p) for p in per_rank]
    _compare(W, a, _run_reference(g64, p64, "gelu"), dict(rtol=1e-5, atol=1e-5))


def test_baseline_world_none_equals_w1():
    glob, per_rank = _problem(1, 3, "random", "relu", True, seed=3)
    x, ids, wts, _ = per_rank[0]
    y_none = baseline_experts(
        x, ids, wts, glob["w1"], glob["w2"], None, "relu", glob["b1"], glob["b2"]
    )
    y_w1 = spawn(
        1,
        lambda w: baseline_experts(
            x, ids, wts, glob["w1"], glob["w2"], w, "relu", glob["b1"], glob["b2"]
        ),
    )[0]
    assert torch.equal(y_none, y_w1)


@pytest.mark.parametrize(
    "change, err, match",
    [
        (dict(ids=torch.full((3, 2), E)), ValueError, "topk_ids"),
        (dict(ids=torch.full((3, 2), -2)), ValueError, "topk_ids"),
        (dict(ids=torch.zeros(3, 2)), TypeError, "topk_ids"),
        (dict(ids=torch.zeros(4, 2, dtype=torch.int64)), ValueError, "topk_ids"),
        (dict(wts=torch.zeros(3, 3, dtype=f64)), ValueError, "topk_weights"),
        (dict(x=torch.zeros(3, H + 1, dtype=f64)), ValueError, "w1"),
        (dict(x=torch.zeros(3, H, dtype=torch.int64)), TypeError, "x"),
        (dict(w1=torch.zeros(E, FF, H, dtype=f64)), ValueError, "w1"),
        (dict(w2=torch.zeros(E, H, FF, dtype=torch.float32)), TypeError, "w2"),
        (dict(b1=torch.zeros(E, FF, dtype=f64)), ValueError, "b1"),
        (dict(activation="tanh"), ValueError, "activation"),
    ],
)
def test_baseline_bad_input(change, err, match):
    args = dict(
        x=torch.zeros(3, H, dtype=f64),
        ids=torch.zeros(3, 2, dtype=torch.int64),
        wts=torch.zeros(3, 2, dtype=f64),
        w1=torch.zeros(E, 2 * FF, H, dtype=f64),
        w2=torch.zeros(E, H, FF, dtype=f64),
        b1=None,
        activation="swiglu",
    )
    args.update(change)
    with pytest.raises(err, match=match):
        baseline_experts(
            args["x"],
            args["ids"],
            args["wts"],
            args["w1"],
            args["w2"],
            None,
            args["activation"],
            args["b1"],
        )


def test_baseline_bad_ids_on_one_rank_every_rank_raises():
    W = 3
    El = E // W

    def fn(world):
        ids = torch.zeros(2, 1, dtype=torch.int64)
        if world.rank == 1:
            ids[1, 0] = E  # out of range on rank 1 only
        sl = slice(world.rank * El, (world.rank + 1) * El)
        try:
            baseline_experts(
                torch.ones(2, H, dtype=f64),
                ids,
                torch.ones(2, 1, dtype=f64),
                torch.ones(E, 2 * FF, H, dtype=f64)[sl],
                torch.ones(E, H, FF, dtype=f64)[sl],
                world,
            )
        except ValueError as e:
            return str(e)
        return None

    msgs = spawn(W, fn)
    assert all(m is not None and "rank(s) [1]" in m for m in msgs), msgs


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_loop_backward_writes_each_gradient_once(bias):
    """The per-group loop (CPU, GPUs without grouped_mm) must write the stacked weight's and
    bias's gradients once, not once per group (``w[g]``'s backward is a whole-stack write), and
    still get them right, empty groups included."""
    from moe_overlap.dispatch.baseline import grouped_linear
    from moe_overlap.testing import ops_writing

    g = torch.Generator().manual_seed(5)
    counts = [3, 0, 4, 1, 0, 2]
    G, O, K = len(counts), 5, 7
    x = randn((sum(counts), K), f64, generator=g).requires_grad_(True)
    w = randn((G, O, K), f64, generator=g).requires_grad_(True)
    b = randn((G, O), f64, generator=g).requires_grad_(True) if bias else None
    gid = torch.repeat_interleave(torch.arange(G), torch.tensor(counts))
    gy = randn((sum(counts), O), f64, generator=g)
    leaves = [x, w] + ([b] if bias else [])
    got = []

    def step():
        y = grouped_linear(x, w, counts, b, gid)
        got.extend(torch.autograd.grad(y, leaves, gy))

    writes = ops_writing(step, [w.shape] + ([b.shape] if bias else []))
    for shape, ops in writes.items():
        assert len(ops) == 1, f"{len(ops)} tensors of shape {shape} written: {ops}"
    want_y = torch.einsum("nk,nok->no", x, w[gid]) + (b[gid] if bias else 0)
    want = torch.autograd.grad(want_y, leaves, gy)
    for a, e in zip(got, want):
        assert_close(a, e)
