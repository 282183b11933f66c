"""Is a benchmark step slower back to back than alone? (not a pytest file)

python tests/gpu/clock_probe.py PRESET [case]      # default case MoELayer
Times the CLI's ``moe --backward`` step three ways with CUDA events: back to back (as the CLI
does), each step after a 20 ms GPU sleep (``torch.cuda._sleep``: the GPU idles, the host is
ahead), and back to back again; ``nvidia-smi`` samples the SM clock, power and throttle reasons
every 50 ms meanwhile. Steps that are faster after a rest, with the clock down during the
sustained run, mean the gap between a step's event time and its kernels' sum is the GPU's
power limit, not kernel boundaries.
"""

import subprocess
import sys

import torch

from moe_overlap import init_world
from moe_overlap.bench import baselines as B
from moe_overlap.bench.presets import get_moe_shape

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_step import _case  # noqa: E402


def _med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(preset, name):
    world = init_world()
    dev = world.device
    problem = B.make_moe_problem(get_moe_shape(preset), 1, 0, torch.bfloat16, dev, backward=True)
    case = _case(name, problem, world)
    for i in range(8):
        case.step(i)
    torch.cuda.synchronize()
    q = "clocks.sm,power.draw,clocks_event_reasons.active"
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-lms", "50"],
        stdout=subprocess.PIPE,
        text=True,
    )
    res = {}
    for phase in ("sustained", "rested", "sustained again"):
        ev = []
        for j in range(60):
            if phase == "rested":
                torch.cuda._sleep(int(20e-3 * 1.98e9))  # ~20 ms of GPU cycles
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            case.step(100 + j)
            b.record()
            ev.append((a, b))
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in ev]
        res[phase] = ms
        print(f"== {preset} {name} {phase}: median {_med(ms):.3f} ms, first 5 {ms[:5]}")
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    print(f"   nvidia-smi, {len(lines)} samples (clock, power, reasons):")
    for ln in lines[:: max(1, len(lines) // 40)]:
        print("   ", ln)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "MoELayer")
