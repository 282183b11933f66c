"""The router's top-k kernels (``kernels/router_topk.py``) against the torch router they replace,
and their building blocks against float64: ids bitwise (ties included), weights, counts, the aux
losses and every gradient."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import reference as ref
from moe_overlap.config import MoEConfig
from moe_overlap.dispatch.router import Router
from moe_overlap.kernels.router_topk import route_topk, route_topk_backward
from moe_overlap.testing import assert_close, randn

H = 9


def _route_both(cfg, x, seed, monkeypatch, dtype=torch.float32, tie_step=None):
    """Run the kernel path and the torch path on the same router and input; returns both
    outputs and both sets of gradients."""
    g = torch.Generator().manual_seed(seed)
    r = Router(cfg, generator=g).to(dtype)
    with torch.no_grad():
        r.weight.mul_(30)
        if tie_step is not None:  # exact ties: logits on a coarse grid
            r.weight.copy_((r.weight / tie_step).round() * tie_step)
        if cfg.router_bias:
            r.e_score_correction_bias.copy_(randn((cfg.num_experts,), generator=g, scale=0.3))
    G = randn((x.shape[0], cfg.top_k), generator=g)
    outs = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("MOE_OVERLAP_ROUTER_KERNEL", kernel)
        r.zero_grad()
        xx = x.detach().clone().requires_grad_()
        o = r(xx)
        loss = (o.topk_weights * G).sum() + o.aux_loss
        if loss.requires_grad:
            loss.backward()
        outs.append((o, xx.grad, None if r.weight.grad is None else r.weight.grad.clone()))
    return outs


def _check_same(outs, tag):
    (a, ax, aw), (b, bx, bw) = outs
    assert torch.equal(a.topk_ids, b.topk_ids), tag
    assert torch.equal(a.counts, b.counts), tag
    assert a.topk_weights.dtype == b.topk_weights.dtype == torch.float32
    assert_close(a.topk_weights, b.topk_weights, rtol=2e-6, atol=1e-7, name=f"weights {tag}")
    assert_close(a.aux_loss, b.aux_loss, rtol=2e-6, atol=1e-7, name=f"aux {tag}")
    if bx is not None:
        assert_close(ax, bx, rtol=1e-3, atol=1e-3, name=f"x grad {tag}")
        assert_close(aw, bw, rtol=1e-3, atol=1e-3, name=f"weight grad {tag}")


@pytest.mark.parametrize("T", [0, 1, 7, 40])
@pytest.mark.parametrize("E", [1, 5, 8, 33])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("opts", ["plain", "bias_nonorm_scaled", "cap", "aux_only"])
def test_kernel_path_equals_torch_path(T, E, score_func, opts, monkeypatch):
    for K in sorted({1, min(2, E), min(3, E), min(8, E), E}):
        kw = dict(score_func=score_func, aux_loss_coef=0.3, z_loss_coef=0.02)
        if opts == "bias_nonorm_scaled":
            kw.update(router_bias=True, norm_topk_prob=False, routed_scaling_factor=2.5)
        elif opts == "cap":
            kw.update(capacity_factor=0.75)
        elif opts == "aux_only":
            kw.update(z_loss_coef=0.0)
        cfg = MoEConfig(H, 5, E, K, **kw)
        x = randn((T, H), generator=torch.Generator().manual_seed(T * 31 + E * 7 + K))
        _check_same(_route_both(cfg, x, 100 + K + E, monkeypatch), f"T{T} E{E} K{K}")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("K", [1, 2, 4, 6])
def test_exact_ties_go_to_the_lower_expert(score_func, K, monkeypatch):
    """Logits on a coarse grid: many exact ties, which the stable sort gives to the lower id."""
    # K = 1 renormalized is a constant weight: no gradient left to compare
    cfg = MoEConfig(H, 5, 12, K, score_func=score_func, norm_topk_prob=K > 1)
    x = torch.randint(-2, 3, (50, H), generator=torch.Generator().manual_seed(K)).float()
    outs = _route_both(cfg, x, 7 + K, monkeypatch, tie_step=8.0)
    ids = outs[0][0].topk_ids
    # the grid does produce ties inside the chosen sets
    w = outs[1][0].topk_weights
    assert bool((w[:, :-1] == w[:, 1:]).any()) if K > 1 else True
    _check_same(outs, f"ties K{K}")
    assert int(ids.min()) >= 0 and int(ids.max()) < 12


def test_kernel_path_against_float64_reference(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_ROUTER_KERNEL", "1")
    cfg = MoEConfig(H, 5, 16, 4, aux_loss_coef=0.5, z_loss_coef=0.1, router_bias=True)
    g = torch.Generator().manual_seed(3)
    r = Router(cfg, generator=g)
    with torch.no_grad():
        r.weight.mul_(30)
        r.e_score_correction_bias.copy_(randn((16,), generator=g, scale=0.3))
    x = randn((37, H), generator=g).requires_grad_()
    G = randn((37, 4), generator=g)
    out = r(x)
    ((out.topk_weights * G).sum() + out.aux_loss).backward()
    x64 = x.detach().double().requires_grad_()
    w64 = r.weight.detach().double().requires_grad_()
    want = ref.route(x64, w64, cfg, r.e_score_correction_bias.double())
    aux = cfg.aux_loss_coef * want.aux_loss + cfg.z_loss_coef * want.z_loss
    ((want.topk_weights * G.double()).sum() + aux).backward()
    assert torch.equal(out.topk_ids, want.topk_ids)
    assert torch.equal(out.counts, want.counts)
    assert_close(out.topk_weights, want.topk_weights, name="weights")
    assert_close(out.aux_loss, aux, name="aux")
    assert_close(x.grad, x64.grad, name="x grad")
    assert_close(r.weight.grad, w64.grad, name="weight grad")


def test_backward_split_halves_add_up():
    g = torch.Generator().manual_seed(11)
    T, E, K = 23, 7, 3
    logits = randn((T, E), generator=g, scale=3.0)
    ids, w, counts = route_topk(logits, K, False, True, 1.0, None, interpreted=True)
    assert int(counts.sum()) == T * K
    dw = randn((T, K), generator=g) * torch.exp2(torch.randint(-12, 0, (T, K), generator=g))
    dl_in = randn((T, E), generator=g, scale=1e-3)
    full = route_topk_backward(logits, ids, dw, dl_in, False, True, 1.0, False, interpreted=True)
    two = route_topk_backward(logits, ids, dw, dl_in, False, True, 1.0, True, interpreted=True)
    assert two.dtype == torch.bfloat16 and two.shape == (T, 2 * E)
    back = two[:, :E].double() + two[:, E:].double()
    # 16 significant bits with round-to-nearest (the GPU), 15 where bf16 casts truncate (the
    # interpreter)
    assert_close(back, full, rtol=4e-5, atol=1e-9, name="hi + lo")
    # and the fp32 gradient is the autograd one of the torch formula
    lg = logits.double().requires_grad_()
    s = lg.softmax(-1)
    gw = s.gather(1, ids)
    ww = gw / (gw.sum(-1, keepdim=True) + 1e-20)
    ((ww * dw.double()).sum() + (lg * dl_in.double()).sum()).backward()
    assert_close(full, lg.grad, rtol=1e-5, atol=1e-9, name="d logits")


def test_nan_rows_stay_in_range():
    logits = torch.randn(6, 10)
    logits[2] = float("nan")
    logits[4, 3] = float("nan")
    ids, w, counts = route_topk(logits, 4, False, True, 1.0, None, interpreted=True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 10
    assert len(set(ids[2].tolist())) == 4  # distinct experts even without an order
    assert torch.isnan(w[2]).all()


@pytest.mark.parametrize(
    "args, err",
    [
        ((torch.zeros(3, 4, dtype=torch.float64), 2), ValueError),
        ((torch.zeros(4, 3).t(), 2), ValueError),
        ((torch.zeros(3, 4), 5), ValueError),
        ((torch.zeros(3, 4), 0), ValueError),
    ],
)
def test_route_topk_bad_input(args, err):
    with pytest.raises(err):
        route_topk(*args, sigmoid=False, norm=True, scale=1.0)


@pytest.mark.parametrize(
    "bias",
    [torch.full((2,), 5.0), torch.zeros(8, dtype=torch.float64), torch.zeros(8, 1)],
    ids=["short", "fp64", "2d"],
)
def test_route_topk_rejects_a_bad_bias(bias):
    with pytest.raises(ValueError, match="bias_E"):
        route_topk(torch.randn(4, 8), 2, True, True, 1.0, bias, interpreted=True)


def test_route_topk_strided_bias_selects_like_a_contiguous_one():
    logits = torch.randn(5, 8)
    wide = torch.randn(8, 2)
    ids, w, _ = route_topk(logits, 2, True, True, 1.0, wide[:, 1], interpreted=True)
    ids2, w2, _ = route_topk(logits, 2, True, True, 1.0, wide[:, 1].contiguous(), interpreted=True)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


@pytest.mark.parametrize("which", ["ids", "ids dtype", "dw", "dl"])
def test_route_topk_backward_bad_input(which):
    logits = torch.randn(4, 8)
    ids, dw, dl = torch.zeros(4, 2, dtype=torch.int64), torch.randn(4, 2), torch.randn(4, 8)
    if which == "ids":
        ids = ids[:3]
    elif which == "ids dtype":
        ids = ids.int()
    elif which == "dw":
        dw = dw[:, :1]
    else:
        dl = dl[:, :7]
    with pytest.raises(ValueError, match=which.split()[0]):
        route_topk_backward(logits, ids, dw, dl, False, True, 1.0, False, interpreted=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_non_contiguous_input(dtype, monkeypatch):
    """Rows of a wider tensor (non-contiguous x) route like a contiguous copy, on both paths."""
    cfg = MoEConfig(H, 5, 6, 2, aux_loss_coef=0.2)
    wide = randn((21, 2 * H + 3), generator=torch.Generator().manual_seed(4)).to(dtype)
    x = wide[:, 3 : 3 + H]
    assert not x.is_contiguous()
    outs = _route_both(cfg, x, 21, monkeypatch, dtype=dtype)
    again = _route_both(cfg, x.contiguous(), 21, monkeypatch, dtype=dtype)
    assert torch.equal(outs[0][0].topk_ids, again[0][0].topk_ids)
    assert torch.equal(outs[0][0].topk_weights, again[0][0].topk_weights)
    if dtype == torch.float32:
        _check_same(outs, "non-contiguous")
    else:  # the bf16 paths differ only in how d logits is split: compare to bf16 rounding
        assert torch.equal(outs[0][0].topk_ids, outs[1][0].topk_ids)
        assert_close(outs[0][1], outs[1][1], dtype=torch.bfloat16, name="x grad")
        assert_close(outs[0][2], outs[1][2], dtype=torch.bfloat16, name="weight grad")
