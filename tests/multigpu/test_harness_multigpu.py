"""Multi-GPU harness runs that are commands rather than scripts: the benchmark CLI under
torchrun (fused ops against NCCL / symm_mem baselines on real ranks) and the DeepSpeed drop-in
with expert parallelism (ep_size = number of GPUs). Gated on GPU count; each test launches its
command with ``torchrun`` (or ``deepspeed``) and checks it exits cleanly."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs"),
]


def _run(cmd, timeout=600):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _torchrun(n, *args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        *args,
    ]


@pytest.mark.parametrize("op", ["layer0", "layer1", "moe"])
def test_bench_moe_ops_under_torchrun(op):
    n = min(torch.cuda.device_count(), 8)
    out = _run(
        _torchrun(
            n,
            "-m",
            "moe_overlap.bench",
            op,
            "--tokens",
            "2048",
            "--hidden",
            "1024",
            "--ffn",
            "1408",
            "--experts",
            str(2 * n),
            "--topk",
            "2",
            "--rep",
            "5",
            "--warmup",
            "2",
        )
    )
    assert "fused" in out


@pytest.mark.parametrize("op", ["ag-matmul", "matmul-rs"])
def test_bench_dense_ops_under_torchrun(op):
    n = min(torch.cuda.device_count(), 8)
    out = _run(
        _torchrun(
            n,
            "-m",
            "moe_overlap.bench",
            op,
            "-m",
            str(1024 * n),
            "-n",
            "2048",
            "-k",
            "1024",
            "--rep",
            "5",
            "--warmup",
            "2",
        )
    )
    assert "fused" in out


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_dropin_expert_parallel():
    n = min(torch.cuda.device_count(), 8)
    _run(
        [
            "deepspeed",
            f"--num_gpus={n}",
            "examples/deepspeed_moe.py",
            "--ep-size",
            str(n),
            "--experts",
            str(2 * n),
            "--hidden",
            "1024",
            "--ffn",
            "2048",
        ]
    )
