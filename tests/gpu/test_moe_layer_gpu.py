"""MoELayer on one GPU (bf16): router + fused experts + shared experts on a side stream,
against the float64 reference with the same weights."""

import pytest
import torch

import moe_overlap as mo
from moe_overlap import reference as ref
from moe_overlap.testing import rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_layer_matches_reference_bf16(shared):
    cfg = mo.MoEConfig(
        hidden_size=512,
        ffn_hidden_size=384,
        num_experts=8,
        top_k=2,
        aux_loss_coef=0.01,
        z_loss_coef=1e-3,
        n_shared_experts=shared,
    )
    layer = mo.MoELayer(
        cfg,
        world=mo.local_world(device="cuda"),
        dtype=torch.bfloat16,
        generator=torch.Generator(device="cuda").manual_seed(0),
    )
    x = torch.randn(3, 97, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    d = torch.float64
    xr = x.detach().to(d).requires_grad_()
    sw = layer.shared_experts
    yr, _ = ref.moe_layer(
        xr,
        layer.router.weight.detach().to(d),
        layer.experts.gate_up_proj.detach().to(d),
        layer.experts.down_proj.detach().to(d),
        cfg,
        shared_w1=sw.gate_up_proj.detach().to(d) if sw is not None else None,
        shared_w2=sw.down_proj.detach().to(d) if sw is not None else None,
    )
    yr.square().mean().backward()
    # bf16 routing can flip near-tied experts: compare on the whole tensor, loosely.
    assert rel_error(y, yr) < 3e-2
    assert rel_error(x.grad, xr.grad) < 6e-2
    assert torch.isfinite(layer.aux_loss)


@pytest.mark.parametrize("T, E, H", [(16384, 128, 2048), (777, 8, 512), (1, 256, 7168), (0, 8, 64)])
def test_router_logits_bf16_tensor_cores(T, E, H):
    """The bf16 router's exact-product GEMMs against float64 on the same bf16 values: logits to
    fp32 accumulation error, dx and d weight to about one bf16 rounding."""
    from moe_overlap.dispatch.router import router_logits

    g = torch.Generator(device="cuda").manual_seed(T + E)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    dl = torch.randn(T, E, device="cuda", generator=g) * 1e-3
    out = router_logits(x, w)
    assert out.dtype == torch.float32
    want = x.detach().double() @ w.detach().double().t()
    if T:
        # Exact products, but the tensor cores' fp32 accumulation is coarser than fp32 SIMT's:
        # measured 1.4e-6 against 1.1e-7 at T 16384, H 2048 (2026-12-04); bf16 x itself
        # carries 4e-3.
        simt = x.detach().float() @ w.detach().float().t()
        err, err32 = rel_error(out, want), rel_error(simt, want)
        print(f"logits rel. error: tensor cores {err:.2e}, fp32 SIMT {err32:.2e}")
        assert err < 1e-5
    out.backward(dl)
    dx64 = dl.double() @ w.detach().double()
    dw64 = dl.double().t() @ x.detach().double()
    if T:
        assert rel_error(x.grad, dx64) < 4e-3  # bf16 output rounding
        assert rel_error(w.grad, dw64) < 4e-3
        # no worse than the fp32 path rounded to bf16
        fp32_dx = (dl @ w.detach().float()).bfloat16()
        assert rel_error(x.grad, dx64) <= 1.05 * rel_error(fp32_dx, dx64) + 1e-6
    else:
        assert x.grad.shape == (0, H) and not w.grad.abs().any()


@pytest.mark.parametrize(
    "T, E, K, score_func, bias",
    [
        (16384, 128, 8, "softmax", False),
        (8192, 256, 8, "sigmoid", True),
        (777, 60, 4, "softmax", False),
    ],
)
def test_router_kernels_match_torch_path(T, E, K, score_func, bias, monkeypatch):
    """The top-k kernels against the torch router at benchmark sizes, bf16 (both paths share the
    logits GEMMs): ids equal except where two scores tie to fp32 rounding, weights, counts and
    gradients close."""
    H = 1024
    cfg = mo.MoEConfig(
        hidden_size=H, ffn_hidden_size=64, num_experts=E, top_k=K, score_func=score_func,
        router_bias=bias, aux_loss_coef=0.01, z_loss_coef=1e-3,
    )  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    r = mo.dispatch.router.Router(cfg, dtype=torch.bfloat16, device="cuda", generator=gen)
    if bias:
        with torch.no_grad():
            r.e_score_correction_bias.copy_(torch.randn(E, device="cuda", generator=gen) * 0.1)
    x0 = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    G = torch.randn(T, K, device="cuda", generator=gen)
    outs = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("MOE_OVERLAP_ROUTER_KERNEL", kernel)
        r.zero_grad()
        x = x0.clone().requires_grad_()
        o = r(x)
        ((o.topk_weights * G).sum() + o.aux_loss).backward()
        outs.append((o, x.grad, r.weight.grad.clone()))
    (a, ax, aw), (b, bx, bw) = outs
    same = (a.topk_ids == b.topk_ids).all(dim=1)
    assert same.float().mean() > 0.999, f"{int((~same).sum())} rows routed differently"
    assert rel_error(a.topk_weights[same], b.topk_weights[same]) < 1e-6
    assert int((a.counts - b.counts).abs().sum()) <= 2 * K * int((~same).sum())
    assert rel_error(a.aux_loss, b.aux_loss) < 1e-5
    if bool(same.all()):
        assert rel_error(ax, bx) < 1e-2 and rel_error(aw, bw) < 1e-2
