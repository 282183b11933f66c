"""``Router`` (vectorized, no host sync) against ``reference.route`` (per-token loops)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import reference as ref
from moe_overlap.config import MoEConfig
from moe_overlap.dispatch.router import ROUTER_INIT_STD, Router, init_router_weight_
from moe_overlap.testing import assert_close, randn

f64 = torch.float64
E, H = 8, 11

# Each variant is one mix of the options; K runs over every legal value inside the test.
VARIANTS = {
    "plain": dict(),
    "nonorm_scaled": dict(norm_topk_prob=False, routed_scaling_factor=2.5),
    "groups": dict(n_group=4, topk_group=2),
    "bias": dict(router_bias=True),
    "groups_bias_cap": dict(n_group=2, topk_group=1, router_bias=True, capacity_factor=1.0),
    "cap_tight_scaled": dict(capacity_factor=0.5, routed_scaling_factor=1.7),
    "cap_loose_nonorm": dict(capacity_factor=1.25, norm_topk_prob=False),
    "normalized_lb_bias": dict(aux_loss_scores="normalized", router_bias=True),
}


def _cfgs(variant, score_func, **extra):
    for K in range(1, E + 1):
        kw = dict(VARIANTS[variant], score_func=score_func, aux_loss_coef=0.7, z_loss_coef=0.05)
        kw.update(extra)
        try:
            yield MoEConfig(H, 5, E, K, **kw)
        except ValueError:  # K above what the kept groups hold
            continue


def _router(cfg, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = Router(cfg, generator=g).to(dtype)
    with torch.no_grad():
        r.weight.mul_(30)  # spread the scores so routing is far from ties
        if cfg.router_bias:
            r.e_score_correction_bias.copy_(randn((E,), generator=g, scale=0.3))
    return r


@pytest.mark.parametrize("T", [0, 1, 7, 33])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_router_matches_reference(variant, score_func, T):
    for i, cfg in enumerate(_cfgs(variant, score_func)):
        r = _router(cfg, f64, seed=100 + i)
        x = randn((T, H), f64, generator=torch.Generator().manual_seed(T + i))
        out = r(x)
        want = ref.route(x, r.weight, cfg, r.e_score_correction_bias)
        tag = f"K={cfg.top_k}"
        assert out.topk_ids.dtype == torch.int64 and out.counts.dtype == torch.int64
        assert torch.equal(out.topk_ids, want.topk_ids), tag
        assert torch.equal(out.counts, want.counts), tag
        assert_close(out.topk_weights, want.topk_weights, rtol=1e-12, atol=1e-12, name=tag)
        aux = cfg.aux_loss_coef * want.aux_loss + cfg.z_loss_coef * want.z_loss
        assert_close(out.aux_loss, aux, rtol=1e-12, atol=1e-12, name=tag)
        assert torch.isfinite(out.aux_loss)
        if cfg.capacity_factor is not None:
            assert int(out.counts.max()) <= cfg.capacity(T), tag


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    "variant",
    ["plain", "nonorm_scaled", "groups_bias_cap", "cap_tight_scaled", "normalized_lb_bias"],
)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_router_gradients(variant, score_func, K):
    cfg = MoEConfig(
        H, 5, E, K, score_func=score_func, aux_loss_coef=0.7, z_loss_coef=0.05, **VARIANTS[variant]
    )
    T = 13
    g = torch.Generator().manual_seed(K)
    r = _router(cfg, torch.float32, seed=K)
    x32 = randn((T, H), generator=g).requires_grad_()
    G = randn((T, K), generator=g)
    out = r(x32)
    ((out.topk_weights * G).sum() + out.aux_loss).backward()

    w64 = r.weight.detach().double().requires_grad_()
    x64 = x32.detach().double().requires_grad_()
    bias = r.e_score_correction_bias
    want = ref.route(x64, w64, cfg, None if bias is None else bias.double())
    assert torch.equal(out.topk_ids, want.topk_ids)
    aux = cfg.aux_loss_coef * want.aux_loss + cfg.z_loss_coef * want.z_loss
    ((want.topk_weights * G.double()).sum() + aux).backward()
    assert out.topk_weights.dtype == torch.float32 and out.aux_loss.dtype == torch.float32
    assert_close(out.topk_weights, want.topk_weights, name="topk_weights")
    assert_close(out.aux_loss, aux, name="aux_loss")
    assert_close(r.weight.grad, w64.grad, name="router weight grad")
    assert_close(x32.grad, x64.grad, name="x grad")


def test_router_low_precision_input_uses_fp32_logits():
    cfg = MoEConfig(H, 5, E, 2, aux_loss_coef=0.1)
    r = _router(cfg, torch.float32, seed=5)
    x = randn((9, H), torch.bfloat16, generator=torch.Generator().manual_seed(5))
    out = r(x)
    want = ref.route(x.double(), r.weight.double(), cfg)
    assert out.topk_weights.dtype == torch.float32 and out.aux_loss.dtype == torch.float32
    assert torch.equal(out.topk_ids, want.topk_ids)
    assert_close(out.topk_weights, want.topk_weights, dtype=torch.float32)


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_router_under_autocast_keeps_fp32_logits(monkeypatch, kernel, wdtype):
    """A caller's ``torch.autocast`` region must not lower the logits' GEMM: the kernel path
    raised on bf16 logits, the torch path routed on them."""
    monkeypatch.setenv("MOE_OVERLAP_ROUTER_KERNEL", kernel)
    cfg = MoEConfig(H, 5, E, 2, aux_loss_coef=0.1, z_loss_coef=0.05)
    r = _router(cfg, wdtype, seed=6)
    x = randn((40, H), generator=torch.Generator().manual_seed(6)).to(wdtype).requires_grad_()
    plain = r(x)
    gp = torch.autograd.grad((plain.topk_weights.sum() + plain.aux_loss), [x, r.weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = r(x)
    ga = torch.autograd.grad((auto.topk_weights.sum() + auto.aux_loss), [x, r.weight])
    assert auto.topk_weights.dtype == torch.float32
    assert torch.equal(auto.topk_ids, plain.topk_ids)
    assert torch.equal(auto.topk_weights, plain.topk_weights)
    for a, p in zip(ga, gp):
        assert torch.equal(a, p)


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_group_scores_round_like_the_router(monkeypatch, kernel):
    """A group's score (its two best) is summed in the compute dtype in both the router and
    the reference: at an fp32 rounding tie they picked different groups (the reference summed
    Python floats)."""
    monkeypatch.setenv("MOE_OVERLAP_ROUTER_KERNEL", kernel)
    cfg = MoEConfig(4, 4, 4, 1, score_func="sigmoid", n_group=2, topk_group=1, router_bias=True)
    r = Router(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.diag(torch.tensor([30.0, -200.0, 30.0, -200.0])))  # scores 1,0,1,0
        r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 2.0**-24]))
    x = torch.ones(1, 4)
    want = ref.route(x, r.weight, cfg, r.e_score_correction_bias)
    assert r(x).topk_ids.tolist() == want.topk_ids.tolist() == [[0]]  # 1 + 2^-24 rounds to 1


def test_correction_bias_stays_fp32_when_the_module_is_cast():
    cfg = MoEConfig(H, 5, E, 2, score_func="sigmoid", router_bias=True)
    r = Router(cfg).to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16
    assert r.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():
        for _ in range(10):
            r.e_score_correction_bias += 1e-3
    assert abs(float(r.e_score_correction_bias[0]) - 1e-2) < 1e-6
    r.double()
    assert r.e_score_correction_bias.dtype == torch.float32
    assert "e_score_correction_bias" in dict(r.named_buffers())


def test_cast_keeps_a_trained_correction_bias_exact():
    """A bias trained in fp32 (or loaded from a checkpoint) must not pass through bf16 when the
    module is cast: biases closer than a bf16 step would tie and change the selection."""
    E4 = 4
    cfg = MoEConfig(H, 5, E4, 1, score_func="sigmoid", router_bias=True)
    r = Router(cfg)
    bias = torch.tensor([0.1234567, 0.1235, 1.001, 1.002])
    with torch.no_grad():
        r.weight.zero_()
        r.e_score_correction_bias.copy_(bias)
    x = randn((3, H))
    assert r(x).topk_ids.flatten().tolist() == [3, 3, 3]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        c = cast(r)
        assert c.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(c.e_score_correction_bias, bias), c.e_score_correction_bias
        assert c(x.to(c.weight.dtype)).topk_ids.flatten().tolist() == [3, 3, 3]
        r = c.float()


def test_router_zero_coefs_and_zero_tokens():
    cfg = MoEConfig(H, 5, E, 3, capacity_factor=1.0, aux_loss_coef=1.0, z_loss_coef=1.0)
    r = _router(cfg, torch.float32, seed=6)
    out = r(torch.zeros(0, H))
    assert out.topk_ids.shape == (0, 3) and out.aux_loss.item() == 0.0
    out.aux_loss.backward()
    assert torch.equal(r.weight.grad, torch.zeros_like(r.weight))
    r0 = _router(MoEConfig(H, 5, E, 3), torch.float32, seed=6)
    assert r0(randn((4, H))).aux_loss.item() == 0.0


def test_router_no_host_sync_on_meta():
    # Meta tensors have no data: any .item(), nonzero, bincount or boolean indexing would fail.
    cfg = MoEConfig(
        H,
        5,
        E,
        3,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        router_bias=True,
        capacity_factor=1.0,
        aux_loss_coef=0.1,
        z_loss_coef=0.1,
    )
    r = Router(cfg, device="meta")
    out = r(torch.empty(17, H, device="meta"))
    assert out.topk_ids.shape == (17, 3) and out.counts.shape == (E,)


def test_router_module_and_init():
    cfg = MoEConfig(H, 5, E, 2, router_bias=True)
    a = Router(cfg, generator=torch.Generator().manual_seed(0))
    b = Router(cfg, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert a.weight.shape == (E, H) and isinstance(a.weight, torch.nn.Parameter)
    assert torch.equal(a.weight.double(), b.weight)  # same numbers for every dtype
    assert "e_score_correction_bias" in a.state_dict()
    assert a.e_score_correction_bias.dtype == torch.float32
    assert Router(MoEConfig(H, 5, E, 2)).e_score_correction_bias is None
    w = torch.empty(400, 50)
    init_router_weight_(w, torch.Generator().manual_seed(1))
    assert abs(w.std().item() - ROUTER_INIT_STD) < 0.002 and abs(w.mean().item()) < 0.002


@pytest.mark.parametrize(
    "x, err",
    [
        (torch.zeros(3, H + 1), ValueError),
        (torch.zeros(2, 3, H), ValueError),
        (torch.zeros(3, H, dtype=torch.int32), TypeError),
        (torch.zeros(3, H, device="meta"), ValueError),
        ([[0.0] * H], TypeError),
    ],
)
def test_router_bad_input(x, err):
    r = Router(MoEConfig(H, 5, E, 2))
    with pytest.raises(err):
        r(x)
    with pytest.raises(TypeError):
        Router(dict(hidden_size=H))


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # sign-magnitude -> a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("T, Eh, Hh", [(0, 4, 8), (1, 3, 5), (37, 8, 11), (64, 16, 96)])
def test_router_logits_bf16_matches_float64(T, Eh, Hh):
    """The bf16 path's logits are the fp32 GEMM of the same values, and its gradients agree with
    float64 to one bf16 rounding (the hi + lo split of d logits keeps 16 significant bits)."""
    from moe_overlap.dispatch.router import router_logits

    g = torch.Generator().manual_seed(1000 + T + Eh)
    # magnitudes over several octaves, so the lo half of the split matters
    x = randn((T, Hh), generator=g) * torch.exp2(torch.randint(-6, 6, (T, 1), generator=g))
    x = x.bfloat16().requires_grad_()
    w = (randn((Eh, Hh), generator=g, scale=0.05)).bfloat16().requires_grad_()
    dl = randn((T, Eh), generator=g) * torch.exp2(torch.randint(-20, 0, (T, Eh), generator=g))
    out = router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (T, Eh)
    want = x.detach().double() @ w.detach().double().t()
    assert_close(out, want, rtol=1e-6, atol=1e-6, name="logits")
    out.backward(dl)
    dx64 = dl.double() @ w.detach().double()
    dw64 = dl.double().t() @ x.detach().double()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert _bf16_ulps(x.grad, dx64.bfloat16()) <= 1, "dx"
    assert _bf16_ulps(w.grad, dw64.bfloat16()) <= 1, "d weight"
    # the single-bf16 rounding of d logits alone would not be this close
    if T >= 37:
        coarse = dl.bfloat16().double() @ w.detach().double()
        assert _bf16_ulps(coarse.bfloat16(), dx64.bfloat16()) > 1


def test_router_logits_other_dtypes_keep_their_path():
    from moe_overlap.dispatch.router import router_logits

    g = torch.Generator().manual_seed(3)
    x = randn((5, H), generator=g)
    w = randn((E, H), generator=g)
    assert torch.equal(router_logits(x, w), x @ w.t())
    assert router_logits(x.bfloat16(), w).dtype == torch.float32  # mixed: fp32 path
    assert router_logits(x.double(), w).dtype == torch.float64


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_bf16_module_gradients(score_func):
    """A bf16 Router (the bf16 MoELayer's) against float64 with the same bf16 values."""
    cfg = MoEConfig(H, 5, E, 2, score_func=score_func, aux_loss_coef=0.3, z_loss_coef=0.02)
    r = _router(cfg, torch.bfloat16, seed=11)
    g = torch.Generator().manual_seed(12)
    x = randn((29, H), torch.bfloat16, generator=g).requires_grad_()
    G = randn((29, 2), generator=g)
    out = r(x)
    ((out.topk_weights * G).sum() + out.aux_loss).backward()
    w64 = r.weight.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    want = ref.route(x64, w64, cfg)
    assert torch.equal(out.topk_ids, want.topk_ids)
    aux = cfg.aux_loss_coef * want.aux_loss + cfg.z_loss_coef * want.z_loss
    ((want.topk_weights * G.double()).sum() + aux).backward()
    assert_close(out.topk_weights, want.topk_weights, dtype=torch.float32, name="weights")
    assert_close(r.weight.grad, w64.grad, dtype=torch.bfloat16, name="router weight grad")
    assert_close(x.grad, x64.grad, dtype=torch.bfloat16, name="x grad")
