"""Time and energy per call under the GPU's power cap (not a pytest file).

python tests/gpu/power_probe.py PRESET OP [LABEL=ENV=V+ENV=V ...]      # OP: layer0 or layer1

A long run of big GEMMs holds the card at its power limit (H100 and H200: 700 W, SM clock
1.2-1.6 GHz instead of 1.98; nvidia-smi reports SW power cap), and there a kernel's speed is
its energy per FLOP, not its speed at full clock. This probe first heats the card with
``grouped_mm`` for a few seconds, then times blocks of back-to-back calls of each case
(``grouped_mm``, the fused op, and the fused op under each ``LABEL=ENV=V`` variant, e.g.
``gm16=MOE_OVERLAP_L0_WS_CONFIG=256,64,3,16,184``), the order rotating over rounds, and reads
NVML's energy counter around each block (ctypes, no pynvml needed) and the SM clock while it
runs. Per case: median ms (CUDA events), TFLOP/s, joules per call, mean watts, mean SM clock.
"""

import ctypes
import statistics
import sys
import threading
import time

import torch

from moe_overlap import init_world
from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness
from moe_overlap.bench.presets import get_moe_shape
from moe_overlap.experts.tuning import _env


class _NVML:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.h = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h)) == 0

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        assert self.lib.nvmlDeviceGetTotalEnergyConsumption(self.h, ctypes.byref(v)) == 0
        return v.value

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        assert self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(v)) == 0  # NVML_CLOCK_SM
        return v.value


class _Sampler(threading.Thread):
    """The SM clock every ``period`` seconds while a block runs."""

    def __init__(self, nvml, period=0.02):
        super().__init__(daemon=True)
        self.nvml, self.on, self.vals, self.stop_ = nvml, False, [], False
        self.period = period

    def run(self):
        while not self.stop_:
            if self.on:
                self.vals.append(self.nvml.sm_mhz())
            time.sleep(self.period)


def _block(case, nvml, sampler, n, first):
    torch.cuda.synchronize()
    ev = []
    sampler.vals, sampler.on = [], True
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    for j in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        case.step(first + j)
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    e1, t1 = nvml.energy_mj(), time.perf_counter()
    sampler.on = False
    ms = [a.elapsed_time(b) for a, b in ev]
    mhz = statistics.fmean(sampler.vals) if sampler.vals else float("nan")
    return ms, (e1 - e0) / 1e3 / n, (e1 - e0) / 1e3 / (t1 - t0), mhz


def main(preset, op, variants, seconds=1.2, rounds=4):
    world = init_world()
    dev = world.device
    p = B.make_moe_problem(get_moe_shape(preset), 1, 0, torch.bfloat16, dev)
    floor = B.build_baseline(op, "grouped_mm", p, world)
    fused = harness.CANDIDATES[op]["fused"](p, world)
    cases = [("grouped_mm", floor, {}), ("fused", fused, {})]
    for v in variants:
        label, _, envs = v.partition("=")
        cases.append((label, fused, dict(kv.split("=", 1) for kv in envs.split("+"))))
    nvml = _NVML()
    sampler = _Sampler(nvml)
    sampler.start()
    est = {}
    for name, c, env in cases:  # compile and estimate each variant
        with _env(**env):
            for i in range(3):
                c.step(i)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i in range(3):
                c.step(i)
            torch.cuda.synchronize()
            est[name] = (time.perf_counter() - t) / 3
    t_end = time.perf_counter() + 4.0  # heat the card to its power limit
    i = 0
    while time.perf_counter() < t_end:
        floor.step(i)
        i += 1
        if i % 20 == 0:
            torch.cuda.synchronize()
    res = {name: {"ms": [], "j": [], "w": [], "mhz": []} for name, _, _ in cases}
    calls = 0
    for r in range(rounds):
        k = r % len(cases)
        for name, c, env in cases[k:] + cases[:k]:
            with _env(**env):
                c.step(calls)  # the variant's kernel is already compiled; one call to settle
                n = max(5, int(seconds / est[name]))
                ms, j, w, mhz = _block(c, nvml, sampler, n, calls)
            calls += n + 1
            res[name]["ms"] += ms
            res[name]["j"].append(j)
            res[name]["w"].append(w)
            res[name]["mhz"].append(mhz)
            print(
                f"  round {r} {name:12s} {statistics.median(ms):8.3f} ms {j:7.3f} J/call "
                f"{w:6.1f} W {mhz:6.0f} MHz (n={n})",
                flush=True,
            )
    sampler.stop_ = True
    g = statistics.median(res["grouped_mm"]["ms"])
    gj = statistics.median(res["grouped_mm"]["j"])
    print(
        f"== {preset} {op} on {torch.cuda.get_device_name()} ({rounds} rounds, "
        f"{seconds} s blocks, after 4 s of heating)"
    )
    print(
        f"{'case':12s} {'ms':>8s} {'TFLOP/s':>8s} {'vs gmm':>7s} {'J/call':>7s} {'vs gmm':>7s}"
        f" {'W':>6s} {'MHz':>6s}"
    )
    for name, _, _ in cases:
        m = statistics.median(res[name]["ms"])
        j = statistics.median(res[name]["j"])
        print(
            f"{name:12s} {m:8.3f} {fused.flops / m / 1e9:8.1f} {g / m:6.3f}x {j:7.3f} "
            f"{j / gj:6.3f}x {statistics.fmean(res[name]['w']):6.1f} "
            f"{statistics.fmean(res[name]['mhz']):6.0f}"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
