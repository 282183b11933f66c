"""Why does a case's time jump between timing rounds? (not a pytest file)

python tests/gpu/mode_probe.py PRESET OP [BLOCKS] [TARGET]  # OP: layer0 or layer1
                                                             # TARGET: fused or grouped_mm

The CLI's rounds give the fused layer 0 at mixtral-8x22b blocks of calls that are all ~18 ms
or all ~22 ms (H100, 2026-12-07), where ``grouped_mm`` beside it drifts by clock only. This
probe runs blocks of six calls of the fused op with blocks of the other baselines between them,
as the CLI's rounds do, and records per call the CUDA-event time, the host time to enqueue it
and the output's address, per block the mean SM clock and power (NVML), and whether a call
synchronizes with the host (``sync_debug_mode``).
Then the same blocks with the GPU held busy ahead of the host (``torch.cuda._sleep``), which
hides any host-side time.
"""

import statistics
import sys
import time

import torch

from moe_overlap import init_world
from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness
from moe_overlap.bench.presets import get_moe_shape

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from power_probe import _NVML, _Sampler  # noqa: E402


def main(preset, op, blocks=10, target="fused"):
    world = init_world()
    p = B.make_moe_problem(get_moe_shape(preset), 1, 0, torch.bfloat16, world.device)
    fused = harness.CANDIDATES[op]["fused"](p, world)
    others = [B.build_baseline(op, n, p, world) for n in ("grouped_mm", "unfused", "loop")]
    if target == "grouped_mm":  # the same blocks with the roles swapped
        fused, others[0] = others[0], fused
    for c in [fused, *others]:
        c.step(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fused.step(1)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    print(f"fused step: {len(w)} host syncs: {[str(x.message)[:100] for x in w[:3]]}")
    del out
    nvml = _NVML()
    sampler = _Sampler(nvml, period=0.005)
    sampler.start()
    calls = 2
    for ahead in (False, True):
        print(f"== {preset} {op} {target}, GPU held ahead of the host: {ahead}")
        for b in range(blocks):
            for c in others[b % 3 :] + others[: b % 3]:  # the CLI's other cases between blocks
                for _ in range(3):
                    c.step(calls)
                    calls += 1
            torch.cuda.synchronize()
            if ahead:
                torch.cuda._sleep(int(50e-3 * 1.9e9))  # ~50 ms of GPU cycles
            ev, host, ptr = [], [], []
            sampler.vals, sampler.on = [], True
            e0, t0 = nvml.energy_mj(), time.perf_counter()
            for _ in range(6):
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                a.record()
                out = fused.step(calls)
                e.record()
                host.append((time.perf_counter() - t) * 1e3)
                o = out[0] if isinstance(out, (tuple, list)) else out
                ptr.append(o.data_ptr())
                del out, o
                ev.append((a, e))
                calls += 1
            torch.cuda.synchronize()
            e1, t1 = nvml.energy_mj(), time.perf_counter()
            sampler.on = False
            mhz = statistics.fmean(sampler.vals) if sampler.vals else float("nan")
            ms = [a.elapsed_time(e) for a, e in ev]
            print(
                f"  block {b}: {' '.join(f'{v:.2f}' for v in ms)} ms | host "
                f"{statistics.median(host):.2f} ms/call | SM {mhz:.0f} MHz, "
                f"{(e1 - e0) / 1e3 / (t1 - t0):.0f} W (coarse: NVML's counter steps) | out at "
                f"{sorted({hex(q) for q in ptr})}"
            )


if __name__ == "__main__":
    a = sys.argv
    main(a[1], a[2], int(a[3]) if len(a) > 3 else 10, a[4] if len(a) > 4 else "fused")
