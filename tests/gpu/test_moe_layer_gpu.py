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
