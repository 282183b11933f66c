"""``torch.compile`` traces models that use the fused experts (custom ops + fake impls)."""

import pytest
import torch

import moe_overlap as mo
from moe_overlap.testing import assert_close


class Block(torch.nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.norm = torch.nn.LayerNorm(cfg.hidden_size)
        self.moe = mo.MoELayer(cfg, world=world, generator=torch.Generator().manual_seed(3))

    def forward(self, x):
        return x + self.moe(self.norm(x))


@pytest.mark.parametrize("bias_act", [("swiglu", False), ("gelu", True)], ids=["swiglu", "gelu"])
def test_compiled_block_matches_eager(bias_act):
    act = bias_act[0]
    cfg = mo.MoEConfig(
        hidden_size=16,
        ffn_hidden_size=8,
        num_experts=4,
        top_k=2,
        activation=act,
        aux_loss_coef=0.01,
    )
    block = Block(cfg, mo.local_world(device="cpu"))
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = block(x)
    (y.square().sum() + block.moe.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    gx = x.grad.clone()
    block.zero_grad()
    x.grad = None
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    y2 = compiled(x)
    (y2.square().sum() + block.moe.aux_loss).backward()
    assert_close(y2, y.detach(), name="y")
    assert_close(x.grad, gx, name="dx")
    for n, p in block.named_parameters():
        assert_close(p.grad, grads[n], name=f"d{n}")
