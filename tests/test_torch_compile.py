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


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_compiled_block_matches_eager(act):
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


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fused_experts_with_strided_inputs(backend):
    """Transposed x and bias views through the custom ops: the kernels read biases densely and
    inductor pins input strides and checks outputs against the fake impls (wrong bias, then a
    stride assertion, before the fix)."""
    from moe_overlap import reference

    T, H, F, E, K = 6, 16, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    xt = torch.randn(H, T, generator=g)
    ids = torch.randint(E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, F, H, generator=g) * 0.25
    w2 = torch.randn(E, H, F, generator=g) * 0.3
    b1 = torch.randn(F, E, generator=g).t()  # [E, F], column stride E
    b2 = torch.randn(H, E, generator=g).t()
    world = mo.local_world(device="cpu")
    scale = torch.arange(H, dtype=torch.float32)

    def f(xt, w, w1, w2, b1, b2):
        y = mo.fused_experts(xt.t(), ids, w, w1, w2, world, activation="gelu", b1=b1, b2=b2)
        return (y * scale).sum()

    leaves = (xt, w, w1, w2, b1, b2)
    args = [t.clone().requires_grad_() for t in leaves]
    torch.compile(f, backend=backend, fullgraph=True)(*args).backward()
    ref = [t.double().requires_grad_() for t in leaves]
    xd, wd, w1d, w2d, b1d, b2d = ref
    y = reference.experts(xd.t(), ids, wd, w1d, w2d, "gelu", b1d, b2d)
    (y * scale.double()).sum().backward()
    for name, a, r in zip(("dx", "dw", "dw1", "dw2", "db1", "db2"), args, ref):
        assert_close(a.grad, r.grad, name=name)
