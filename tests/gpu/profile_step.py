"""Where one benchmark step's GPU time goes (not a pytest file).

python tests/gpu/profile_step.py PRESET [case ...]   # default cases: fused_experts unfused
SEQ=1 also prints one step's kernels in launch order.
Builds the ``moe --backward`` problem and cases exactly as the CLI does (router, autograd.grad,
rotating inputs), then for each case: the CLI-style event time of back-to-back steps, and one
profile of three back-to-back steps split into kernel time per name and *idle GPU time* (the
step's GPU span minus the union of its kernels' intervals: launch gaps, host stalls). What
``profile_moe.py`` leaves out (the router and its backward, the grads' accumulation into x)
shows up here.
"""

import os
import sys
from collections import defaultdict

import torch

from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness as Hs
from moe_overlap.bench.presets import get_moe_shape


def _case(name, problem, world):
    if name in Hs.CANDIDATES["moe"]:
        return Hs.CANDIDATES["moe"][name](problem, world)
    return B.build_baseline("moe", name, problem, world)


def _union_ms(iv):
    iv.sort()
    tot, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        tot += cur_e - cur_s
    return tot / 1e3


def _print_gaps(kern, top: int = 12):
    """The largest idle stretches of the profiled steps, with the kernels on either side (where
    the GPU waited for the host: a sync, a slow launch, Python between launches)."""
    ks = sorted(kern, key=lambda e: e.time_range.start)
    gaps, end, prev = [], None, None
    for e in ks:
        if end is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name[:60], e.name[:60]))
        if end is None or e.time_range.end > end:
            end, prev = e.time_range.end, e
    gaps.sort(key=lambda g: -g[0])
    tot = sum(g[0] for g in gaps) / 1e3 / 3
    print(f"   idle between kernels {tot:.3f} ms a step; largest gaps (us, after -> before):")
    for us, a, b in gaps[:top]:
        print(f"   {us:8.1f}  {a}  ->  {b}")


def _print_sequence(kern) -> None:
    """The middle profiled step's kernels in launch order: start offset, duration and the idle
    time before each (us), so the small kernels a step could drop stand out."""
    ks = sorted(kern, key=lambda e: e.time_range.start)
    n = len(ks) // 3
    step = ks[n : 2 * n]
    t0, end = step[0].time_range.start, None
    print("   one step, in order (start, duration, idle before; us):")
    for e in step:
        gap = e.time_range.start - end if end is not None else 0.0
        print(f"   {e.time_range.start - t0:8.1f} {e.device_time:8.1f} {gap:6.1f}  {e.name[:90]}")
        end = e.time_range.end if end is None else max(end, e.time_range.end)


def _host_probe(case, first: int) -> None:
    """Host time of back-to-back steps (no sync inside the timed loop): at or above the GPU
    time, the host is the limit. Then one step under ``set_sync_debug_mode("error")``: the first
    synchronizing call raises, and its frames say where it is."""
    import time
    import traceback

    torch.cuda.synchronize()
    ts = []
    for i in range(20):
        t = time.perf_counter()
        case.step(first + i)
        ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    ts.sort()
    print(f"   host time per step {ts[len(ts) // 2]:.3f} ms (median of 20, no sync)")
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.step(first + 20)
        print("   no synchronizing call in a step")
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "moe_overlap" in f.filename]
        print(f"   a step synchronizes: {str(e)[:80]}")
        for f in frames[-4:]:
            print(f"     {f.filename.split('moe_overlap')[-1]}:{f.lineno} {f.line}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def main(preset, names):
    from moe_overlap import init_world

    world = init_world()
    dev = world.device
    problem = B.make_moe_problem(get_moe_shape(preset), 1, 0, torch.bfloat16, dev, backward=True)
    for name in names:
        case = _case(name, problem, world)
        for i in range(8):
            case.step(i)
        torch.cuda.synchronize()
        t = Hs._timed_calls(case.step, dev, 8, 20)["ms"]
        t.sort()
        print(f"== {preset} {name}: event time {t[len(t) // 2]:.3f} ms (median of 20)")
        _host_probe(case, 40)
        # CUDA activity only: tracing the CPU side too slows the host enough to open gaps of
        # its own (~200-300 us before most kernels on the H200, 2026-12-04)
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(3):
                case.step(30 + i)
            torch.cuda.synchronize()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        iv = [(e.time_range.start, e.time_range.end) for e in kern]
        span = (max(e for _, e in iv) - min(s for s, _ in iv)) / 1e3 / 3
        busy = _union_ms(iv) / 3
        print(
            f"   per step: GPU span {span:.3f} ms, kernels busy {busy:.3f} ms, idle"
            f" {span - busy:.3f} ms, {len(kern) // 3} kernels"
        )
        _print_gaps(kern)
        if os.environ.get("SEQ"):
            _print_sequence(kern)
        by = defaultdict(lambda: [0.0, 0])
        for e in kern:
            by[e.name[:80]][0] += e.device_time / 1e3 / 3
            by[e.name[:80]][1] += 1
        for k, (ms, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"   {ms:8.3f} ms  x{n // 3:<3d} {k}")
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["fused_experts", "unfused"])
