"""MoELayer (router + fused experts + shared experts) against the float64 reference, forward and
backward (router weight through the top-k weights and the aux / z losses), on emulated EP worlds.

Cases are chosen pairwise over the router options (softmax / sigmoid, renormalization,
group-limited routing, correction bias, capacity, scaling, normalized load-balance scores),
shared experts, activations, world sizes (odd ones too) and token counts (a rank with no
tokens, all tokens on one expert)."""

import pytest
import torch

import moe_overlap as mo
from moe_overlap import reference as ref
from moe_overlap.testing import assert_close, spawn

H, F = 13, 7

# (W, tokens per rank, config overrides, hot) - hot: every token routed to expert 0 by a large
# router bias towards it (the correction bias is selection-only, so use the weight).
CASES = [
    (1, [9], dict(num_experts=4, top_k=2), False),
    (2, [7, 0], dict(num_experts=4, top_k=1, score_func="sigmoid", norm_topk_prob=False), False),
    (
        3,
        [5, 8, 3],
        dict(
            num_experts=6,
            top_k=3,
            n_group=3,
            topk_group=2,
            router_bias=True,
            score_func="sigmoid",
            routed_scaling_factor=2.5,
            aux_loss_coef=0.05,
            aux_loss_scores="normalized",
        ),
        False,
    ),
    (
        2,
        [10, 6],
        dict(num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01),
        False,
    ),
    (2, [6, 9], dict(num_experts=8, top_k=8, activation="gelu", n_shared_experts=1), False),
    (
        4,
        [4, 5, 0, 6],
        dict(
            num_experts=8,
            top_k=2,
            activation="relu",
            aux_loss_coef=0.05,
            shared_expert_ffn_size=5,
            n_shared_experts=2,
        ),
        True,
    ),
    (
        1,
        [11],
        dict(num_experts=16, top_k=4, activation="silu", capacity_factor=0.5, z_loss_coef=0.1),
        False,
    ),
]


def _run(world, cfg, tokens, glob, hot):
    El = cfg.num_experts // world.world_size
    layer = mo.MoELayer(cfg, world=world)
    with torch.no_grad():
        layer.router.weight.copy_(glob["router"])
        if layer.router.e_score_correction_bias is not None:
            layer.router.e_score_correction_bias.copy_(glob["bias"])
        layer.experts.load_global(glob["w1"], glob["w2"], world.rank)
        if layer.shared_experts is not None:
            layer.shared_experts.gate_up_proj.copy_(glob["sw1"])
            layer.shared_experts.down_proj.copy_(glob["sw2"])
    g = torch.Generator().manual_seed(50 + world.rank)
    x = torch.randn(tokens[world.rank], H, generator=g)
    if hot:
        x = x.abs() + 0.5  # with router row 0 large and positive, expert 0 wins everywhere
    x.requires_grad_(True)
    y = layer(x)
    dy = torch.randn(y.shape, generator=g)
    ((y * dy).sum() + 3.0 * layer.aux_loss).backward()
    sl = slice(world.rank * El, (world.rank + 1) * El)
    grads = dict(
        x=x.grad,
        router=layer.router.weight.grad,
        w1=layer.experts.gate_up_proj.grad,
        w2=layer.experts.down_proj.grad,
        sw1=None if layer.shared_experts is None else layer.shared_experts.gate_up_proj.grad,
    )
    return x.detach(), dy, y.detach(), layer.aux_loss.detach(), layer.expert_counts, grads, sl


@pytest.mark.parametrize("W,tokens,over,hot", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_moe_layer_matches_reference(W, tokens, over, hot):
    cfg = mo.MoEConfig(hidden_size=H, ffn_hidden_size=F, **over)
    E = cfg.num_experts
    g = torch.Generator().manual_seed(sum(tokens) + E)
    rows = 2 * F if cfg.activation == "swiglu" else F
    glob = dict(
        router=torch.randn(E, H, generator=g) * 0.5,
        bias=torch.randn(E, generator=g) * 0.1,
        w1=torch.randn(E, rows, H, generator=g) * 0.3,
        w2=torch.randn(E, H, F, generator=g) * 0.3,
    )
    if hot:
        glob["router"][0] = 5.0
    fs = cfg.shared_ffn_size
    if fs:
        srows = 2 * fs if cfg.activation == "swiglu" else fs
        glob["sw1"] = torch.randn(srows, H, generator=g) * 0.3
        glob["sw2"] = torch.randn(H, fs, generator=g) * 0.3
    res = spawn(W, _run, cfg, tokens, glob, hot)

    d = torch.float64
    R = glob["router"].to(d).requires_grad_()
    W1 = glob["w1"].to(d).requires_grad_()
    W2 = glob["w2"].to(d).requires_grad_()
    SW1 = glob["sw1"].to(d).requires_grad_() if fs else None
    SW2 = glob["sw2"].to(d) if fs else None
    total = 0.0
    xr_all = []
    for x, dy, y, aux, counts, _grads, _sl in res:
        xr = x.to(d).requires_grad_()
        yr, auxr, route = ref.moe_layer(
            xr,
            R,
            W1,
            W2,
            cfg,
            correction_bias=glob["bias"].to(d) if cfg.router_bias else None,
            shared_w1=SW1,
            shared_w2=SW2,
            return_route=True,
        )
        assert_close(y, yr, name="y")
        assert_close(aux, torch.as_tensor(auxr, dtype=d), name="aux_loss")
        assert torch.equal(counts.long().cpu(), route.counts.long().cpu()), "expert_counts"
        total = total + (yr * dy.to(d)).sum() + 3.0 * auxr
        xr_all.append(xr)
    total.backward()
    for (x, _dy, _y, _aux, _counts, grads, sl), xr in zip(res, xr_all):
        if x.numel():
            assert_close(grads["x"], xr.grad, name="dx")
        assert_close(grads["w1"], W1.grad[sl], name="d gate_up_proj")
        assert_close(grads["w2"], W2.grad[sl], name="d down_proj")
    # Replicated parameters: the sum of every rank's local gradient is the global one.
    d_router = sum(r[5]["router"] for r in res)
    if R.grad.abs().max() < 1e-15:
        # a saturated router (the hot case: expert 0's logit ~60 above the rest) has a float64
        # gradient of 1e-25 or exactly 0; fp32 paths differ there by rounding alone
        assert d_router.abs().max() < 1e-12, "d router.weight should vanish"
    else:
        assert_close(d_router, R.grad, name="d router.weight")
    if fs:
        assert_close(sum(r[5]["sw1"] for r in res), SW1.grad, name="d shared gate_up_proj")


@pytest.mark.parametrize("impl", ["baseline"])
def test_baseline_impl_matches_fused(impl):
    cfg = mo.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)

    def fn(world, which):
        layer = mo.MoELayer(
            cfg, world=world, impl=which, generator=torch.Generator().manual_seed(9)
        )
        x = torch.randn(6 + world.rank, H, generator=torch.Generator().manual_seed(world.rank))
        return layer(x).detach()

    a = spawn(2, fn, "fused")
    b = spawn(2, fn, impl)
    for ya, yb in zip(a, b):
        assert_close(ya, yb.double(), name="fused vs baseline")


def test_layer_bad_input():
    cfg = mo.MoEConfig(
        hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2, max_tokens_per_rank=4
    )
    layer = mo.MoELayer(cfg, world=mo.local_world(device="cpu"))
    with pytest.raises(ValueError, match="hidden|13"):
        layer(torch.randn(3, H + 1))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(3, H, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        layer(torch.randn(5, H))
    with pytest.raises(ValueError, match="divisible"):
        spawn(3, lambda w: mo.MoELayer(cfg, world=w))
    with pytest.raises(ValueError, match="top_k"):
        mo.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="impl"):
        mo.MoELayer(cfg, world=mo.local_world(device="cpu"), impl="nope")
    experts = layer.experts
    ids, wts = torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2)
    with pytest.raises(ValueError, match="impl"):  # a typo must not run the baseline quietly
        experts(torch.randn(2, H), ids, wts, layer.world, impl="fuzed")
