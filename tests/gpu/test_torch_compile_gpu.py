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


def _grads(block, x, run=None):
    """Output and grads of ``run(x)`` (default ``block(x)``); ``run``: a compiled ``block``."""
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad()
    # not ``run or block``: truth-testing a compiled module calls ``len()``, which it refuses
    y = (block if run is None else run)(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return {"y": y.detach(), "x": x.grad, **grads}


def test_compiled_block_matches_eager_bf16():
    """Compiled bf16 is as accurate as eager bf16, both judged against an fp32 copy of the block:
    small gradients (the router's, ~1e-5 each) differ by several % between two bf16 runs that
    merely round differently, so a fixed compiled-vs-eager bound would test rounding luck."""
    cfg = mo.MoEConfig(
        hidden_size=512, ffn_hidden_size=384, num_experts=8, top_k=2, aux_loss_coef=0.01
    )
    block = Block(cfg, mo.local_world(device="cuda")).to("cuda", torch.bfloat16)
    # the same seed, upcast: an fp32 twin holding exactly the bf16 block's values
    ref_block = Block(cfg, mo.local_world(device="cuda")).to("cuda", torch.bfloat16).float()
    for (n, p), q in zip(block.named_parameters(), ref_block.parameters()):
        assert torch.equal(p.float(), q), n
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    want = _grads(ref_block, x.float())
    eager = _grads(block, x)
    compiled = _grads(block, x, torch.compile(block, fullgraph=True))
    assert compiled.keys() == want.keys()
    # the yardstick itself must be sound (this also runs the fused kernels in fp32 on the GPU)
    for k in ("y", "x"):
        assert rel_error(eager[k], want[k]) < 2e-2, f"eager bf16 {k} far from fp32"
    for k in want:
        e_err = rel_error(eager[k], want[k])
        c_err = rel_error(compiled[k], want[k])
        assert c_err <= max(2 * e_err, 1e-2), f"{k}: compiled {c_err:.3g} vs eager {e_err:.3g}"
