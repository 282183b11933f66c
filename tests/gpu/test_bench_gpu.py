"""The benchmark CLI's floors on the GPU: the matmul-rate and copy-bandwidth probe runs, the
floors line reaches the table, and no case sits implausibly far past its floor (which would
mean a wrong FLOP or byte count). The CPU suite checks the counts themselves."""

import json

import pytest
import torch

from moe_overlap.bench import harness as Hn
from moe_overlap.bench.__main__ import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_device_rates_are_plausible():
    r = Hn.device_rates("cuda", torch.bfloat16)
    # an H100 / H200 reaches ~700-800 TFLOP/s and ~3-4.5 TB/s; these bounds only catch a
    # probe that times nothing or counts wrong
    assert 50 < r["mm_tflops"] < 2500, r
    assert 0.3 < r["copy_tb_s"] < 12, r


@pytest.mark.parametrize("op", ["layer1", "moe"])
def test_cli_reports_floors(tmp_path, capsys, op):
    j = tmp_path / "r.json"
    args = [op, "--tokens", "4096", "--hidden", "2048", "--ffn", "1024", "--experts", "16"]
    args += ["--topk", "4", "--rep", "5", "--warmup", "2", "--rounds", "1", "--json", str(j)]
    args += ["--device", "cuda"]  # no index: the current device (set_device refuses "cuda")
    assert main(args) == 0
    out = capsys.readouterr().out
    run = json.loads(j.read_text())["runs"][0]
    b = run["bounds"]
    assert b["bound"] in ("compute", "memory") and "floors: compute" in out
    for c in run["cases"]:
        if c.get("share_of_floor") is not None:
            assert 0 < c["share_of_floor"] < 1.5, c
