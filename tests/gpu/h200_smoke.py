"""GPU smoke + quick benchmark of the fused MoE layers (one H200). Not a pytest file.

python tests/gpu/h200_smoke.py [--quick]
Prints correctness (bf16 vs fp32 torch on small shapes, emulated W=2 sequential and concurrent
with a delayed producer) and the layer-0 / layer-1 ratios to torch._grouped_mm.
"""

import json
import os
import sys
import time
import traceback

import torch
import triton.testing

import moe_overlap as mo
import moe_overlap.toy
from moe_overlap.experts import fused
from moe_overlap.testing import spawn

torch.manual_seed(0)
dev = torch.device("cuda")
RES = {}


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "smoke.json"), "w") as f:
        json.dump(RES, f, indent=1)


def ref_experts(x, ids, w, w1, w2):
    x = x.float()
    y = torch.zeros_like(x)
    F = w2.shape[2]
    for e in range(w1.shape[0]):
        t, k = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        a = x[t] @ w1[e].float().t()
        h = torch.nn.functional.silu(a[:, :F]) * a[:, F:]
        y.index_add_(0, t, (h @ w2[e].float().t()) * w[t, k, None].float())
    return y


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def correctness():
    T, H, F, E, K = 777, 512, 1000, 8, 2
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    ids[:100] = 3  # one hot expert
    ids[5, 1] = -1
    w = torch.rand(T, K, device=dev)
    w1 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.05
    t0 = time.time()
    y = mo.fused_experts(x, ids, w, w1, w2)
    torch.cuda.synchronize()
    RES["compile_s"] = time.time() - t0
    RES["w1_rel"] = rel(y, ref_experts(x, ids, w, w1, w2))
    # backward
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    w1g = w1.clone().requires_grad_()
    w2g = w2.clone().requires_grad_()
    y = mo.fused_experts(xg, ids, wg, w1g, w2g)
    dy = torch.randn_like(y)
    (y.float() * dy.float()).sum().backward()
    xr = x.float().requires_grad_()
    wr = w.clone().requires_grad_()
    w1r = w1.float().requires_grad_()
    w2r = w2.float().requires_grad_()
    yr = ref_experts(xr, ids, wr, w1r, w2r)
    (yr * dy.float()).sum().backward()
    RES["w1_bwd_rel"] = {
        n: rel(a.grad, b.grad)
        for n, a, b in (("x", xg, xr), ("w", wg, wr), ("w1", w1g, w1r), ("w2", w2g, w2r))
    }

    def toy(world):
        if world.rank == 0:
            world.producer_delay_cycles = 20_000_000
        xx = torch.full((64, 96), float(world.rank + 1), device=dev)
        out = mo.toy.push_allreduce(xx, world)
        world.check()
        return out[0, 0].item()

    for mode in ("sequential", "concurrent"):
        try:
            RES[f"toy_{mode}"] = spawn(3, toy, device="cuda", mode=mode)
        except Exception:  # noqa: BLE001
            RES[f"toy_{mode}_error"] = traceback.format_exc()[-2500:]
    for mode in ("sequential", "concurrent"):

        def rank_data(r):
            g = torch.Generator(device="cpu").manual_seed(10 + r)
            Tr = 300 + 77 * r
            xx = torch.randn(Tr, H, generator=g).to(dev, torch.bfloat16)
            ii = torch.randint(0, E, (Tr, K), generator=g).to(dev)
            ww = torch.rand(Tr, K, generator=g).to(dev)
            dy = torch.randn(Tr, H, generator=g).to(dev)
            return xx, ii, ww, dy

        def fn(world, mode):
            xx, ii, ww, dy = rank_data(world.rank)
            El = E // world.world_size
            sl = slice(world.rank * El, (world.rank + 1) * El)
            if world.rank == 0:
                world.producer_delay_cycles = 50_000_000
            xg = xx.clone().requires_grad_(mode == "concurrent")
            w1l = w1[sl].clone().requires_grad_(mode == "concurrent")
            yy = mo.fused_experts(xg, ii, ww, w1l, w2[sl], world=world)
            out = [rel(yy, ref_experts(xx, ii, ww, w1, w2))]
            if mode == "concurrent":
                (yy.float() * dy).sum().backward()
                # w1's gradient on this rank's experts sums every rank's tokens routed to them
                w1r = w1.float().requires_grad_()
                xr = xx.float().requires_grad_()
                loss = (ref_experts(xr, ii, ww, w1r, w2) * dy).sum()
                for r in range(world.world_size):
                    if r != world.rank:
                        xo, io, wo, do = rank_data(r)
                        loss = loss + (ref_experts(xo, io, wo, w1r, w2) * do).sum()
                loss.backward()
                out += [rel(xg.grad, xr.grad), rel(w1l.grad, w1r.grad[sl])]
            world.check()
            return out

        for W in (2,) if "--lean" in sys.argv else (2, 4):
            try:
                RES[f"emulated_{mode}_W{W}_rel"] = spawn(W, fn, mode, device="cuda", mode=mode)
            except Exception:  # noqa: BLE001
                RES[f"emulated_{mode}_W{W}_error"] = traceback.format_exc()[-2500:]


def bench(name, T, H, F, E, K):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    w, ids = logits.softmax(-1).topk(K, -1)
    w1 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.02
    world = mo.local_world()
    layout = fused.dispatch_layout(ids, E, world)
    h = fused.layer0(x, layout, w1, world)
    M = T * K
    # grouped_mm baseline on sorted rows, groups padded to 16 rows
    counts = torch.bincount(ids.flatten(), minlength=E)
    xs = x[ids.flatten().argsort() // K]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    hs = torch.randn(M, F, device=dev, dtype=torch.bfloat16)
    gm0 = lambda: torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    gm1 = lambda: torch._grouped_mm(hs, w2.transpose(-2, -1), offs=offs)
    f0 = lambda: fused.layer0(x, layout, w1, world)
    f1 = lambda: fused.layer1(h, layout, w, w2, world)
    order = ids.flatten().argsort()

    def unfused0():
        xx = x.index_select(0, order // K)
        a = torch._grouped_mm(xx, w1.transpose(-2, -1), offs=offs)
        return torch.nn.functional.silu(a[:, :F]) * a[:, F:]

    def unfused1():
        o = torch._grouped_mm(hs, w2.transpose(-2, -1), offs=offs)
        y = torch.zeros(T, H, device=dev, dtype=torch.float32)
        return y.index_add_(0, order // K, o.float() * w.flatten()[order, None])

    full = lambda: mo.fused_experts(x, ids, w, w1, w2, world=world)
    out = {}
    for key, fn, flops in (
        ("gmm0", gm0, 2 * M * H * 2 * F),
        ("fused0", f0, 2 * M * H * 2 * F),
        ("unfused0", unfused0, 2 * M * H * 2 * F),
        ("gmm1", gm1, 2 * M * F * H),
        ("fused1", f1, 2 * M * F * H),
        ("unfused1", unfused1, 2 * M * F * H),
        ("fused_experts", full, 2 * M * H * 3 * F),
    ):
        try:
            ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
        except Exception as e:  # noqa: BLE001 - report and keep measuring the others
            out[key] = dict(error=repr(e)[:300])
            continue
        out[key] = dict(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
    for a, b in (
        ("gmm0", "fused0"),
        ("gmm1", "fused1"),
        ("unfused0", "fused0"),
        ("unfused1", "fused1"),
    ):
        if "ms" in out[a] and "ms" in out[b]:
            out[f"{b}_vs_{a}"] = round(out[a]["ms"] / out[b]["ms"], 3)
    RES[name] = out
    dump()
    print(name, json.dumps(out), flush=True)


if __name__ == "__main__":
    import faulthandler

    # A hang prints every thread's stack (autograd's worker included) before the call's limit.
    faulthandler.dump_traceback_later(int(os.environ.get("SMOKE_DUMP_S", "0")) or 10**6)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if "--bench-first" in sys.argv:
        bench("mixtral-8x7b", 16384, 4096, 14336, 8, 2)
    try:
        correctness()
    except Exception as e:  # keep going to the benchmark
        traceback.print_exc()
        RES["correctness_error"] = repr(e)
    print(json.dumps(RES, indent=1), flush=True)
    dump()
    if "--no-bench" not in sys.argv and "--bench-first" not in sys.argv:
        bench("mixtral-8x7b", 16384, 4096, 14336, 8, 2)
        if "--quick" not in sys.argv:
            bench("qwen3-30b-a3b", 16384, 2048, 768, 128, 8)
            bench("deepseek-v3", 8192, 7168, 2048, 256, 8)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "smoke.json"), "w") as f:
        json.dump(RES, f, indent=1)
