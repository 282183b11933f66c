"""The Mixtral-style recipe on one GPU: compiled Triton kernels, bf16 and fp32.

Run with ``MOE_OVERLAP_COMPILED=1 python -m pytest -m gpu tests/gpu/test_recipe_gpu.py``.
W = 2 runs two emulated ranks on the GPU in the concurrent mode (the recipe picks it).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_overlap.recipe import ModelConfig, TrainConfig, train, train_twin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Dimensions are multiples of 8 so the bf16 weight-gradient GEMMs take torch._grouped_mm.
SMALL = ModelConfig(
    vocab_size=16,
    d_model=32,
    n_layers=2,
    n_heads=4,
    ffn_size=32,
    num_experts=4,
    top_k=2,
    seq_len=32,
)
ROOT = Path(__file__).resolve().parents[2]


def _tcfg(**kw) -> TrainConfig:
    base = dict(steps=8, batch=8, micro_batch=2, device="cuda", save=False, progress=False, seed=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.concurrent)])
def test_bf16_loss_finite_and_falling(world_size):
    res = train(SMALL, _tcfg(world_size=world_size, dtype="bf16"))
    assert len(res.losses) == 8
    assert all(math.isfinite(v) for v in res.losses)
    assert sum(res.losses[-3:]) / 3 < res.losses[0] - 0.1, res.losses
    assert abs(res.ce_losses[0] - math.log(SMALL.vocab_size)) < 0.2


@pytest.mark.concurrent
def test_bf16_world_sizes_agree_loosely():
    """bf16 W=1 and W=2 run the same model and data: only rounding separates them."""
    a = train(SMALL, _tcfg(steps=3, world_size=1, dtype="bf16"))
    b = train(SMALL, _tcfg(steps=3, world_size=2, dtype="bf16"))
    for x, y in zip(a.losses, b.losses):
        assert abs(x - y) <= 2e-2 * abs(y)


@pytest.fixture
def fp32_blocks(monkeypatch):
    # The fused kernels' default GPU blocks are sized for 16-bit operands; in fp32 their
    # pipelined tiles need more shared memory than an H200 has (measured: 294912 > 232448
    # bytes), so fp32 runs pin BK = 32.
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", "128,128,32,8,3")
    monkeypatch.setenv("MOE_OVERLAP_L1_CONFIG", "128,256,32,8,3")


def test_fp32_w1_matches_float64_twin(fp32_blocks):
    tcfg = _tcfg(steps=5, world_size=1, dtype="fp32", batch=4, micro_batch=2)
    res = train(SMALL, tcfg)
    twin = train_twin(SMALL, tcfg, dtype=torch.float64)
    for got, ref in zip(res.losses, twin.losses):
        assert abs(got - ref) <= 1e-3 * abs(ref), (res.losses, twin.losses)


def test_cli_on_gpu_and_torchrun_one_process(tmp_path):
    """The example script on the GPU (defaults: bf16, W=1), then under torchrun with one
    process (the torch_symm world), resuming the first run's checkpoint."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = str(ROOT / "examples" / "train_mixtral.py")
    common = ["--out", str(tmp_path), "--no-progress", "--world-size", "1"]
    r = subprocess.run(
        [sys.executable, script, "--steps", "3", *common],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on cuda" in r.stdout and (tmp_path / "checkpoint.pt").is_file()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            script,
            "--steps",
            "5",
            "--resume",
            *common,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "torchrun" in r.stdout and "steps 4..5" in r.stdout
    ck = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ck["step"] == 5 and len(ck["history"]["losses"]) == 5
