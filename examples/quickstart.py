"""Quickstart: the toy fused op ``push_allreduce`` across 4 emulated ranks.

Every rank pushes its tiles of ``x [M, N]`` into every peer's symmetric buffer and raises one
flag per (source, tile); every consumer tile waits for its flags (bounded waits) and sums in
rank order. Without CUDA the kernels run in the Triton interpreter on the CPU (slow, exact);
with CUDA the ranks share one GPU. The result is checked against a float64 sum.

    python examples/quickstart.py [--world-size 4] [--shape 48 80] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# Triton reads TRITON_INTERPRET when the kernels are decorated (at import): decide first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_overlap.testing import assert_close, spawn  # noqa: E402
from moe_overlap.toy import push_allreduce  # noqa: E402
from moe_overlap.world import interpreted  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--shape", type=int, nargs=2, default=(48, 80), metavar=("M", "N"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--calls", type=int, default=3, help="back-to-back calls on the same world")
    args = p.parse_args(argv)
    W, (M, N), dtype = args.world_size, args.shape, DTYPES[args.dtype]
    if interpreted():
        device, where = "cpu", "on the CPU (Triton interpreter)"
    else:
        device = "cuda"
        where = f"on one GPU ({torch.cuda.get_device_name()}), sequential emulation"

    def inputs(rank, call):
        g = torch.Generator().manual_seed(1000 * call + rank)
        return torch.randn(M, N, generator=g).to(dtype)

    def rank_fn(world):
        outs, times = [], []
        for call in range(args.calls):  # back to back on the same world
            x = inputs(world.rank, call).to(world.device)
            t0 = time.perf_counter()
            out = push_allreduce(x, world)
            world.check()  # raises CommTimeoutError if a bounded wait gave up
            if world.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            outs.append(out.cpu())
        return outs, times

    print(f"moe_overlap quickstart: push_allreduce across {W} emulated ranks {where}")
    print(f"  each rank: x [{M}, {N}] {args.dtype}, fresh random data; out = sum over ranks")
    per_rank = spawn(W, rank_fn, device=device)
    worst = 0.0
    for call in range(args.calls):
        outs = [per_rank[r][0][call] for r in range(W)]
        ref = sum(inputs(r, call).double() for r in range(W))
        for r, out in enumerate(outs):
            assert_close(out, ref, dtype=dtype, name=f"call {call} rank {r}")
        same = all(torch.equal(o, outs[0]) for o in outs)
        err = max((o.double() - ref).abs().max().item() for o in outs)
        worst = max(worst, err)
        dt = per_rank[0][1][call]
        note = ""
        if call == 0:
            note = (
                " (first call: allocations" + ("" if interpreted() else " + Triton compile") + ")"
            )
        print(
            f"  call {call}: {dt * 1e3:8.1f} ms on rank 0, max |out - float64 sum| = {err:.3g}, "
            f"all ranks bitwise equal: {same}{note}"
        )
        if not same:
            print("FAILED: ranks disagree", file=sys.stderr)
            return 1
    print(f"OK: {args.calls} calls x {W} ranks match the float64 sum (max error {worst:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
