"""``torch.compile`` (inductor) of a block using the MoE layer matches eager on one GPU, bf16."""

import pytest
import torch

import moe_overlap as mo
from moe_overlap.testing import rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Block(torch.nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.norm = torch.nn.RMSNorm(cfg.hidden_size)
        self.moe = mo.MoELayer(
            cfg,
            world=world,
            dtype=torch.bfloat16,
            generator=torch.Generator(device="cuda").manual_seed(3),
        )

    def forward(self, x):
        return x + self.moe(self.norm(x))


def test_compiled_block_matches_eager_bf16():
    cfg = mo.MoEConfig(
        hidden_size=512, ffn_hidden_size=384, num_experts=8, top_k=2, aux_loss_coef=0.01
    )
    block = Block(cfg, mo.local_world(device="cuda")).to("cuda", torch.bfloat16)
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = block(x)
    y.float().square().mean().backward()
    gx = x.grad.clone()
    g = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    x.grad = None
    y2 = torch.compile(block, fullgraph=True)(x)
    y2.float().square().mean().backward()
    assert rel_error(y2, y) < 1e-2
    assert rel_error(x.grad, gx) < 2e-2
    for n, p in block.named_parameters():
        assert rel_error(p.grad, g[n]) < 3e-2, n
