"""Integrations on one GPU in bf16 (compiled Triton): the DeepSpeed drop-in against DeepSpeed's
own layer, and HF Mixtral before/after replacement, at sizes where real tiles are full.

Reference: the same layer in fp32 with the *same* bf16-rounded weights and inputs. The gate
computes its logits in fp32 from those, so both runs route identically; then ours (bf16) and
DeepSpeed's own bf16 layer are each compared with the fp32 truth, and ours may not be much
worse than DeepSpeed's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU runs skip via the conftest too
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------- DeepSpeed
H, F, E, T = 512, 1024, 8, 1024


def _swiglu():
    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(H, F, bias=False)
            self.w3 = nn.Linear(H, F, bias=False)
            self.w2 = nn.Linear(F, H, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    return SwiGLU()


def _gelu():
    return nn.Sequential(nn.Linear(H, F), nn.GELU(), nn.Linear(F, H))


@pytest.mark.parametrize(
    "expert,k,drop_tokens",
    [(_swiglu, 2, True), (_swiglu, 2, False), (_gelu, 1, True), (_gelu, 2, False)],
    ids=["swiglu-k2-drop", "swiglu-k2-nodrop", "gelu-k1-drop", "gelu-k2-nodrop"],
)
def test_deepspeed_drop_in_bf16(expert, k, drop_tokens):
    deepspeed = pytest.importorskip("deepspeed")
    from moe_overlap.integrations.deepspeed import MoE

    kw = dict(
        num_experts=E,
        k=k,
        capacity_factor=1.0,
        min_capacity=0,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    torch.manual_seed(0)
    ds32 = deepspeed.moe.layer.MoE(H, expert(), **kw).cuda()
    ds16 = copy.deepcopy(ds32).to(torch.bfloat16)
    ds32.load_state_dict({n: t.float() for n, t in ds16.state_dict().items()})  # same rounding
    ours = MoE(H, expert().cuda().to(torch.bfloat16), **kw).cuda().to(torch.bfloat16)
    ours.load_state_dict(ds16.state_dict(), strict=True)

    g = torch.Generator().manual_seed(1)
    x16 = torch.randn(2, T // 2, H, generator=g).cuda().to(torch.bfloat16)
    dy = torch.randn(2, T // 2, H, generator=g).cuda()
    res = {}
    for name, layer, dtype in (
        ("ref", ds32, torch.float32),
        ("ds", ds16, torch.bfloat16),
        ("ours", ours, torch.bfloat16),
    ):
        x = x16.to(dtype).requires_grad_(True)
        out, l_aux, counts = layer(x)
        ((out.float() * dy).sum() + l_aux).backward()
        res[name] = (out, l_aux, counts, x.grad, {n: p.grad for n, p in layer.named_parameters()})
    ref, ds, ours_r = res["ref"], res["ds"], res["ours"]
    assert ours_r[0].dtype == torch.bfloat16 and ours_r[0].shape == x16.shape
    assert torch.equal(ours_r[2], ref[2])  # exp_counts: identical routing
    torch.testing.assert_close(ours_r[1].float(), ref[1].float(), rtol=1e-5, atol=1e-6)
    for what, i in (("output", 0), ("d x", 3)):
        e_ours, e_ds = rel(ours_r[i], ref[i]), rel(ds[i], ref[i])
        assert e_ours < max(2 * e_ds, 1e-2), f"{what}: ours {e_ours:.2e}, DeepSpeed {e_ds:.2e}"
    for n, gref in ref[4].items():
        if gref is None:
            continue
        e_ours, e_ds = rel(ours_r[4][n], gref), rel(ds[4][n], gref)
        assert e_ours < max(2 * e_ds, 2e-2), f"d {n}: ours {e_ours:.2e}, DeepSpeed {e_ds:.2e}"


# ------------------------------------------------------------------------- transformers
def test_hf_mixtral_bf16_logits_and_training_step():
    transformers = pytest.importorskip("transformers")
    from moe_overlap.integrations.transformers import replace_mixtral_moe

    cfg = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ref = copy.deepcopy(model).float()
    ids = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids)
        base = model(input_ids=ids, labels=ids)
        assert replace_mixtral_moe(model) == 2
        got = model(input_ids=ids, labels=ids)
    e_ours = rel(got.logits, want.logits)
    e_hf = rel(base.logits, want.logits)
    assert e_ours < max(2 * e_hf, 2e-2), f"logits: ours {e_ours:.2e}, HF bf16 {e_hf:.2e}"
    assert abs(got.loss.item() - want.loss.item()) < 2e-2 * abs(want.loss.item())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    opt.step()
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
