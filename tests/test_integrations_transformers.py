"""HF transformers integration: tiny randomly initialised models (fp32) give the same logits,
losses, router logits and gradients before and after their experts move to fused_experts.

transformers 5.x goes through the experts-implementation interface, 4.x through the block
replacement; each path's tests skip under the other major version. CI runs this file twice, with
5.x and with 4.x (``ci-requirements-transformers4.txt``); ``MOE_OVERLAP_EXPECT_TRANSFORMERS``
(a major version) turns a different installed one into a failure, so a pass that meant to test
one path cannot quietly skip it."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="install with the [transformers] extra")

import moe_overlap  # noqa: E402
from moe_overlap.integrations import transformers as mot  # noqa: E402
from moe_overlap.testing import assert_close  # noqa: E402

V5 = mot.HAS_EXPERTS_INTERFACE
_EXPECT = os.environ.get("MOE_OVERLAP_EXPECT_TRANSFORMERS")
if _EXPECT and transformers.__version__.split(".")[0] != _EXPECT:
    raise RuntimeError(
        f"MOE_OVERLAP_EXPECT_TRANSFORMERS={_EXPECT} but transformers {transformers.__version__} "
        f"is the one imported (from {transformers.__file__})"
    )
needs_v5 = pytest.mark.skipif(not V5, reason=f"transformers {transformers.__version__} < 5")
needs_v4 = pytest.mark.skipif(
    V5, reason=f"4.x path; transformers {transformers.__version__} is installed"
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    output_router_logits=True,
)


def tiny(family: str):
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            **TINY,
        )
        return transformers.MixtralForCausalLM(cfg).float()
    if family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=40,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=40,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            **TINY,
        )
        return transformers.Qwen2MoeForCausalLM(cfg).float()
    if family == "olmoe":
        cfg = transformers.OlmoeConfig(
            intermediate_size=20, num_experts=5, num_experts_per_tok=2, **TINY
        )
        return transformers.OlmoeForCausalLM(cfg).float()
    if family == "phimoe":
        cfg = transformers.PhimoeConfig(
            intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **TINY
        )
        return transformers.PhimoeForCausalLM(cfg).float()
    raise ValueError(family)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 7), generator=g)


@pytest.fixture
def spy(monkeypatch):
    """Count fused_experts calls, so a test knows the fused path really ran."""
    calls = []
    real = moe_overlap.fused_experts

    def wrapped(*a, **k):
        calls.append(k.get("activation"))
        return real(*a, **k)

    monkeypatch.setattr(moe_overlap, "fused_experts", wrapped)
    return calls


def forward(model, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    return out


@pytest.mark.parametrize("family", ["mixtral"])
def test_mixtral_logits_loss_and_training_step_match(family, spy):
    model = tiny(family)
    model.train()  # the loss path HF trains with (Mixtral has no jitter by default)
    ids = batch()
    before = forward(model, ids)
    before.loss.backward()
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    names = [n for n, _ in model.named_parameters()]

    assert mot.replace_mixtral_moe(model) == 2
    assert [n for n, _ in model.named_parameters()] == names
    assert spy == []
    after = forward(model, ids)
    assert len(spy) == 2  # one fused_experts call per MoE layer
    assert_close(after.logits, before.logits, name="logits")
    assert_close(after.loss, before.loss, name="loss")
    assert_close(after.aux_loss, before.aux_loss, name="aux_loss")
    # HF's router logits still come out (the first layer's bitwise: same input, same router)
    assert torch.equal(after.router_logits[0], before.router_logits[0])
    for a, b in zip(after.router_logits, before.router_logits):
        assert_close(a, b, name="router_logits")
    after.loss.backward()
    for n, p in model.named_parameters():
        assert_close(p.grad, grads_before[n], name=f"d {n}")
    # a training step runs and changes the experts
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    experts0 = [p.detach().clone() for n, p in model.named_parameters() if "experts" in n]
    opt.step()
    experts1 = [p for n, p in model.named_parameters() if "experts" in n]
    assert all(not torch.equal(a, b) for a, b in zip(experts0, experts1))
    assert torch.isfinite(forward(model, ids).loss)


@needs_v5
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "phimoe"])
def test_other_families_with_the_same_layout(family, spy):
    model = tiny(family).eval()
    ids = batch()
    with torch.no_grad():
        before = forward(model, ids)
        n = mot.replace_mixtral_moe(model)
        after = forward(model, ids)
    assert n == 2 and len(spy) == 2
    assert_close(after.logits, before.logits, name="logits")
    assert_close(after.aux_loss, before.aux_loss, name="aux_loss")


@needs_v5
def test_from_pretrained_with_the_registered_implementation(tmp_path, spy):
    model = tiny("mixtral").eval()
    model.save_pretrained(tmp_path)
    ids = batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    mot.register()
    loaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, experts_implementation=mot.IMPLEMENTATION, dtype=torch.float32
    ).eval()
    assert loaded.config._experts_implementation == mot.IMPLEMENTATION
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert len(spy) == 2
    assert_close(got, want, name="logits")
    # and back to HF's own implementation
    loaded.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        loaded(input_ids=ids)
    assert len(spy) == 2


# ------------------------------------------------------------------ layouts of 5.x experts
def _experts_cls(**flags):
    """An experts class with the given @use_experts_implementation layout flags."""
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config, E=5, H=12, F=10, act="silu"):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            gated = flags.get("has_gate", True)
            rows = 2 * F if gated else F
            w1 = torch.randn(E, rows, H, generator=g) / H**0.5
            w2 = torch.randn(E, H, F, generator=g) / F**0.5
            if flags.get("is_transposed", False):
                w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
            setattr(self, "gate_up_proj" if gated else "up_proj", nn.Parameter(w1))
            self.down_proj = nn.Parameter(w2)
            if flags.get("has_bias", False):
                setattr(
                    self,
                    "gate_up_proj_bias" if gated else "up_proj_bias",
                    nn.Parameter(torch.randn(E, rows, generator=g)),
                )
                self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g))
            self.num_experts = E
            self.act_fn = ACT2FN[act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError("only the registered implementations run")

    return use_experts_implementation(**flags)(Experts)


def _run(module, impl, x, ids, w):
    module.config._experts_implementation = impl
    xi = x.clone().requires_grad_(True)
    wi = w.clone().requires_grad_(True)
    y = module(xi, ids, wi)
    g = torch.Generator().manual_seed(9)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return y.detach(), xi.grad, wi.grad, grads


LAYOUTS = [
    (dict(is_transposed=True, has_bias=True), "silu", False),
    (dict(has_gate=False), "gelu", False),
    (dict(has_gate=False, has_bias=True), "relu", True),
    (dict(), "silu", True),
]


@needs_v5
@pytest.mark.parametrize("flags,act,ep", LAYOUTS, ids=lambda v: str(v))
def test_experts_layouts_match_hf_batched_mm(flags, act, ep, spy):
    """Transposed, biased, ungated layouts and HF's EP sentinels (ids >= num_experts)."""
    mot.register()
    module = _experts_cls(**flags)(transformers.PretrainedConfig(), act=act)
    module._is_expert_parallel = ep
    g = torch.Generator().manual_seed(4)
    T, K, E = 11, 2, module.num_experts
    x = torch.randn(T, 12, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if ep:
        ids[::3, 1] = E + 2  # another rank's expert
    w = torch.rand(T, K, generator=g)
    if ep:
        w = torch.where(ids >= E, torch.zeros_like(w), w)  # HF zeroes them at dispatch
    want = _run(module, "batched_mm", x, ids, w)
    got = _run(module, mot.IMPLEMENTATION, x, ids, w)
    assert len(spy) == 1
    for name, a, b in zip(("y", "dx", "d weights"), got[:3], want[:3]):
        if ep and name == "d weights":
            a, b = a[ids < E], b[ids < E]
        assert_close(a, b, name=name)
    for n in want[3]:
        assert_close(got[3][n], want[3][n], name=f"d {n}")


@needs_v5
def test_unsupported_experts_raise_naming_the_feature():
    cfg = transformers.PretrainedConfig()
    post_norm = _experts_cls(has_post_expert_norm=True)(cfg)
    with pytest.raises(ValueError, match="has_post_expert_norm"):
        mot.check_experts(post_norm)
    with pytest.raises(ValueError, match="SiLU"):
        mot.check_experts(_experts_cls()(cfg, act="gelu"))  # a GeGLU
    with pytest.raises(ValueError, match="activation"):
        mot.check_experts(_experts_cls(has_gate=False)(cfg, act="gelu_pytorch_tanh"))
    gcfg = transformers.GptOssConfig(
        hidden_size=16,
        intermediate_size=8,
        num_local_experts=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    with pytest.raises(ValueError, match="is_concatenated=False"):
        mot.check_experts(GptOssExperts(gcfg), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="not a transformers experts module"):
        mot.check_experts(nn.Linear(2, 2))


@needs_v5
def test_replace_rejects_before_changing_anything():
    model = tiny("mixtral")
    bad = _experts_cls(has_post_expert_norm=True)(model.config)
    model.model.layers[1].mlp.experts = bad
    impl = model.config._experts_implementation
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts.*has_post_expert_norm"):
        mot.replace_mixtral_moe(model)
    assert model.config._experts_implementation == impl


def test_replace_on_a_model_without_moe_is_a_no_op():
    assert mot.replace_mixtral_moe(nn.Sequential(nn.Linear(4, 4))) == 0
    with pytest.raises(TypeError, match="model"):
        mot.replace_mixtral_moe("mixtral")


# ------------------------------------------------------------------ transformers 4.x
@needs_v4
def test_v4_mixtral_block_replacement(spy):
    model = tiny("mixtral")
    model.train()
    ids = batch()
    before = forward(model, ids)
    before.loss.backward()
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    assert mot.replace_mixtral_moe(model) == 2
    blocks = [m for m in model.modules() if isinstance(m, MixtralSparseMoeBlock)]
    assert len(blocks) == 2 and all(type(b) is not MixtralSparseMoeBlock for b in blocks)
    after = forward(model, ids)
    assert len(spy) == 2
    assert_close(after.logits, before.logits, name="logits")
    assert_close(after.aux_loss, before.aux_loss, name="aux_loss")
    after.loss.backward()
    for n, p in model.named_parameters():
        assert_close(p.grad, grads_before[n], name=f"d {n}")
    assert mot.replace_mixtral_moe(model) == 0


def test_example_runs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "hf_mixtral.py"
    spec = importlib.util.spec_from_file_location("hf_mixtral_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    res = example.main(["--steps", "2", "--seq", "8"])
    assert res["replaced"] == 2 and res["logits_diff"] < 1e-4
    assert all(torch.isfinite(torch.tensor(res["losses"])))
