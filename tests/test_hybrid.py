"""CPU tests of ``HybridBlock`` (TP attention + sequence parallel + EP experts on one world).

Emulated ranks on the Triton interpreter, fp32, against the unsharded float64 reference
(``moe_overlap.hybrid.reference_block``, whose MoE part is ``moe_overlap.reference``). Every
rank backpropagates its share of one global loss; then every gradient, sharded or replicated,
must equal the matching piece of the unsharded model's gradient. Sizes are tiny (H=16, E=4,
F=8): each block case takes about a second.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from moe_overlap import MoEConfig
from moe_overlap import reference as ref_mod
from moe_overlap.hybrid import (
    HybridBlock,
    apply_rope,
    causal_attention,
    param_kind,
    reference_block,
    rms_norm,
    rope_tables,
    shard_full_weight,
    sync_replicated_grads,
)
from moe_overlap.testing import assert_close, spawn
from moe_overlap.world import interpreted, local_world

pytestmark = pytest.mark.skipif(
    not interpreted(), reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py)"
)

H, E, FF = 16, 4, 8
AUX_SCALE = 3.0  # weight of the router losses in the test loss, so their gradient shows


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _cfg(variant: str) -> MoEConfig:
    if variant == "odd_world":
        # W = 3: H = 24 splits into 3 heads of 8, E = 6 into 2 experts per rank.
        return MoEConfig(
            hidden_size=24, ffn_hidden_size=FF, num_experts=6, top_k=3, aux_loss_coef=0.05
        )
    if variant == "bias_groups":
        # Selection-only correction bias (loaded from the full weights) + group-limited routing,
        # DeepSeek-V3's scores: sigmoid, the load-balance loss over normalized scores.
        return MoEConfig(
            hidden_size=H,
            ffn_hidden_size=FF,
            num_experts=E,
            top_k=2,
            score_func="sigmoid",
            aux_loss_scores="normalized",
            router_bias=True,
            n_group=2,
            topk_group=1,
            aux_loss_coef=0.05,
        )
    if variant == "shared_sigmoid":
        # Shared experts (replicated, sequence parallel), sigmoid scores, z-loss only: no
        # count all-reduce in the forward.
        return MoEConfig(
            hidden_size=H,
            ffn_hidden_size=FF,
            num_experts=E,
            top_k=2,
            score_func="sigmoid",
            n_shared_experts=1,
            aux_loss_coef=0.0,
            z_loss_coef=0.01,
        )
    return MoEConfig(
        hidden_size=H,
        ffn_hidden_size=FF,
        num_experts=E,
        top_k=2,
        aux_loss_coef=0.05,
        z_loss_coef=0.01,
    )


def _full_weights(gen, cfg: MoEConfig) -> dict:
    r = lambda *shape, s=0.3: torch.randn(*shape, generator=gen) * s  # noqa: E731
    H, E = cfg.hidden_size, cfg.num_experts
    w = {
        "attn_norm.weight": 1 + r(H, s=0.2),
        "attn.wqkv.weight": r(3 * H, H),
        "attn.wo.weight": r(H, H),
        "moe_norm.weight": 1 + r(H, s=0.2),
        "moe.router.weight": r(E, H, s=0.5),
        "moe.experts.gate_up_proj": r(E, 2 * FF, H),
        "moe.experts.down_proj": r(E, H, FF),
    }
    if cfg.n_shared_experts:
        fs = cfg.n_shared_experts * FF
        w["moe.shared_experts.gate_up_proj"] = r(2 * fs, H)
        w["moe.shared_experts.down_proj"] = r(H, fs)
    if cfg.router_bias:
        w["moe.router.e_score_correction_bias"] = r(E, s=0.2)
    return w


def _poison_workspace(world):
    # NaN bytes in the shared workspace: a gathered chunk or scattered partial that never
    # arrives shows up in the output.
    world.workspace(1).local.fill_(255)


CASES = [
    # W, n_heads, S, B, variant, impl
    (1, 2, 5, 3, "base", "fused"),
    (2, 4, 6, 2, "base", "fused"),
    (2, 2, 4, 3, "shared_sigmoid", "fused"),
    (2, 2, 2, 3, "bias_groups", "baseline"),
    (3, 3, 3, 2, "odd_world", "fused"),
    (4, 4, 8, 1, "base", "fused"),
]


@pytest.mark.parametrize("W,n_heads,S,B,variant,impl", CASES)
def test_block_forward_backward_matches_unsharded_reference(W, n_heads, S, B, variant, impl):
    cfg = _cfg(variant)
    H = cfg.hidden_size
    gen = _gen("hybrid", W, n_heads, S, B, variant)
    w = _full_weights(gen, cfg)
    x = torch.randn(S, B, H, generator=gen)
    gy = torch.randn(S, B, H, generator=gen)

    wd = {k: v.double().requires_grad_() for k, v in w.items()}
    xd = x.double().requires_grad_()
    y_ref, aux_ref, route = reference_block(xd, wd, cfg, n_heads, return_route=True)
    ((y_ref * gy.double()).sum() + AUX_SCALE * aux_ref).backward()

    s = S // W

    def fn(world):
        r = world.rank
        blk = HybridBlock.from_full(w, cfg, n_heads, world, impl=impl)
        rows = slice(r * s, (r + 1) * s)
        xs = x[rows].clone().requires_grad_()
        _poison_workspace(world)
        y = blk(xs)
        ((y * gy[rows]).sum() + AUX_SCALE * blk.aux_loss).backward()
        raw = {n: p.grad.clone() for n, p in blk.named_parameters()}
        n_synced = sync_replicated_grads(blk)
        world.check()
        grads = {n: p.grad.clone() for n, p in blk.named_parameters()}
        return y.detach(), blk.aux_loss.detach(), blk.expert_counts, xs.grad, raw, grads, n_synced

    outs = spawn(W, fn)
    aux_total = sum(o[1] for o in outs)
    assert abs(aux_total.item() - aux_ref.item()) <= 1e-5 * abs(aux_ref.item()) + 1e-7
    assert torch.equal(sum(o[2] for o in outs), route.counts)
    names = set(w) - {"moe.router.e_score_correction_bias"}  # a buffer, not a parameter
    n_repl = sum(param_kind(n) == "replicated" for n in names)
    for r, (y, _, _, gx, raw, grads, n_synced) in enumerate(outs):
        rows = slice(r * s, (r + 1) * s)
        assert n_synced == n_repl
        assert_close(y, y_ref[rows], name=f"y rank {r}")
        assert_close(gx, xd.grad[rows], name=f"dx rank {r}")
        assert set(grads) == names
        for name, g in grads.items():
            want = shard_full_weight(name, wd[name].grad, n_heads, r, W)
            assert_close(g, want, name=f"d{name} rank {r}")
            if param_kind(name) != "replicated":
                # Sharded tensors: the fused backward already summed every rank's part.
                assert torch.equal(raw[name], g), name
            else:
                # Replicated: each rank holds its tokens' part; the sync sums them.
                total = sum(o[4][name] for o in outs)
                assert torch.allclose(total, g, rtol=1e-6, atol=1e-7), name


def test_blocks_chain_with_explicit_rope_tables():
    """Two blocks back to back at W=2 with caller-built RoPE tables (the recipe's path)."""
    from moe_overlap.hybrid import rope_tables

    cfg, W, n_heads, S, B = _cfg("base"), 2, 2, 4, 2
    gen = _gen("chain")
    w1, w2 = _full_weights(gen, cfg), _full_weights(gen, cfg)
    x = torch.randn(S, B, H, generator=gen)
    xd = x.double()
    h, aux1 = reference_block(xd, {k: v.double() for k, v in w1.items()}, cfg, n_heads)
    y_ref, aux2 = reference_block(h, {k: v.double() for k, v in w2.items()}, cfg, n_heads)
    cos, sin = rope_tables(S, H // n_heads, 10000.0, torch.float32, "cpu")
    s = S // W

    def fn(world):
        r = world.rank
        b1 = HybridBlock.from_full(w1, cfg, n_heads, world)
        b2 = HybridBlock.from_full(w2, cfg, n_heads, world)
        with torch.no_grad():
            h = b1(x[r * s : (r + 1) * s], cos, sin)
            y = b2(h, cos, sin)
        return y, b1.aux_loss + b2.aux_loss

    outs = spawn(W, fn)
    for r, (y, _) in enumerate(outs):
        assert_close(y, y_ref[r * s : (r + 1) * s], name=f"y rank {r}")
    total = sum(o[1] for o in outs).item()
    assert abs(total - (aux1 + aux2).item()) <= 1e-5 * abs((aux1 + aux2).item())


def test_shard_full_weight_layout():
    W, n_heads, hd = 2, 4, H // 4
    full = torch.arange(3 * H * H, dtype=torch.float32).view(3 * H, H)
    q, k, v = full[:H], full[H : 2 * H], full[2 * H :]
    for r in range(W):
        heads = slice(r * 2 * hd, (r + 1) * 2 * hd)  # heads 2r, 2r+1
        got = shard_full_weight("layers.0.attn.wqkv.weight", full, n_heads, r, W)
        assert torch.equal(got, torch.cat([q[heads], k[heads], v[heads]]))
        wo = torch.randn(H, H)
        assert torch.equal(shard_full_weight("attn.wo.weight", wo, n_heads, r, W), wo[:, heads])
        ex = torch.randn(E, 3, 5)
        got = shard_full_weight("moe.experts.down_proj", ex, n_heads, r, W)
        assert torch.equal(got, ex[r * 2 : (r + 1) * 2])
        nw = torch.randn(H)
        assert shard_full_weight("moe_norm.weight", nw, n_heads, r, W) is nw
    assert param_kind("layers.3.attn.wo.weight") == "tensor"
    assert param_kind("moe.experts.gate_up_proj") == "expert"
    assert param_kind("moe.shared_experts.gate_up_proj") == "replicated"
    assert param_kind("moe.router.weight") == "replicated"
    with pytest.raises(ValueError, match="split"):
        shard_full_weight("attn.wqkv.weight", full, 3, 0, 2)


def test_reference_block_attention_is_causal_and_norm_in_fp32():
    """The reference's first position depends on no later position."""
    cfg, n_heads = _cfg("base"), 2
    w = {k: v.double() for k, v in _full_weights(_gen("causal"), cfg).items()}
    x = torch.randn(5, 2, H, generator=_gen("causal-x"), dtype=torch.float64)
    x2 = x.clone()
    x2[3:] += 1.0
    # Compare the attention residual only: the MoE part is per token too, so whole rows match.
    y1, _ = reference_block(x, w, cfg, n_heads)
    y2, _ = reference_block(x2, w, cfg, n_heads)
    assert torch.allclose(y1[:3], y2[:3], rtol=0, atol=1e-12)
    assert rms_norm(x.float(), torch.ones(H), 1e-5).dtype == torch.float32


# The block's reference shares its norm, RoPE and attention with the sharded block, so these
# are checked on their own against the formulas written out element by element.
def test_rms_norm_against_its_formula():
    g = _gen("rms")
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 3
    w = torch.randn(7, generator=g, dtype=torch.float64)
    want = torch.empty_like(x)
    for i in range(3):
        for j in range(5):
            row = x[i, j]
            want[i, j] = row / (sum(v * v for v in row.tolist()) / 7 + 1e-5) ** 0.5 * w
    assert torch.allclose(rms_norm(x, w, 1e-5), want, rtol=1e-12, atol=0)


def test_rope_rotates_each_pair_by_its_angle():
    """Rotate-half RoPE: element i pairs with i + d/2 and turns by p * theta^(-2i/d)."""
    S, d, theta = 6, 8, 500.0
    x = torch.randn(2, 3, S, d, generator=_gen("rope"), dtype=torch.float64)
    cos, sin = rope_tables(S, d, theta, torch.float64, "cpu")
    got = apply_rope(x, cos, sin)
    want = torch.empty_like(x)
    for p in range(S):
        for i in range(d // 2):
            a = p * theta ** (-2 * i / d)
            c, s_ = (
                torch.cos(torch.tensor(a, dtype=torch.float64)),
                torch.sin(torch.tensor(a, dtype=torch.float64)),
            )
            u, v = x[..., p, i], x[..., p, i + d // 2]
            want[..., p, i] = u * c - v * s_
            want[..., p, i + d // 2] = u * s_ + v * c
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # a rotation: norms kept, and position 0 unchanged
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    assert torch.equal(got[..., 0, :], x[..., 0, :])


def test_causal_attention_against_an_explicit_masked_softmax():
    B, S, D, n_heads = 2, 5, 8, 2
    hd = D // n_heads
    g = _gen("attn")
    x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    wqkv = torch.randn(3 * D, D, generator=g, dtype=torch.float64) / D**0.5
    wo = torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5
    cos, sin = rope_tables(S, hd, 10000.0, torch.float64, "cpu")
    got = causal_attention(x, wqkv, wo, n_heads, cos, sin)
    q, k, v = (x @ wqkv[i * D : (i + 1) * D].t() for i in range(3))
    out = torch.zeros(B, S, D, dtype=torch.float64)
    for h in range(n_heads):
        cols = slice(h * hd, (h + 1) * hd)
        qh = apply_rope(q[:, :, cols], cos, sin)  # [B, S, hd]: RoPE checked above
        kh = apply_rope(k[:, :, cols], cos, sin)
        for b in range(B):
            for t in range(S):
                scores = torch.stack([qh[b, t] @ kh[b, u] / hd**0.5 for u in range(t + 1)])
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                out[b, t, cols] = sum(p[u] * v[b, u, cols] for u in range(t + 1))
    assert torch.allclose(got, out @ wo.t(), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- bad input
def test_bad_construction():
    world = local_world("cpu")
    cfg = _cfg("base")
    with pytest.raises(ValueError, match="capacity_factor"):
        HybridBlock(
            MoEConfig(
                hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=2, capacity_factor=1.0
            ),
            2,
            world,
        )
    with pytest.raises(ValueError, match="even size"):
        HybridBlock(cfg, 16, world)  # head dim 1
    with pytest.raises(ValueError, match="n_heads"):
        HybridBlock(cfg, 0, world)
    with pytest.raises(TypeError, match="moe_cfg"):
        HybridBlock({"hidden_size": H}, 2, world)
    with pytest.raises(TypeError, match="world"):
        HybridBlock(cfg, 2, None)
    w = _full_weights(_gen("bad"), cfg)
    del w["moe_norm.weight"]
    with pytest.raises(ValueError, match="lack"):
        HybridBlock.from_full(w, cfg, 2, world)

    def heads_not_divisible(world):
        HybridBlock(cfg, 2, world)

    with pytest.raises(ValueError, match="divisible by the world size"):
        spawn(4, heads_not_divisible)


def test_bad_forward_input():
    world = local_world("cpu")
    cfg = _cfg("base")
    blk = HybridBlock.from_full(_full_weights(_gen("badfwd"), cfg), cfg, 2, world)
    with pytest.raises(ValueError, match=r"\[S/W, B, 16\]"):
        blk(torch.randn(4, H))
    with pytest.raises(ValueError, match=r"\[S/W, B, 16\]"):
        blk(torch.randn(4, 2, H + 1))
    with pytest.raises(TypeError, match="dtype"):
        blk(torch.randn(4, 2, H, dtype=torch.float64))
    cos = torch.ones(3, H // 2)
    with pytest.raises(ValueError, match="cos must be"):
        blk(torch.randn(4, 2, H), cos, cos)
    with pytest.raises(ValueError, match="both cos and sin"):
        blk(torch.randn(4, 2, H), torch.ones(4, H // 2), None)
    # a float64 RoPE table on an fp32 block: raised before the attention's first GEMM (SDPA
    # used to reject it after the fused all_gather_matmul had run)
    cos64 = torch.ones(4, H // 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="cos dtype"):
        blk(torch.randn(4, 2, H), cos64, cos64)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        blk(torch.randn(4, 2, H), [[1.0]], [[1.0]])


def test_tensor_parallel_attention_bad_input():
    from moe_overlap.hybrid import TensorParallelAttention

    def build(world):
        with pytest.raises(ValueError, match="divisible by the world size"):
            TensorParallelAttention(12, 3, world)
        with pytest.raises(ValueError, match="even size"):
            TensorParallelAttention(12, 4, world)  # head dim 3
        attn = TensorParallelAttention(16, 2, world)
        x = torch.randn(2, 1, 16)
        with pytest.raises(ValueError, match="needs cos and sin"):
            attn(x, None, None)
        with pytest.raises(ValueError, match=r"\[S/W, B, 16\]"):
            attn(torch.randn(2, 16), None, None)
        with pytest.raises(ValueError, match="cos must be"):
            attn(x, torch.ones(3, 8), torch.ones(3, 8))
        return True

    assert all(spawn(2, build))


def test_reference_matches_moe_reference_on_identity_attention():
    """With zero attention weights the block is x + MoE(norm(x)): the reference is exactly
    ``reference.moe_layer`` on all S*B tokens (one aux unit)."""
    cfg, n_heads = _cfg("base"), 2
    w = {k: v.double() for k, v in _full_weights(_gen("ident"), cfg).items()}
    w["attn.wo.weight"] = torch.zeros(H, H, dtype=torch.float64)
    x = torch.randn(4, 3, H, generator=_gen("ident-x"), dtype=torch.float64)
    y, aux = reference_block(x, w, cfg, n_heads)
    a = rms_norm(x, w["moe_norm.weight"], 1e-5)
    m, aux_m = ref_mod.moe_layer(
        a, w["moe.router.weight"], w["moe.experts.gate_up_proj"], w["moe.experts.down_proj"], cfg
    )
    assert torch.allclose(y, x + m, rtol=0, atol=1e-12)
    assert torch.allclose(aux, aux_m, rtol=0, atol=1e-15)


@pytest.mark.parametrize("variant", ["base", "shared_sigmoid"])
def test_reference_with_imposed_routing(variant):
    """``topk_ids`` equal to the reference's own choice changes nothing (the GPU tests impose
    a bf16 run's choice); other ids change the output and the load-balance counts."""
    cfg, n_heads = _cfg(variant), 2
    w = {k: v.double() for k, v in _full_weights(_gen("forced", variant), cfg).items()}
    x = torch.randn(4, 2, H, generator=_gen("forced-x"), dtype=torch.float64)
    y, aux, route = reference_block(x, w, cfg, n_heads, return_route=True)
    y2, aux2, route2 = reference_block(
        x, w, cfg, n_heads, return_route=True, topk_ids=route.topk_ids
    )
    assert torch.allclose(y, y2, rtol=0, atol=1e-12)
    assert torch.allclose(aux, aux2, rtol=0, atol=1e-14)
    assert torch.equal(route.counts, route2.counts)
    other = (route.topk_ids + 1) % E
    y3, _, route3 = reference_block(x, w, cfg, n_heads, return_route=True, topk_ids=other)
    assert not torch.allclose(y, y3)
    assert torch.equal(route3.counts, torch.bincount(other.reshape(-1), minlength=E))
    with pytest.raises(ValueError, match="topk_ids"):
        reference_block(x, w, cfg, n_heads, topk_ids=other[:, :1])
