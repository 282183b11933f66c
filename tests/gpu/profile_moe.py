"""Kernel-level time breakdown of fused_experts forward+backward on one GPU (not a pytest file).

python tests/gpu/profile_moe.py [preset ...]   # default mixtral-8x7b
Prints, per preset, the forward and backward wall times (CUDA events) and the top kernels of one
profiled forward+backward (torch.profiler), so a slow step shows up by name. Each step drops
the leaves' grads first (accumulating into them added 0.87 ms of ``add_`` at qwen3-30b-a3b and
15.5 ms at deepseek-v3 to the 2026-12-03 evening profile, which the CLI, using
``autograd.grad``, never pays). The forward's event time starts on an idle GPU, so it includes
the host's launch latency; the kernel list is the GPU-side truth.
"""

import cProfile
import os
import pstats
import sys
import time

import torch

import moe_overlap as mo
from moe_overlap.bench.presets import get_moe_shape


def profile(name):
    dev = torch.device("cuda")
    s = get_moe_shape(name)
    T, H, F, E, K = s.tokens, s.hidden, s.ffn, s.experts, s.topk
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g) * 0.5).to(dev, torch.bfloat16).requires_grad_()
    w, ids = torch.randn(T, E, generator=g).to(dev).softmax(-1).topk(K, -1)
    w = w.requires_grad_()
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, F, generator=g) * 0.02).to(dev, torch.bfloat16)
    w1.requires_grad_()
    w2.requires_grad_()
    dy = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)

    leaves = (x, w, w1, w2)

    def step():
        for t in leaves:  # as after zero_grad(set_to_none=True): no accumulation kernels
            t.grad = None
        y = mo.fused_experts(x, ids, w, w1, w2)
        y.backward(dy)
        return y

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fw, bw = [], []
    for _ in range(5):
        for t in leaves:
            t.grad = None
        ev[0].record()
        y = mo.fused_experts(x, ids, w, w1, w2)
        ev[1].record()
        y.backward(dy)
        ev[2].record()
        torch.cuda.synchronize()
        fw.append(ev[0].elapsed_time(ev[1]))
        bw.append(ev[1].elapsed_time(ev[2]))
    fw.sort()
    bw.sort()
    print(f"== {name}: forward {fw[2]:.3f} ms, backward {bw[2]:.3f} ms (median of 5)")
    # Host time alone: a queued GPU sleep keeps the GPU busy, so the host never waits on it
    # (a hidden sync would show as ~100 ms here).
    hf, hb = [], []
    for _ in range(5):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        y = mo.fused_experts(x, ids, w, w1, w2)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        hf.append((t1 - t0) * 1e3)
        hb.append((t2 - t1) * 1e3)
        torch.cuda.synchronize()
    hf.sort()
    hb.sort()
    print(f"   host only: forward {hf[2]:.3f} ms, backward {hb[2]:.3f} ms (median of 5)")
    if os.environ.get("PROFILE_PY") == "1":
        # Host side: where the Python time of five steps goes (a CPU-bound layer shows here).
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=22, max_name_column_width=70
    )
    print(table, flush=True)
    n = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    print(f"GPU kernels/copies in one forward+backward: {n}")
    # Kernels in launch order with their own durations: which call of a kernel is the slow one.
    print("kernels in order (>= 50 us):")
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time >= 50:
            print(f"  {e.device_time / 1e3:8.3f} ms  {e.name[:90]}")


if __name__ == "__main__":
    for n in sys.argv[1:] or ["mixtral-8x7b"]:
        profile(n)
