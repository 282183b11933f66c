"""Is the idle GPU time of an eager MoE step launch overhead? (not a pytest file)

python tests/gpu/graph_probe.py PRESET [case ...]   # default case: MoELayer
Builds the ``moe --backward`` case as the CLI does, times back-to-back eager steps (CUDA
events, as the CLI), then captures one step in a CUDA graph and times its replays. A replay
launches every kernel from the device with no host in between: what the eager step loses to
launches, between-kernel gaps and the host, the replay does not (the kernels are the same).
"""

import statistics
import sys

import torch
from profile_step import _case  # this script's folder is on sys.path

from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness as Hs
from moe_overlap.bench.presets import get_moe_shape


def _events(fn, n):
    """Median of ``n`` back-to-back calls ``fn(j)``, each between CUDA events (the CLI's timer)."""
    return statistics.median(Hs._timed_calls(fn, torch.device("cuda"), 0, n)["ms"])


def probe(preset, name, problem, world):
    case = _case(name, problem, world)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
        for i in range(6):
            case.step(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = _events(lambda j: case.step(8 + j), 20)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            case.step(0)
        torch.cuda.synchronize()
        replay = _events(lambda j: g.replay(), 20)
        print(
            f"== {preset} {name}: eager {eager:.3f} ms, graph replay {replay:.3f} ms "
            f"({eager - replay:+.3f} ms eager overhead)",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - a case that cannot be captured: say why
        print(f"== {preset} {name}: eager {eager:.3f} ms, capture failed: {e!r:.300}")


def main(preset, names):
    from moe_overlap import init_world

    world = init_world()
    dev = world.device
    problem = B.make_moe_problem(get_moe_shape(preset), 1, 0, torch.bfloat16, dev, backward=True)
    for name in names:
        probe(preset, name, problem, world)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["MoELayer"])
