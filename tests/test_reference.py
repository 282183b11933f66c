"""Sanity of the pure-torch reference (hand-computed cases) and of ``MoEConfig``'s validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_overlap import reference as ref
from moe_overlap.config import ACTIVATIONS, MoEConfig, expert_capacity, w1_rows
from moe_overlap.testing import assert_close, randn

f64 = torch.float64


def _cfg(**kw):
    base = dict(hidden_size=4, ffn_hidden_size=3, num_experts=4, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


def _route_logits(logits, cfg, bias=None):
    """Route with the identity router weight, so ``logits`` are exactly the given numbers."""
    x = torch.tensor(logits, dtype=f64)
    return ref.route(x, torch.eye(x.shape[1], dtype=f64), cfg, bias)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(top_k=5), ValueError),
        (dict(top_k=0), ValueError),
        (dict(hidden_size=-1), ValueError),
        (dict(ffn_hidden_size=0), ValueError),
        (dict(hidden_size=4.0), TypeError),
        (dict(num_experts=True), TypeError),
        (dict(activation="tanh"), ValueError),
        (dict(score_func="sparsemax"), ValueError),
        (dict(capacity_factor=0.0), ValueError),
        (dict(capacity_factor=-1.0), ValueError),
        (dict(capacity_factor="1"), TypeError),
        (dict(n_group=3, topk_group=1), ValueError),  # 4 % 3
        (dict(n_group=2, topk_group=3), ValueError),
        (dict(n_group=2), ValueError),  # topk_group missing
        (dict(topk_group=1), ValueError),
        (dict(n_group=4, topk_group=1, top_k=2), ValueError),  # one group of 1 < top_k
        (dict(norm_topk_prob=1), TypeError),
        (dict(aux_loss_coef=-0.1), ValueError),
        (dict(z_loss_coef=float("nan")), ValueError),
        (dict(routed_scaling_factor=0.0), ValueError),
        (dict(n_shared_experts=-1), ValueError),
        (dict(shared_expert_ffn_size=8), ValueError),  # without shared experts
        (dict(max_tokens_per_rank=0), ValueError),
        (dict(aux_loss_scores="sum"), ValueError),
        (dict(aux_loss_scores=None), ValueError),
    ],
)
def test_config_rejects(kw, err):
    with pytest.raises(err):
        _cfg(**kw)


def test_config_derived():
    cfg = _cfg(num_experts=12, top_k=3, n_shared_experts=2)
    assert cfg.w1_rows == 6 and w1_rows(cfg) == 6 and w1_rows("gelu", 5) == 5
    assert w1_rows(cfg, 7) == 14 and ACTIVATIONS == ("swiglu", "gelu", "relu", "silu")
    assert cfg.shared_ffn_size == 6
    assert _cfg(n_shared_experts=1, shared_expert_ffn_size=5).shared_ffn_size == 5
    assert _cfg().shared_ffn_size == 0
    assert cfg.validate_world(3) == 4 and cfg.num_local_experts(12) == 1
    with pytest.raises(ValueError, match="divisible"):
        cfg.validate_world(5)
    with pytest.raises(ValueError):
        w1_rows("tanh", 4)
    # ceil(T*K/E*factor) and dropless
    assert expert_capacity(4, 2, 4, 1.0) == 2
    assert expert_capacity(7, 3, 4, 1.25) == math.ceil(7 * 3 / 4 * 1.25)
    assert expert_capacity(5, 2, 4, None) == 10 and expert_capacity(0, 2, 4, 1.0) == 0
    assert _cfg(capacity_factor=2.0).capacity(3) == 3


# ----------------------------------------------------------------------------- routing
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_route_softmax_hand(norm, scale):
    cfg = _cfg(norm_topk_prob=norm, routed_scaling_factor=scale)
    r = _route_logits([[2.0, 0.5, 1.0, -1.0]], cfg)
    assert r.topk_ids.tolist() == [[0, 2]]
    p = torch.tensor([2.0, 0.5, 1.0, -1.0], dtype=f64).exp()
    p = p / p.sum()
    w = torch.stack([p[0], p[2]])
    if norm:
        w = w / w.sum()
    assert_close(r.topk_weights[0], w * scale, rtol=1e-12, atol=1e-12)
    assert r.counts.tolist() == [1, 0, 1, 0]


def test_route_ties_go_to_lower_id():
    r = _route_logits([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 0.0, 2.0]], _cfg())
    assert r.topk_ids.tolist() == [[0, 1], [1, 3]]


def test_route_capacity_order_hand():
    # cap = ceil(4*2/4*1.0) = 2. Choices (first, second): t0 (0,1) t1 (0,2) t2 (0,1) t3 (1,0).
    # First choices in token order: e0 <- t0, t1; t2 dropped; e1 <- t3. Then second choices:
    # e1 <- t0 (e1 full after), e2 <- t1, t2's e1 dropped, t3's e0 dropped.
    logits = [[3, 2, 0, -1], [3, 0, 2, -1], [3, 2, 0, -1], [2, 3, 0, -1]]
    logits = [[float(v) for v in row] for row in logits]
    cfg = _cfg(capacity_factor=1.0, aux_loss_coef=1.0)
    r = _route_logits(logits, cfg)
    assert r.topk_ids.tolist() == [[0, 1], [0, 2], [-1, -1], [1, -1]]
    assert r.counts.tolist() == [2, 2, 1, 0]
    p = torch.softmax(torch.tensor(logits, dtype=f64), -1)
    w_t3 = p[3, 1] / (p[3, 1] + p[3, 0])  # renormalized over both choices, then dropped
    assert_close(r.topk_weights[3], torch.stack([w_t3, w_t3 * 0]), rtol=1e-12, atol=1e-12)
    assert r.topk_weights[2].tolist() == [0.0, 0.0]
    # load balance counts the choices before drops: e0 4, e1 3, e2 1, e3 0 of 8
    f = torch.tensor([4, 3, 1, 0], dtype=f64) / 8
    assert_close(r.aux_loss, 4 * (f * p.mean(0)).sum(), rtol=1e-12, atol=1e-12)
    z = torch.logsumexp(torch.tensor(logits, dtype=f64), -1).square().mean()
    assert_close(r.z_loss, z, rtol=1e-12, atol=1e-12)


def test_route_group_limited_hand():
    # Groups of 2: g0 (3, -3) g1 (1, 0.9) g2 (0.5, 0.4) g3 (-1, -2) in sigmoid scores.
    # g0 holds the best expert but its two-best sum loses: kept groups g1, g2 -> ids 2, 3.
    logits = [[3.0, -3.0, 1.0, 0.9, 0.5, 0.4, -1.0, -2.0]]
    cfg = _cfg(num_experts=8, score_func="sigmoid", n_group=4, topk_group=2)
    r = _route_logits(logits, cfg)
    assert r.topk_ids.tolist() == [[2, 3]]
    s = torch.sigmoid(torch.tensor(logits[0], dtype=f64))
    assert_close(r.topk_weights[0], s[2:4] / s[2:4].sum(), rtol=1e-12, atol=1e-12)
    flat = _route_logits(logits, _cfg(num_experts=8, score_func="sigmoid"))
    assert flat.topk_ids.tolist() == [[0, 2]]


@pytest.mark.parametrize("norm", [True, False])
def test_route_sigmoid_bias_selection_only(norm):
    cfg = _cfg(
        score_func="sigmoid", router_bias=True, norm_topk_prob=norm, routed_scaling_factor=2.0
    )
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=f64)
    r = _route_logits([[2.0, 1.0, 0.0, -1.0]], cfg, bias)
    assert r.topk_ids.tolist() == [[2, 0]]
    s = torch.sigmoid(torch.tensor([0.0, 2.0], dtype=f64))  # unbiased scores of e2, e0
    w = s / s.sum() if norm else s
    assert_close(r.topk_weights[0], 2.0 * w, rtol=1e-12, atol=1e-12)
    # P_e uses raw sigmoid scores, f_e the biased choices
    f = torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=f64)
    sig = torch.sigmoid(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=f64))
    assert_close(r.aux_loss, 4 * (f * sig).sum(), rtol=1e-12, atol=1e-12)


def test_route_normalized_balance_scores():
    # DeepSeek-V3's s': each token's sigmoid scores over their sum, then the usual E * sum f P.
    logits = [[2.0, 1.0, 0.0, -1.0], [-0.5, 0.5, 3.0, 1.5], [0.0, -2.0, 1.0, 2.5]]
    cfg = _cfg(score_func="sigmoid", aux_loss_scores="normalized")
    r = _route_logits(logits, cfg)
    s = torch.sigmoid(torch.tensor(logits, dtype=f64))
    f = torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=f64) / 6  # ids [0, 1], [2, 3], [3, 2]
    assert r.topk_ids.tolist() == [[0, 1], [2, 3], [3, 2]]
    P = (s / s.sum(dim=1, keepdim=True)).mean(dim=0)
    assert_close(r.aux_loss, 4 * (f * P).sum(), rtol=1e-12, atol=1e-12)
    raw = _route_logits(logits, _cfg(score_func="sigmoid"))
    assert not torch.allclose(raw.aux_loss, r.aux_loss)
    # softmax scores already sum to 1: the same loss up to rounding
    a = _route_logits(logits, _cfg(aux_loss_scores="normalized")).aux_loss
    assert_close(a, _route_logits(logits, _cfg()).aux_loss, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("scores", ["raw", "normalized"])
def test_route_balanced_loss_is_one_only_with_normalized_sigmoid(scores):
    # Token t prefers expert t, so every expert gets exactly one of the four choices (f = 1/E).
    # Then E * sum_e f_e P_e = sum_e P_e, which is 1 for any logits when each token's scores
    # sum to 1. With raw sigmoid scores it falls with the logits: the direction the raw form
    # lets the gradient take without changing any routing.
    base = torch.full((4, 4), -1.0, dtype=f64) + 3 * torch.eye(4, dtype=f64)
    cfg = _cfg(top_k=1, score_func="sigmoid", aux_loss_scores=scores)
    losses = []
    for shift in (0.0, -2.0, -6.0):
        r = _route_logits((base + shift).tolist(), cfg)
        assert r.topk_ids.reshape(-1).tolist() == [0, 1, 2, 3]
        losses.append(r.aux_loss.item())
    if scores == "normalized":
        assert losses == pytest.approx([1.0] * 3, rel=1e-12, abs=1e-12)
    else:
        assert losses[0] > losses[1] > losses[2] and losses[2] < 0.05


def test_route_normalized_balance_scores_underflow_stays_finite():
    # fp32 sigmoid of -120 is exactly 0: a token whose scores all underflow must give 0, not NaN.
    cfg = _cfg(score_func="sigmoid", aux_loss_scores="normalized")
    w = torch.eye(4, dtype=torch.float32).requires_grad_()
    x = torch.full((2, 4), -120.0)
    r = ref.route(x, w, cfg)
    assert r.scores.max().item() == 0.0
    assert torch.isfinite(r.aux_loss) and r.aux_loss.item() == 0.0
    r.aux_loss.backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_route_zero_tokens(score_func):
    cfg = _cfg(score_func=score_func, capacity_factor=1.0)
    w = randn((4, 4), f64).requires_grad_()
    r = ref.route(torch.zeros(0, 4, dtype=f64), w, cfg)
    assert r.topk_ids.shape == (0, 2) and r.topk_weights.shape == (0, 2)
    assert r.aux_loss.item() == 0.0 and r.z_loss.item() == 0.0
    (r.aux_loss + r.z_loss).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert r.counts.tolist() == [0, 0, 0, 0]


# ----------------------------------------------------------------------------- experts
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_expert_mlp_formula(activation, bias):
    g = torch.Generator().manual_seed(1)
    H, Fs, N = 5, 3, 4
    rows = w1_rows(activation, Fs)
    x, w1, w2 = (randn(s, f64, generator=g) for s in ((N, H), (rows, H), (H, Fs)))
    b1 = randn((rows,), f64, generator=g) if bias else torch.zeros(rows, dtype=f64)
    b2 = randn((H,), f64, generator=g) if bias else torch.zeros(H, dtype=f64)
    h = x @ w1.t() + b1
    if activation == "swiglu":
        gate, up = h[:, :Fs], h[:, Fs:]
        a = gate / (1 + torch.exp(-gate)) * up
    elif activation == "gelu":
        a = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    elif activation == "relu":
        a = h.clamp_min(0)
    else:
        a = h * torch.sigmoid(h)
    want = a @ w2.t() + b2
    got = ref.expert_mlp(x, w1, w2, activation, b1 if bias else None, b2 if bias else None)
    assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_experts_loop_and_drops():
    g = torch.Generator().manual_seed(2)
    E, H, Fs, T = 3, 4, 2, 5
    x = randn((T, H), f64, generator=g)
    w1, w2 = randn((E, 2 * Fs, H), f64, generator=g), randn((E, H, Fs), f64, generator=g)
    b1, b2 = randn((E, 2 * Fs), f64, generator=g), randn((E, H), f64, generator=g)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 2], [1, 0]])  # duplicates allowed
    wts = randn((T, 2), f64, generator=g)
    got = ref.experts(x, ids, wts, w1, w2, "swiglu", b1, b2)
    want = torch.zeros(T, H, dtype=f64)
    for t in range(T):
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                want[t] += (
                    wts[t, k]
                    * ref.expert_mlp(x[t : t + 1], w1[e], w2[e], "swiglu", b1[e], b2[e])[0]
                )
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[2], torch.zeros(H, dtype=f64))
    with pytest.raises(ValueError, match="topk_ids"):
        ref.experts(x, ids.clamp_max(1) + 2, wts, w1, w2)


@pytest.mark.parametrize("n_shared", [0, 2])
def test_moe_layer_and_ep_reference(n_shared):
    g = torch.Generator().manual_seed(3)
    cfg = MoEConfig(6, 4, 4, 2, aux_loss_coef=0.3, z_loss_coef=0.01, n_shared_experts=n_shared)
    E, H, Fs = 4, 6, 4
    rw = randn((E, H), f64, generator=g)
    w1, w2 = randn((E, 2 * Fs, H), f64, generator=g), randn((E, H, Fs), f64, generator=g)
    sw1 = randn((2 * cfg.shared_ffn_size, H), f64, generator=g) if n_shared else None
    sw2 = randn((H, cfg.shared_ffn_size), f64, generator=g) if n_shared else None
    x = randn((2, 3, H), f64, generator=g)
    y, aux, r = ref.moe_layer(x, rw, w1, w2, cfg, None, sw1, sw2, return_route=True)
    assert y.shape == x.shape
    xt = x.reshape(-1, H)
    want = ref.experts(xt, r.topk_ids, r.topk_weights, w1, w2)
    if n_shared:
        want = want + ref.shared_experts(xt, sw1, sw2)
    assert_close(y.reshape(-1, H), want, rtol=1e-12, atol=1e-12)
    assert_close(aux, 0.3 * r.aux_loss + 0.01 * r.z_loss, rtol=1e-12, atol=1e-12)
    per_rank = ref.ep_reference([xt[:4], xt[4:4], xt[4:]], rw, w1, w2, cfg, None, sw1, sw2)
    assert len(per_rank) == 3 and per_rank[1][0].shape == (0, H)
    assert per_rank[1][1].item() == 0.0
    assert_close(
        per_rank[0][0], ref.moe_layer(xt[:4], rw, w1, w2, cfg, None, sw1, sw2)[0], rtol=0, atol=0
    )
    if n_shared:
        with pytest.raises(ValueError, match="shared"):
            ref.moe_layer(x, rw, w1, w2, cfg)


def test_gelu_is_exact_erf():
    h = torch.linspace(-3, 3, 13, dtype=f64)
    w1 = torch.eye(13, dtype=f64)
    got = ref.expert_mlp(h[None], w1, torch.eye(13, dtype=f64), "gelu")[0]
    assert_close(got, F.gelu(h, approximate="none"), rtol=1e-15, atol=1e-15)
    assert (got - F.gelu(h, approximate="tanh")).abs().max() > 1e-6


def test_assert_close_baseline_accepts_noise_and_rejects_bugs():
    g = torch.Generator().manual_seed(5)
    want = randn((64, 32), torch.float64, generator=g)
    noise = randn((64, 32), torch.float64, generator=g) * 1e-3
    outlier = want.clone()
    outlier[3, 4] += 0.5  # one element far outside the table's bf16 tolerance
    with pytest.raises(AssertionError, match="1 of 2048 elements differ"):
        assert_close(outlier, want, dtype=torch.bfloat16)
    # a baseline just as wrong somewhere else: accepted
    base = want + noise
    base[9, 1] -= 0.4
    assert_close(outlier, want, dtype=torch.bfloat16, baseline=base)
    # a baseline that is accurate: the outlier is a bug
    with pytest.raises(AssertionError, match="baseline max abs diff"):
        assert_close(outlier, want, dtype=torch.bfloat16, baseline=want + noise)
    # a whole wrong row is more than rounding noise even against a noisy baseline
    row = want.clone()
    row[7] = 0.0
    with pytest.raises(AssertionError, match="allowed 2x"):
        assert_close(row, want, dtype=torch.bfloat16, baseline=base)
    nan = want.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(nan, want, dtype=torch.bfloat16, baseline=base)
