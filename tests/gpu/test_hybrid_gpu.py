"""GPU tests of ``HybridBlock`` and the recipe's ``--tp`` mode (compiled Triton, one GPU).

* The block in bf16 on emulated ranks: W = 1 (sequential mode) and W = 2, 4 in the
  *concurrent* mode (one stream per rank; needed for backward, since autograd runs every
  thread's CUDA backward nodes on one worker thread and a sequential-mode host barrier there
  could never be met), with one rank's stream delayed before the forward and another's before
  the backward so the fused AG/RS and dispatch/combine tiles really wait on flags.
* Compared with the float64 unsharded reference (``moe_overlap.hybrid.reference_block``) fed
  the same bf16-rounded weights and inputs and **the expert choice the GPU made** (captured by
  a hook on the router): bf16 rounding may flip a near-tie in the top-k, which would move one
  token to another expert and fail an elementwise check for no fault of the block.
* The recipe with ``--tp``: bf16 W = 1, 2 agree loosely with the default mode and the loss
  falls; fp32 W = 1 matches the float64 twin.

Run with ``MOE_OVERLAP_COMPILED=1 python -m pytest -m gpu tests/gpu/test_hybrid_gpu.py``.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from moe_overlap import MoEConfig
from moe_overlap.hybrid import (
    HybridBlock,
    param_kind,
    reference_block,
    shard_full_weight,
    sync_replicated_grads,
)
from moe_overlap.recipe import ModelConfig, TrainConfig, train, train_twin
from moe_overlap.testing import assert_close, spawn
from moe_overlap.world import interpreted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(interpreted(), reason="GPU tests run compiled (without TRITON_INTERPRET)"),
]

BF16 = torch.bfloat16
SLEEP_CYCLES = 50_000_000  # ~25 ms at H200 clocks: far longer than the ops themselves
# Waits may span a peer's first JIT compile of a new variant (see tests/gpu/test_tp_gpu.py).
WAIT_NS = int(float(os.environ.get("MOE_OVERLAP_TEST_WAIT_S", "120")) * 1e9)
AUX_SCALE = 3.0

# Multiples of 8 everywhere so the bf16 grouped weight-gradient GEMMs take torch._grouped_mm.
H, N_HEADS, E, FF = 64, 4, 4, 32
CFG = MoEConfig(
    hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01
)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _full_weights(gen) -> dict:
    def r(*shape, fan_in):
        return torch.randn(*shape, generator=gen) / math.sqrt(fan_in)

    return {
        "attn_norm.weight": 1 + 0.2 * torch.randn(H, generator=gen),
        "attn.wqkv.weight": r(3 * H, H, fan_in=H),
        "attn.wo.weight": r(H, H, fan_in=H),
        "moe_norm.weight": 1 + 0.2 * torch.randn(H, generator=gen),
        "moe.router.weight": r(E, H, fan_in=H),
        "moe.experts.gate_up_proj": r(E, 2 * FF, H, fan_in=H),
        "moe.experts.down_proj": r(E, H, FF, fan_in=FF),
    }


def _bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).double()


def _bf16_torch(x, weights, topks, loss_fn):
    """The same block(s) in plain bf16 torch autograd on the GPU (same routing): the rounding
    noise a correct bf16 result may carry (``assert_close(..., baseline=)``). Returns the
    outputs, d x and the first block's weight grads, in fp32 on the CPU."""
    xb = x.to("cuda", BF16).requires_grad_()
    h, wbs, auxes = xb, [], []
    for w, topk in zip(weights, topks):
        wb = {k: v.to("cuda", BF16).requires_grad_() for k, v in w.items()}
        h, aux = reference_block(h, wb, CFG, N_HEADS, topk_ids=topk.to("cuda"))
        wbs.append(wb)
        auxes.append(aux)
    loss_fn(h, auxes).backward()
    grads = {k: v.grad.float().cpu() for k, v in wbs[0].items()}
    return h.detach().float().cpu(), xb.grad.float().cpu(), grads


@pytest.mark.parametrize(
    "W,S,B,delayed",
    [
        (1, 48, 3, None),
        pytest.param(2, 64, 2, 0, marks=pytest.mark.concurrent),
        pytest.param(2, 64, 2, 1, marks=pytest.mark.concurrent),
        pytest.param(4, 128, 1, 2, marks=pytest.mark.concurrent),
    ],
)
def test_block_bf16_matches_reference(W, S, B, delayed):
    gen = _gen("hybrid-gpu", W, S, B)
    w = _full_weights(gen)
    x = torch.randn(S, B, H, generator=gen)
    gy = torch.randn(S, B, H, generator=gen)
    s = S // W

    def fn(world):
        r = world.rank
        world.wait_budget = WAIT_NS
        blk = HybridBlock.from_full({k: v.to(BF16) for k, v in w.items()}, CFG, N_HEADS, world)
        ids = []
        blk.moe.router.register_forward_hook(lambda m, a, out: ids.append(out.topk_ids))
        rows = slice(r * s, (r + 1) * s)
        xs = x[rows].to("cuda", BF16).requires_grad_()
        if delayed is not None and r == delayed:
            torch.cuda._sleep(SLEEP_CYCLES)  # this rank's producers start late
        y = blk(xs)
        if delayed is not None and r == (delayed + 1) % W:
            torch.cuda._sleep(SLEEP_CYCLES)  # and in backward another rank is late
        aux_grad = torch.tensor(AUX_SCALE, dtype=blk.aux_loss.dtype, device="cuda")
        torch.autograd.backward([y, blk.aux_loss], [gy[rows].to("cuda", BF16), aux_grad])
        sync_replicated_grads(blk)
        world.check()
        grads = {n: p.grad.float().cpu() for n, p in blk.named_parameters()}
        return (
            y.detach().float().cpu(),
            blk.aux_loss.detach().cpu(),
            ids[0].cpu(),
            xs.grad.float().cpu(),
            grads,
        )

    mode = "concurrent" if W > 1 else "sequential"
    outs = spawn(W, fn, device="cuda", mode=mode)

    wd = {k: _bf16_rounded(v).requires_grad_() for k, v in w.items()}
    xd = _bf16_rounded(x).requires_grad_()
    topk = torch.cat([o[2] for o in outs])  # [S*B, K] in [S, B] token order
    y_ref, aux_ref = reference_block(xd, wd, CFG, N_HEADS, topk_ids=topk)
    ((y_ref * _bf16_rounded(gy)).sum() + AUX_SCALE * aux_ref).backward()

    gyb = gy.to("cuda", BF16)
    y_b, gx_b, g_b = _bf16_torch(
        x, [w], [topk], lambda y, a: (y.float() * gyb.float()).sum() + AUX_SCALE * a[0]
    )

    aux_total = sum(o[1].item() for o in outs)
    assert abs(aux_total - aux_ref.item()) <= 2e-2 * abs(aux_ref.item()), (aux_total, aux_ref)
    for r, (y, _, _, gx, grads) in enumerate(outs):
        rows = slice(r * s, (r + 1) * s)
        assert_close(y, y_ref[rows], dtype=BF16, name=f"y rank {r}", baseline=y_b[rows])
        assert_close(gx, xd.grad[rows], dtype=BF16, name=f"dx rank {r}", baseline=gx_b[rows])
        for name, g in grads.items():
            want = shard_full_weight(name, wd[name].grad, N_HEADS, r, W)
            base = shard_full_weight(name, g_b[name], N_HEADS, r, W)
            assert_close(
                g, want, dtype=BF16, name=f"d{name} ({param_kind(name)}) rank {r}", baseline=base
            )


def test_block_bf16_back_to_back_steps_concurrent():
    """Three forward/backward passes in a row through two chained blocks (W=2, rotating
    delays): ready epochs and flag reuse across calls, with the count all-reduces between."""
    W, S, B = 2, 32, 2
    gen = _gen("b2b")
    w1, w2 = _full_weights(gen), _full_weights(gen)
    xs_full = [torch.randn(S, B, H, generator=gen) for _ in range(3)]
    s = S // W

    def fn(world):
        r = world.rank
        world.wait_budget = WAIT_NS
        blocks = [
            HybridBlock.from_full({k: v.to(BF16) for k, v in w.items()}, CFG, N_HEADS, world)
            for w in (w1, w2)
        ]
        ids = [[], []]
        for i, blk in enumerate(blocks):
            blk.moe.router.register_forward_hook(
                lambda m, a, out, i=i: ids[i].append(out.topk_ids.cpu())
            )
        outs = []
        for it, x in enumerate(xs_full):
            if r == it % W:
                torch.cuda._sleep(SLEEP_CYCLES // 4)
            xs = x[r * s : (r + 1) * s].to("cuda", BF16).requires_grad_()
            y = blocks[1](blocks[0](xs))
            # This rank's share of sum(y^2) / (S*B*H) + both blocks' router losses.
            share = y.float().square().sum() / (S * B * H)
            (share + blocks[0].aux_loss + blocks[1].aux_loss).backward()
            outs.append((y.detach().float().cpu(), xs.grad.float().cpu()))
        world.check()
        return outs, ids

    res = spawn(W, fn, device="cuda", mode="concurrent")
    wd1 = {k: _bf16_rounded(v) for k, v in w1.items()}
    wd2 = {k: _bf16_rounded(v) for k, v in w2.items()}
    for it, x in enumerate(xs_full):
        topk1 = torch.cat([res[r][1][0][it] for r in range(W)])
        topk2 = torch.cat([res[r][1][1][it] for r in range(W)])
        xd = _bf16_rounded(x).requires_grad_()
        h, aux1 = reference_block(xd, wd1, CFG, N_HEADS, topk_ids=topk1)
        y_ref, aux2 = reference_block(h, wd2, CFG, N_HEADS, topk_ids=topk2)
        (y_ref.square().sum() / (S * B * H) + aux1 + aux2).backward()
        y_b, gx_b, _ = _bf16_torch(
            x,
            [w1, w2],
            [topk1, topk2],
            lambda y, a: y.float().square().sum() / (S * B * H) + a[0] + a[1],
        )
        for r in range(W):
            y, gx = res[r][0][it]
            rows = slice(r * s, (r + 1) * s)
            assert_close(
                y, y_ref[rows], dtype=BF16, name=f"y call {it} rank {r}", baseline=y_b[rows]
            )
            assert_close(
                gx, xd.grad[rows], dtype=BF16, name=f"dx call {it} rank {r}", baseline=gx_b[rows]
            )


# ---------------------------------------------------------------------------- recipe --tp
SMALL = ModelConfig(
    vocab_size=16,
    d_model=32,
    n_layers=2,
    n_heads=4,
    ffn_size=32,
    num_experts=4,
    top_k=2,
    seq_len=32,
)


def _tcfg(**kw) -> TrainConfig:
    base = dict(steps=8, batch=8, micro_batch=2, device="cuda", save=False, progress=False, seed=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.concurrent)])
def test_recipe_tp_bf16_agrees_with_default_mode(world_size):
    """Same model, same data: only bf16 rounding separates --tp from the default mode."""
    a = train(SMALL, _tcfg(steps=3, world_size=world_size, dtype="bf16"))
    b = train(SMALL, _tcfg(steps=3, world_size=world_size, dtype="bf16", tp=True))
    for x, y in zip(b.losses, a.losses):
        assert abs(x - y) <= 2e-2 * abs(y), (b.losses, a.losses)


@pytest.mark.concurrent
def test_recipe_tp_bf16_loss_falls_w2():
    res = train(SMALL, _tcfg(world_size=2, dtype="bf16", tp=True))
    assert len(res.losses) == 8
    assert all(math.isfinite(v) for v in res.losses)
    assert sum(res.losses[-3:]) / 3 < res.losses[0] - 0.1, res.losses
    assert abs(res.ce_losses[0] - math.log(SMALL.vocab_size)) < 0.2


def test_recipe_tp_fp32_w1_matches_float64_twin(monkeypatch):
    # fp32 needs BK = 32 in the fused MoE kernels on the H200 (shared memory; see
    # tests/gpu/test_recipe_gpu.py).
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", "128,128,32,8,3")
    monkeypatch.setenv("MOE_OVERLAP_L1_CONFIG", "128,256,32,8,3")
    tcfg = _tcfg(steps=5, world_size=1, dtype="fp32", batch=4, micro_batch=2, tp=True)
    res = train(SMALL, tcfg)
    twin = train_twin(SMALL, tcfg, dtype=torch.float64)
    for got, ref in zip(res.losses, twin.losses):
        assert abs(got - ref) <= 1e-3 * abs(ref), (res.losses, twin.losses)
