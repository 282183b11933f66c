"""DeepSpeed drop-in: parity with deepspeed.moe.layer.MoE (output, l_aux, exp_counts, gradients),
checkpoint interchange, replace_moe_layers, and clear errors for what is not supported.

Both layers share one gate implementation (DeepSpeed's TopKGate), so with the same weights and
the same RNG state they route identically: l_aux and exp_counts must match exactly, the output
and gradients to fp32 accuracy (the experts' sums run in a different order)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

deepspeed = pytest.importorskip("deepspeed", reason="install with the [deepspeed] extra")

import moe_overlap  # noqa: E402
from moe_overlap.integrations import deepspeed as mods  # noqa: E402
from moe_overlap.integrations.deepspeed import MoE, parse_expert, replace_moe_layers  # noqa: E402
from moe_overlap.testing import assert_close  # noqa: E402

DSMoE = deepspeed.moe.layer.MoE
H, F, E = 16, 24, 4


class TwoLinear(nn.Module):
    """A custom (non-Sequential) Linear-act-Linear expert."""

    def __init__(self, act=None, bias=True):
        super().__init__()
        self.fc_in = nn.Linear(H, F, bias=bias)
        self.act = act if act is not None else nn.ReLU()
        self.fc_out = nn.Linear(F, H, bias=bias)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class SwiGLU(nn.Module):
    """Llama-style SwiGLU expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, names=("w1", "w3", "w2"), bias=False, scale=1.0):
        super().__init__()
        g, u, d = names
        self.names = names
        self.scale = scale
        setattr(self, g, nn.Linear(H, F, bias=bias))
        setattr(self, u, nn.Linear(H, F, bias=bias))
        setattr(self, d, nn.Linear(F, H, bias=bias))

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(nn.functional.silu(g(x)) * u(x)) * self.scale


def make_expert(kind):
    if kind == "gelu_seq":
        return nn.Sequential(nn.Linear(H, F), nn.GELU(), nn.Linear(F, H))
    if kind == "silu_seq_nobias":
        return nn.Sequential(
            nn.Linear(H, F, bias=False), nn.SiLU(), nn.Dropout(0.0), nn.Linear(F, H, bias=False)
        )
    if kind == "relu_module":
        return TwoLinear(nn.ReLU())
    if kind == "swiglu_w123":
        return SwiGLU()
    if kind == "swiglu_proj_bias":
        return SwiGLU(("gate_proj", "up_proj", "down_proj"), bias=True)
    raise ValueError(kind)


def build_pair(kind, seed=0, **kw):
    """A DeepSpeed layer and ours with the same weights (ours loaded from DeepSpeed's)."""
    torch.manual_seed(seed)
    args = dict(hidden_size=H, num_experts=E, min_capacity=0)
    args.update(kw)
    # Separate expert modules: a residual MoE keeps the module it was given as its dense MLP.
    ds = DSMoE(expert=make_expert(kind), **args)
    ours = MoE(expert=make_expert(kind), **args)
    ours.load_state_dict(ds.state_dict(), strict=True)
    return ds, ours


def run(layer, x, seed, used_token=None):
    torch.manual_seed(seed)  # the gate's random draws (RTS, 2nd-expert sampling, jitter)
    out, l_aux, counts = layer(x, used_token) if used_token is not None else layer(x)
    return out, l_aux, counts


def grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


# Pairwise over: k (1, 2, 3), drop_tokens, capacity, expert kinds, RNG-driven gate options,
# used_token, residual MoE, train/eval (eval_capacity_factor).
CASES = [
    dict(
        kind="gelu_seq",
        k=2,
        drop_tokens=True,
        capacity_factor=0.5,
        top2_2nd_expert_sampling=False,
        use_rts=False,
    ),
    dict(kind="swiglu_w123", k=2, drop_tokens=False, top2_2nd_expert_sampling=False, use_rts=False),
    dict(kind="relu_module", k=1, drop_tokens=True, capacity_factor=0.75, use_rts=False),
    dict(kind="silu_seq_nobias", k=1, drop_tokens=False, use_rts=False),
    dict(kind="swiglu_proj_bias", k=3, drop_tokens=True, capacity_factor=0.5),
    dict(
        kind="relu_module",
        k=2,
        drop_tokens=True,
        capacity_factor=1.0,
        use_rts=True,
        top2_2nd_expert_sampling=True,
    ),
    dict(
        kind="gelu_seq",
        k=1,
        drop_tokens=True,
        capacity_factor=1.0,
        use_rts=True,
        noisy_gate_policy="Jitter",
        used_token=True,
    ),
    dict(
        kind="swiglu_w123",
        k=2,
        drop_tokens=True,
        capacity_factor=0.5,
        use_residual=True,
        top2_2nd_expert_sampling=False,
        eval=True,
        eval_capacity_factor=0.5,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_parity_with_deepspeed(case):
    case = dict(case)
    kind = case.pop("kind")
    use_tok = case.pop("used_token", False)
    eval_mode = case.pop("eval", False)
    ds, ours = build_pair(kind, **case)
    if eval_mode:
        ds.eval()
        ours.eval()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, H, generator=g)
    dy = torch.randn(2, 9, H, generator=g)
    used = (torch.rand(18, generator=g) > 0.2).float() if use_tok else None
    res = {}
    for name, layer in (("ds", ds), ("ours", ours)):
        xi = x.clone().requires_grad_(True)
        out, l_aux, counts = run(layer, xi, seed=11, used_token=used)
        ((out * dy).sum() + 0.3 * l_aux).backward()
        res[name] = (out.detach(), l_aux.detach(), counts, xi.grad, grads(layer))
    (o0, a0, c0, gx0, gp0), (o1, a1, c1, gx1, gp1) = res["ds"], res["ours"]
    assert o1.shape == o0.shape and o1.dtype == o0.dtype
    assert torch.equal(a1, a0), (a1, a0)
    assert torch.equal(c1, c0), (c1, c0)
    assert_close(o1, o0, name="output")
    assert_close(gx1, gx0, name="d hidden_states")
    assert gp1.keys() == gp0.keys()
    for n in gp0:
        assert_close(gp1[n], gp0[n], name=f"d {n}")


def test_capacity_drops_are_exercised():
    """The drop cases above really drop routes (ids -1), and drop_tokens=False drops none."""
    _, ours = build_pair(
        "gelu_seq",
        k=2,
        drop_tokens=True,
        capacity_factor=0.5,
        top2_2nd_expert_sampling=False,
        use_rts=False,
    )
    x = torch.randn(18, H, generator=torch.Generator().manual_seed(7))
    ids, w, _, _ = ours._mo_route(x, None)
    assert (ids == -1).any() and (w[ids == -1] == 0).all()
    _, ours = build_pair(
        "gelu_seq", k=2, drop_tokens=False, top2_2nd_expert_sampling=False, use_rts=False
    )
    ids, _, _, _ = ours._mo_route(x, None)
    assert (ids >= 0).all()


def test_dense_gate_outputs_route_the_same(monkeypatch):
    """Older DeepSpeed gates return dense combine weights: the same routes are read from them."""
    ds, ours = build_pair(
        "relu_module",
        k=2,
        drop_tokens=True,
        capacity_factor=0.5,
        top2_2nd_expert_sampling=False,
        use_rts=False,
    )
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3))
    want = run(ds, x, seed=0)
    monkeypatch.setattr(mods, "_GATE_SPARSE_ROUTES", False)
    got = run(ours, x, seed=0)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    assert_close(got[0], want[0], name="output")


def test_runs_on_fused_experts(monkeypatch):
    calls = []
    real = moe_overlap.fused_experts

    def spy(*a, **k):
        calls.append(k.get("activation"))
        return real(*a, **k)

    monkeypatch.setattr(moe_overlap, "fused_experts", spy)
    _, ours = build_pair("swiglu_w123", k=2, use_rts=False, top2_2nd_expert_sampling=False)
    ours(torch.randn(5, H))
    assert calls == ["swiglu"]


def test_state_dict_round_trips_both_ways():
    ds, ours = build_pair("swiglu_proj_bias", k=2, use_rts=False, top2_2nd_expert_sampling=False)
    assert list(ours.state_dict()) == list(ds.state_dict())
    assert any(
        k.startswith("deepspeed_moe.experts.deepspeed_experts.3.") for k in ours.state_dict()
    )
    # ours -> a fresh DeepSpeed layer (different init) -> identical outputs
    torch.manual_seed(99)
    ds2 = DSMoE(
        hidden_size=H,
        expert=make_expert("swiglu_proj_bias"),
        num_experts=E,
        k=2,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    ds2.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(12, H)
    a, b = run(ds2, x, 0), run(ours, x, 0)
    assert_close(b[0], a[0])
    assert torch.equal(a[1], b[1])
    # and through a file, DeepSpeed -> ours
    import io

    buf = io.BytesIO()
    torch.save(ds2.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(5)
    ours2 = MoE(
        hidden_size=H,
        expert=make_expert("swiglu_proj_bias"),
        num_experts=E,
        k=2,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    ours2.load_state_dict(torch.load(buf), strict=True)
    assert_close(run(ours2, x, 0)[0], a[0])


def test_expert_params_keep_deepspeed_markers():
    _, ours = build_pair("gelu_seq", k=1, ep_size=2)
    experts = ours.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == E // 2
    for p in experts.parameters():
        assert p.allreduce is False and p.group_name == "ep_size_2"
    assert isinstance(ours, DSMoE)


def test_ep_without_group_raises_clearly():
    _, ours = build_pair("gelu_seq", k=1, ep_size=2)
    with pytest.raises(RuntimeError, match="deepspeed.initialize"):
        ours(torch.randn(8, H))


class Block(nn.Module):
    def __init__(self, kind, k):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe1 = DSMoE(
            H,
            make_expert(kind),
            num_experts=E,
            k=k,
            min_capacity=0,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            capacity_factor=0.75,
        )
        self.moe2 = DSMoE(
            H,
            make_expert(kind),
            num_experts=E,
            k=k,
            min_capacity=0,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            drop_tokens=False,
        )

    def forward(self, x):
        h = self.inp(x)
        a, l1, _ = self.moe1(h)
        b, l2, _ = self.moe2(a)
        return b, l1 + l2


def test_replace_moe_layers_keeps_outputs_and_parameters():
    torch.manual_seed(1)
    model = Block("swiglu_w123", k=2)
    x = torch.randn(3, 6, H)
    before, l_before = model(x)
    params = {n: p for n, p in model.named_parameters()}
    assert replace_moe_layers(model) == 2
    assert isinstance(model.moe1, MoE) and isinstance(model.moe2, MoE)
    assert {n: p for n, p in model.named_parameters()} == params  # same tensors, same names
    after, l_after = model(x)
    assert_close(after, before)
    assert torch.equal(l_after, l_before)
    assert replace_moe_layers(model) == 0
    # a layer passed directly converts too
    layer = DSMoE(H, make_expert("gelu_seq"), num_experts=E, min_capacity=0)
    assert replace_moe_layers(layer) == 1 and isinstance(layer, MoE)


BAD_EXPERTS = [
    (nn.Linear(H, H), "single nn.Linear"),
    (nn.Sequential(nn.Linear(H, F), nn.Linear(F, H)), "found 2 nn.Linear and 0 activation"),
    (nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H)), "Tanh"),
    (nn.Sequential(nn.Linear(H, F), nn.GELU(approximate="tanh"), nn.Linear(F, H)), "GELU"),
    (nn.Sequential(nn.Linear(H, F), nn.ReLU(), nn.Dropout(0.1), nn.Linear(F, H)), "Dropout"),
    (nn.Sequential(nn.Linear(H, F), nn.ReLU(), nn.Linear(F, 2 * H)), "hidden_size"),
    (SwiGLU(scale=2.0), "differs"),
    (TwoLinear(nn.GELU(approximate="tanh")), "GELU"),
]


@pytest.mark.parametrize("expert,match", BAD_EXPERTS, ids=[m for _, m in BAD_EXPERTS])
def test_bad_expert_modules_raise(expert, match):
    with pytest.raises(ValueError, match=match) as info:
        MoE(H, expert, num_experts=E)
    assert "Supported" in str(info.value) or "hidden_size" in str(info.value)


@pytest.mark.parametrize("option", ["use_tutel", "enable_expert_tensor_parallelism"])
def test_unsupported_options_raise(option):
    with pytest.raises(ValueError, match=option):
        MoE(H, make_expert("gelu_seq"), num_experts=E, **{option: True})


def test_replace_rejects_bad_layers_leaving_model_untouched():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "good": DSMoE(H, make_expert("gelu_seq"), num_experts=E),
            "bad": DSMoE(
                H, nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H)), num_experts=E
            ),
        }
    )
    with pytest.raises(ValueError, match="'bad'.*Tanh"):
        replace_moe_layers(model)
    assert type(model["good"]) is DSMoE


def test_bad_input_raises():
    _, ours = build_pair("gelu_seq", k=1)
    with pytest.raises(ValueError, match="hidden_states"):
        ours(torch.randn(4, H + 1))
    with pytest.raises(TypeError, match="hidden_states"):
        ours([1.0] * H)


def test_parse_expert_reports_layout():
    spec = parse_expert(make_expert("swiglu_proj_bias"), H)
    assert (spec.activation, spec.up, spec.down, spec.ffn_size) == (
        "swiglu",
        ("gate_proj", "up_proj"),
        "down_proj",
        F,
    )
    assert spec.has_b1 and spec.has_b2
    spec = parse_expert(make_expert("silu_seq_nobias"), H)
    assert (spec.activation, spec.up, spec.down) == ("silu", ("0",), "3")
    assert not spec.has_b1 and not spec.has_b2


def test_example_trains_under_deepspeed_initialize_and_checkpoints_experts(tmp_path):
    """examples/deepspeed_moe.py in its own process (deepspeed.initialize sets up a global
    process group): the engine sees the MoE layers, trains, writes per-expert checkpoint files,
    and plain DeepSpeed layers load them and compute the same outputs."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        str(root / "examples" / "deepspeed_moe.py"),
        "--steps",
        "2",
        "--save-dir",
        str(tmp_path),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "replaced 2 DeepSpeed MoE layers" in out and "step 1: loss" in out, out
    m = re.search(
        r"(\d+) expert files; plain DeepSpeed layers loaded it, max \|output "
        r"difference\| = ([0-9.e+-]+)",
        out,
    )
    assert m, out
    assert int(m.group(1)) == 8  # 2 layers x 4 experts
    assert float(m.group(2)) < 1e-4
