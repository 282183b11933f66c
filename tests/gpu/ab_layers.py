"""A/B of the fused MoE GEMMs under environment switches, in one process (not a pytest file).

python tests/gpu/ab_layers.py [preset ...]      # default qwen3-30b-a3b olmoe
AB="NAME=VAR=VALUE[+VAR=VALUE] ..." (default: the switches of the current experiment) picks the
variants; AB_WGRAD=0 leaves out the weight-gradient cases (their float32 d w1 alone is 28 GiB at
deepseek-v3, which does not fit an 80 GB H100 beside the weights). Per preset it times, in
interleaved rounds (``triton.testing.do_bench`` medians, the median over rounds),
``torch._grouped_mm`` on layer 0's GEMM, the backward's dispatch GEMM, layer 1's GEMM and the
backward's combine GEMM, then layer 0 (inference and with the saved pre-activations) under every
variant, and the backward's dispatch GEMM, layer 1 (GEMM and reduction) and the backward's
combine under the first variant and those whose switches concern them, and d w1 in
``grouped_mm`` against ``kernels/moe_wgrad.py`` (one program an SM, and one a tile at a config
that fits twice, and the Gluon kernel's WGRAD mode); it checks each variant's output against the
first one's.
"""

import os
import statistics
import sys

import torch
import triton.testing
from sweep_bwd import bwd_dispatch, problem  # this script's folder is on sys.path

from moe_overlap.experts import fused

AB = os.environ.get("AB", "").split() or [
    "default=",
    "triton=MOE_OVERLAP_L0_WS=0+MOE_OVERLAP_DACT_WS=0+MOE_OVERLAP_L1_WS=0",
    "carry=MOE_OVERLAP_WS_CARRY=1",
    "per-step=MOE_OVERLAP_WS_CARRY=0",
    "staged=MOE_OVERLAP_L0_STAGE=1",
]
ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))
WGRAD = os.environ.get("AB_WGRAD", "1") != "0"
CPU = os.environ.get("TRITON_INTERPRET") == "1"  # a logic check of this script, tiny and fp16


def variants():
    """``[(name, env)]``; every variant's env names every variable any variant sets (unset
    ones as None), so a variant never inherits the one before it."""
    out = []
    for spec in AB:
        name, _, assigns = spec.partition("=")
        out.append((name, dict(a.split("=", 1) for a in assigns.split("+") if a)))
    keys = {k for _, env in out for k in env}
    return [(name, {k: env.get(k) for k in keys}) for name, env in out]


def _set(env):
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run(name):
    dev = torch.device("cpu" if CPU else "cuda")
    dt = torch.float16 if CPU else torch.bfloat16
    p = problem(name, dev, dt, (40, 64, 48, 4, 2) if CPU else None)
    world, layout, ws, x, ids, w1, w2 = p.world, p.layout, p.ws, p.x, p.ids, p.w1, p.w2
    H, F, E, K, M, g_rows, ends = p.H, p.F, p.E, p.K, p.M, p.g_rows, p.ends
    sorted_x = x[torch.sort(ids.flatten(), stable=True).indices // K]
    offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(torch.int32)
    ends = layout.expert_start + (layout.expert_end - layout.expert_start + 127) // 128 * 128
    w1t = w1.transpose(1, 2)
    w2t = w2.transpose(1, 2)
    pends = ends.to(torch.int32)
    h, _ = fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws)
    row_slot = fused._row_slots(layout, ws.slot)
    d_gu = p.gu  # stands in for d gu: the combine's GEMM does not care what the rows hold
    cases = {
        "grouped_mm l0": (lambda: torch._grouped_mm(sorted_x, w1t, offs=offs), 4 * M * H * F),
        "grouped_mm bwd-d": (lambda: torch._grouped_mm(g_rows, w2, offs=pends), 2 * M * H * F),
        "grouped_mm l1": (lambda: torch._grouped_mm(h, w2t, offs=pends), 2 * M * H * F),
        "grouped_mm bwd-c": (lambda: torch._grouped_mm(d_gu, w1, offs=pends), 4 * M * H * F),
    }
    x_rows = fused._gather_rows(layout, x, ws.recv)
    wkeys = ("MOE_OVERLAP_WGRAD", "MOE_OVERLAP_WGRAD_GRID", "MOE_OVERLAP_WGRAD_CONFIG")
    wgrad_variants = (
        ("default", (None, None, None)),  # grouped_mm over the padded ranges
        ("kernel", ("kernel", None, None)),
        ("kernel-tiles", ("kernel", "tiles", "128,128,64,8,2")),
        ("ws", ("ws", None, None)),
    )
    for wname, vals in wgrad_variants if WGRAD else ():

        def wgrad(vals=vals):
            _set(dict(zip(wkeys, vals)))
            return fused._grouped_wgrad(d_gu, x_rows, layout, w1.dtype, world)

        cases[f"wgrad {wname}"] = (wgrad, 4 * M * H * F)
    var = variants()
    for vname, env in var:

        def l0(env=env):
            _set(env)
            return fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws)[0]

        def l0_train(env=env):
            _set(env)
            return fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws, save_gu=True)[0]

        def bwd_d(env=env):
            _set(env)
            return bwd_dispatch(p)

        def l1(env=env):
            _set(env)
            return fused._fwd_layer1(h, layout, p.wflat, w2, world, None, row_slot, ws)[0]

        def bwd_c(env=env):
            _set(env)
            return fused._bwd_combine(d_gu, layout, w1, world, row_slot, ws, H)

        cases[f"layer0 {vname}"] = (l0, 4 * M * H * F)
        cases[f"layer0+gu {vname}"] = (l0_train, 4 * M * H * F)
        named = [k for k, v in env.items() if v is not None]
        first_var = vname == var[0][0]
        if any(w in k for k in named for w in ("L0B", "DACT", "CARRY", "WS_SPLIT")) or first_var:
            cases[f"bwd-d {vname}"] = (bwd_d, 2 * M * H * F)
        if any(w in k for k in named for w in ("L1", "COMBINE", "CARRY", "WS_SPLIT")) or first_var:
            cases[f"layer1 {vname}"] = (l1, 2 * M * H * F)
            cases[f"bwd-c {vname}"] = (bwd_c, 4 * M * H * F)
    real = layout.row_tok >= 0
    first = {}
    for cname, (fn, _) in cases.items():
        if cname.startswith("grouped_mm") or (CPU and "grouped_mm" in cname):
            continue
        kind = cname.split()[0]
        out = fn()
        out = (out[real] if kind in ("layer0", "layer0+gu", "bwd-d") else out).float()
        if kind not in first:
            first[kind] = out
        else:
            err = ((out - first[kind]).norm() / first[kind].norm()).item()
            print(f"  {cname}: rel. diff to the first variant {err:.1e}", flush=True)
    times = {c: [] for c in cases}
    for _ in range(ROUNDS):
        for cname, (fn, _) in cases.items():
            ms = 1.0 if CPU else triton.testing.do_bench(fn, return_mode="median")
            times[cname].append(ms)
    print(f"== {name} (M {M}, {ROUNDS} rounds)")
    for cname, (_, flop) in cases.items():
        ms = statistics.median(times[cname])
        kind = cname.split()[0]
        ref = {"bwd-d": "grouped_mm bwd-d", "layer1": "grouped_mm l1", "bwd-c": "grouped_mm bwd-c",
               "wgrad": "wgrad default"}  # fmt: skip
        ref = ref.get(kind, "grouped_mm l0")
        r = statistics.median(times[ref]) / ms
        spread = " ".join(f"{t:.3f}" for t in times[cname])
        print(f"  {cname:28s} {ms:.3f} ms {flop / ms / 1e9:4.0f} TFLOP/s {r:.3f}x  ({spread})")
    _set({k: None for _, env in var for k in env})
    _set(dict.fromkeys(wkeys))


if __name__ == "__main__":
    for n in sys.argv[1:] or ["qwen3-30b-a3b", "olmoe"]:
        run(n)
