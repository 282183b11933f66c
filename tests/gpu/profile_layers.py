"""Where the fused MoE layers' time goes, next to torch._grouped_mm (not a pytest file).

python tests/gpu/profile_layers.py [preset ...]   # default mixtral-8x7b
Times each layer two ways on the benchmark CLI's own problem (back-to-back CUDA events, as
``moe_overlap.bench`` does, and ``triton.testing.do_bench``, which flushes L2 between calls, as
``tune`` does), then lists the kernels of one profiled call of each fused layer.
"""

import statistics
import sys

import torch
import triton.testing

from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness as Hn
from moe_overlap.bench.presets import get_moe_shape
from moe_overlap.world import init_world


def back_to_back(step, n=20):
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    for i, (a, b) in enumerate(ev):
        a.record()
        step(i)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def run(preset):
    world = init_world()
    s = get_moe_shape(preset)
    p = B.make_moe_problem(s, 1, 0, torch.bfloat16, "cuda")
    cases = {
        "l0 grouped_mm": B.build_baseline("layer0", "grouped_mm", p, world),
        "l0 fused": Hn._cand_layer0(p, world),
        "l1 grouped_mm": B.build_baseline("layer1", "grouped_mm", p, world),
        "l1 fused": Hn._cand_layer1(p, world),
    }
    print(f"== {preset}: {len(p.sets)} input sets")
    for name, c in cases.items():
        t1 = back_to_back(c.step)
        t2 = triton.testing.do_bench(lambda c=c: c.step(0), warmup=5, rep=30, return_mode="median")
        t3 = triton.testing.do_bench(lambda c=c: c.step(1), warmup=5, rep=30, return_mode="median")
        print(
            f"{name:16s} back-to-back {t1:8.3f} ms   do_bench set0 {t2:8.3f} ms  set1 {t3:8.3f} ms"
        )
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name in ("l0 fused", "l1 fused"):
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(3):
                cases[name].step(i)
            torch.cuda.synchronize()
        print(f"-- {name}")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=12, max_name_column_width=60
            )
        )


if __name__ == "__main__":
    for n in sys.argv[1:] or ["mixtral-8x7b"]:
        run(n)
