"""Dense TP on real GPUs (one process per GPU, torch_symm world), against NCCL and PyTorch.

A torchrun script and a pytest test at once:

    torchrun --standalone --nproc_per_node=N tests/multigpu/test_tp_multigpu.py   # N >= 1

compares ``all_gather_matmul`` / ``matmul_reduce_scatter`` (forward and gradients, bf16) with
NCCL ``all_gather_into_tensor`` + mm and mm + ``reduce_scatter_tensor`` computed in fp32, and
with ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` where
this PyTorch has them (a failure to run those is reported, not fatal: they are a second
opinion, NCCL is the reference). It runs with one process on one GPU too. The pytest tests
launch it with one process (marked ``gpu``) and on every visible GPU (``multigpu``, >= 2).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

SHAPES = [(256, 512, 384), (1000, 1536, 520), (77, 300, 136)]  # (M / W, N, K)


def _tol_ok(actual, expected, name, failures, rank, rtol=3e-2):
    """Relative Frobenius error against an fp32 reference (bf16 tolerance)."""
    a, e = actual.float(), expected.float()
    if not torch.isfinite(a).all():
        failures.append(f"rank {rank}: {name}: non-finite values")
        return
    rel = ((a - e).norm() / (e.norm() + 1e-30)).item()
    if rel > rtol:
        failures.append(f"rank {rank}: {name}: relative error {rel:.3g} > {rtol}")


def _symm_fused(name):
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None:
        return None
    try:
        return getattr(ops, name)
    except (AttributeError, RuntimeError):
        return None


def _main() -> int:
    import torch.distributed as dist

    from moe_overlap import init_world
    from moe_overlap.tp import all_gather_matmul, matmul_reduce_scatter

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = init_world()
    W, r = world.world_size, world.rank
    group_name = dist.group.WORLD.group_name
    try:
        from torch.distributed import _symmetric_memory as symm

        symm.enable_symm_mem_for_group(group_name)
    except Exception as e:  # noqa: BLE001 - newer PyTorch needs no enabling
        print(f"rank {r}: enable_symm_mem_for_group: {e!r}")
    fused_ag = _symm_fused("fused_all_gather_matmul")
    fused_rs = _symm_fused("fused_matmul_reduce_scatter")
    failures: list[str] = []
    dev = torch.device("cuda", local_rank)
    bf16 = torch.bfloat16

    for Ms, N, K in SHAPES:
        gen = torch.Generator().manual_seed(1000 * Ms + 10 * r + 1)
        tag = f"Ms={Ms} N={N} K={K}"

        # -------------------------------------------------------------- all_gather_matmul
        x = torch.randn(Ms, K, generator=gen).to(dev, bf16).requires_grad_()
        w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(dev, bf16).requires_grad_()
        dy = torch.randn(W * Ms, N, generator=gen).to(dev, bf16)
        y = all_gather_matmul(x, w, world)
        y.backward(dy)
        world.check()
        xg = torch.empty(W * Ms, K, device=dev, dtype=torch.float32)
        dist.all_gather_into_tensor(xg, x.detach().float())
        wf, dyf = w.detach().float(), dy.float()
        _tol_ok(y, xg @ wf.T, f"AG y {tag}", failures, r)
        dx_full = dyf @ wf
        dx_ref = torch.empty(Ms, K, device=dev)
        dist.reduce_scatter_tensor(dx_ref, dx_full)
        _tol_ok(x.grad, dx_ref, f"AG dx {tag}", failures, r)
        _tol_ok(w.grad, dyf.T @ xg, f"AG dw {tag}", failures, r)
        if fused_ag is not None:
            try:
                _, outs = fused_ag(x.detach(), [w.detach().t()], 0, group_name)
                _tol_ok(y, outs[0], f"AG y vs symm_mem.fused_all_gather_matmul {tag}", failures, r)
            except Exception as e:  # noqa: BLE001 - second opinion only
                print(f"rank {r}: symm_mem.fused_all_gather_matmul did not run: {e!r}")

        # -------------------------------------------------------------- matmul_reduce_scatter
        x = torch.randn(W * Ms, K, generator=gen).to(dev, bf16).requires_grad_()
        w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(dev, bf16).requires_grad_()
        dy = torch.randn(Ms, N, generator=gen).to(dev, bf16)
        y = matmul_reduce_scatter(x, w, world)
        y.backward(dy)
        world.check()
        xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
        y_ref = torch.empty(Ms, N, device=dev)
        dist.reduce_scatter_tensor(y_ref, xf @ wf.T)
        _tol_ok(y, y_ref, f"RS y {tag}", failures, r)
        dyg = torch.empty(W * Ms, N, device=dev)
        dist.all_gather_into_tensor(dyg, dyf)
        _tol_ok(x.grad, dyg @ wf, f"RS dx {tag}", failures, r)
        _tol_ok(w.grad, dyg.T @ xf, f"RS dw {tag}", failures, r)
        if fused_rs is not None:
            try:
                out = fused_rs(x.detach(), w.detach().t(), "sum", 0, group_name)
                _tol_ok(y, out, f"RS y vs symm_mem.fused_matmul_reduce_scatter {tag}", failures, r)
            except Exception as e:  # noqa: BLE001 - second opinion only
                print(f"rank {r}: symm_mem.fused_matmul_reduce_scatter did not run: {e!r}")

    torch.cuda.synchronize()
    for f in failures:
        print("FAIL", f, flush=True)
    status = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(status)
    dist.barrier()
    dist.destroy_process_group()
    if r == 0:
        print(f"tp multigpu: world_size {W}: {'OK' if status.item() == 0 else 'FAILED'}")
    return 0 if status.item() == 0 else 1


def _torchrun(nproc: int) -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(__file__),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"torchrun failed:\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    assert "OK" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_tp_under_torchrun_one_process():
    """The torch_symm world at world_size 1: the same script, one process, one GPU."""
    _torchrun(1)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")
def test_tp_under_torchrun():
    _torchrun(torch.cuda.device_count())


if __name__ == "__main__":
    sys.exit(_main())
