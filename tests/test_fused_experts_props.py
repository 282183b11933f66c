"""Property test of ``fused_experts`` (forward, CPU interpreter, fp32) against the float64
reference over world sizes 1..3, shapes down to H = F = 1, every top-k up to min(E, 4), every
activation with and without biases, exact and static sizing, and skewed routings: Zipf-like
with a drawn exponent, one hot expert taking every token's first choice, every assignment on one
rank's experts, random drops. The example budget is bounded (the interpreter is slow).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_overlap as mo
from moe_overlap import reference as ref
from moe_overlap.config import ACTIVATIONS, w1_rows
from moe_overlap.testing import assert_close, randn, spawn

ROUTINGS = ("uniform", "zipf", "hot_expert", "hot_rank", "drop")


def draw_ids(routing, T, E, El, K, g, skew, hot_expert, hot_rank, p_drop):
    """``[T, K]`` int64 global ids of one rank under ``routing`` (see the module docstring)."""
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if routing == "zipf":
        order = torch.randperm(E, generator=g)
        p = torch.empty(E)
        p[order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** skew
        return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    if routing == "hot_rank":  # duplicates inside a token when the rank has fewer than K experts
        return hot_rank * El + torch.randint(El, (T, K), generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if routing == "hot_expert":  # first choice always the hot expert, the rest distinct
        for t in range(T):
            rest = [e for e in ids[t].tolist() if e != hot_expert][: K - 1]
            ids[t] = torch.tensor([hot_expert, *rest])
    elif routing == "drop":
        ids[torch.rand(T, K, generator=g) < p_drop] = -1
    return ids


@st.composite
def problems(draw):
    W = draw(st.integers(1, 3))
    El = draw(st.integers(1, 3))
    E = W * El
    return dict(
        W=W,
        El=El,
        E=E,
        K=draw(st.integers(1, min(E, 4))),
        H=draw(st.integers(1, 24)),
        F=draw(st.integers(1, 20)),
        tokens=draw(st.lists(st.integers(0, 10), min_size=W, max_size=W)),
        act=draw(st.sampled_from(ACTIVATIONS)),
        bias=draw(st.booleans()),
        routing=draw(st.sampled_from(ROUTINGS)),
        skew=draw(st.floats(0.5, 3.0)),
        hot_expert=draw(st.integers(0, E - 1)),
        hot_rank=draw(st.integers(0, W - 1)),
        p_drop=draw(st.floats(0.0, 1.0)),
        static_extra=draw(st.none() | st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(p=problems())
def test_fused_experts_matches_reference(p):
    W, El, E, K, H, F = p["W"], p["El"], p["E"], p["K"], p["H"], p["F"]
    g = torch.Generator().manual_seed(p["seed"])
    rows = w1_rows(p["act"], F)
    w1 = randn((E, rows, H), generator=g, scale=H**-0.5)
    w2 = randn((E, H, F), generator=g, scale=F**-0.5)
    b1 = randn((E, rows), generator=g, scale=0.5) if p["bias"] else None
    b2 = randn((E, H), generator=g, scale=0.5) if p["bias"] else None
    xs, ids, wts = [], [], []
    for T in p["tokens"]:
        xs.append(randn((T, H), generator=g))
        ids.append(
            draw_ids(
                p["routing"], T, E, El, K, g, p["skew"], p["hot_expert"], p["hot_rank"], p["p_drop"]
            )
        )
        wts.append(torch.rand(T, K, generator=g) + 0.1)
    max_tokens = None
    if p["static_extra"] is not None:
        max_tokens = max(1, max(p["tokens"]) + p["static_extra"])

    def fn(world):
        r = world.rank
        sl = slice(r * El, (r + 1) * El)
        world.workspace(1 << 20).local.fill_(0xFF)  # NaN poison: unwritten rows show
        world.barrier()
        return mo.fused_experts(
            xs[r],
            ids[r],
            wts[r],
            w1[sl],
            w2[sl],
            world,
            activation=p["act"],
            b1=None if b1 is None else b1[sl],
            b2=None if b2 is None else b2[sl],
            max_tokens_per_rank=max_tokens,
        )

    got = spawn(W, fn, timeout=120)
    f64 = torch.float64
    for r in range(W):
        want = ref.experts(
            xs[r].to(f64),
            ids[r],
            wts[r].to(f64),
            w1.to(f64),
            w2.to(f64),
            p["act"],
            None if b1 is None else b1.to(f64),
            None if b2 is None else b2.to(f64),
        )
        assert got[r].shape == want.shape
        assert_close(got[r], want, name=f"rank {r} of {p}")
