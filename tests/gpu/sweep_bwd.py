"""Block configs of the backward's dispatch GEMM (``d gu`` with the activation derivative in
its epilogue), timed alone on one GPU (not a pytest file).

python tests/gpu/sweep_bwd.py [preset ...]   # default mixtral-8x7b qwen3-30b-a3b
SWEEP_CONFIGS="128,256,64,8,3,8,4 ..." picks the configs (BM,BN,BK,warps,stages,GROUP_M[,EPI]);
a config may end in ``@N``: N persistent programs instead of one per SM (2 x SMs asks for two
co-resident programs per SM, where registers and shared memory allow).
Prints, per preset and config (``MOE_OVERLAP_L0B_CONFIG``), the median of
``triton.testing.do_bench`` and the rate on the GEMM's FLOPs, next to ``torch._grouped_mm`` on the
same rows, and checks every config's ``d gu`` against the first one's.
"""

import os
import sys
from types import SimpleNamespace

import torch
import triton.testing

from moe_overlap.bench.presets import get_moe_shape
from moe_overlap.experts import fused, tuning
from moe_overlap.world import init_world

CONFIGS = os.environ.get("SWEEP_CONFIGS", "").split() or (
    "128,128,64,8,4,8",
    "128,128,64,8,3,8",
    "128,128,64,8,4,16",
    "128,128,64,4,4,8",
    "128,64,64,4,4,8",
    "128,256,64,8,3,8",
    "128,256,64,8,3,8,2",
    "128,256,64,8,3,8,4",
    "128,256,64,8,4,8,4",
    "128,128,64,8,4,8,2",
)


def problem(name, dev=None, dt=torch.bfloat16, shape=None):
    """The backward dispatch GEMM's inputs at preset ``name`` (``shape`` (T, H, F, E, K)
    overrides its sizes), as the one-rank backward builds them: the layout, the saved gate/up
    from a training forward, ``dy * w`` gathered into rows. Also used by ``ab_layers.py``."""
    dev = dev or torch.device("cuda")
    world = init_world()
    s = get_moe_shape(name)
    T, H, F, E, K = shape or (s.tokens, s.hidden, s.ffn, s.experts, s.topk)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g) * 0.5).to(dev, dt)
    wts, ids = torch.randn(T, E, generator=g).to(dev).softmax(-1).topk(K, -1)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.02).to(dev, dt)
    w2 = (torch.randn(E, H, F, generator=g) * 0.02).to(dev, dt)
    dy = torch.randn(T, H, generator=g).to(dev, dt)
    pinned = tuning.pinned(dev, x.dtype, H, F, E, K)
    layout = fused.dispatch_layout(ids, E, world, None, pinned)
    ws = fused._workspace(world, layout, H, x.dtype)
    _, gu = fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws, save_gu=True)
    wflat = wts.contiguous().view(-1)
    row_scale = fused._bwd_row_scale(layout, wflat, fused._row_slots(layout, ws.slot))
    g_rows = fused._gather_rows(layout, dy, ws.recv, row_scale=row_scale)
    M = int((layout.expert_end - layout.expert_start).sum())
    ends = layout.expert_start + (layout.expert_end - layout.expert_start + 127) // 128 * 128
    return SimpleNamespace(
        world=world, T=T, H=H, F=F, E=E, K=K, x=x, ids=ids, w1=w1, w2=w2, dy=dy, layout=layout,
        ws=ws, gu=gu, wflat=wflat, row_scale=row_scale, g_rows=g_rows, M=M, ends=ends,
    )  # fmt: skip


def bwd_dispatch(p):
    """The backward's dispatch GEMM as the one-rank backward runs it (with the d topk_weights
    partials), on ``problem(...)``'s inputs."""
    return fused._bwd_dispatch(
        p.dy,
        p.layout,
        p.w2,
        p.world,
        p.wflat,
        p.row_scale,
        p.ws,
        p.gu,
        "swiglu",
        a_rows=p.g_rows,
        dw_slot=fused._dw_slot(p.layout, p.world, None, p.dy, p.F),
    )[0]


def run(name):
    p = problem(name)
    world, layout, g_rows, w2, ends = p.world, p.layout, p.g_rows, p.w2, p.ends
    flop = 2 * p.M * p.H * p.F
    # d h = g @ w2[e]: w2 [E, H, F] is already (contraction, output) per expert
    ms = triton.testing.do_bench(
        lambda: torch._grouped_mm(g_rows, w2, offs=ends.to(torch.int32)), return_mode="median"
    )
    print(f"== {name}: grouped_mm d h alone {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
    ref = None
    for cfg in CONFIGS:
        cfg, _, progs = cfg.partition("@")
        os.environ["MOE_OVERLAP_L0B_CONFIG"] = cfg
        world.max_programs = int(progs) if progs else 132

        try:
            out = bwd_dispatch(p)
            ms = triton.testing.do_bench(lambda: bwd_dispatch(p), return_mode="median")
        except Exception as e:  # a config that does not fit: say so, go on
            print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        real = layout.row_tok >= -1
        if ref is None:
            ref = out[real].float()
        err = ((out[real].float() - ref).norm() / ref.norm()).item()
        tag = cfg + (f"@{progs}" if progs else "")
        print(f"  {tag}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s  rel. diff {err:.1e}")
    os.environ.pop("MOE_OVERLAP_L0B_CONFIG", None)
    world.max_programs = 132


if __name__ == "__main__":
    for n in sys.argv[1:] or ["mixtral-8x7b", "qwen3-30b-a3b"]:
        run(n)
