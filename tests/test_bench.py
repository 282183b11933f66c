"""The benchmark CLI and its baselines, on the CPU (tiny shapes; no timing is asserted).

Covers: every subcommand parses; the CLI runs end to end on the ``tiny`` preset with whatever
fused ops exist (a missing one is reported, never a crash); the FLOP formulas; the metrics;
the trace converter on a synthetic buffer; every baseline against ``moe_overlap.reference`` in
float64 (fp32 inputs), one rank and two emulated ranks, forward and backward.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from moe_overlap.bench import baselines as B
from moe_overlap.bench import harness as Hn
from moe_overlap.bench import presets as P
from moe_overlap.bench import report as R
from moe_overlap.bench import trace as Tr
from moe_overlap.bench.__main__ import build_parser, main
from moe_overlap.testing import free_port

try:
    from moe_overlap import reference
except Exception:  # noqa: BLE001 - written in parallel; tests that need it skip
    reference = None

needs_ref = pytest.mark.skipif(reference is None, reason="moe_overlap.reference not importable")

try:
    import matplotlib  # noqa: F401

    HAS_MPL = True
except ImportError:
    HAS_MPL = False

FAST = ["--rep", "1", "--warmup", "0"]


# ------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "argv",
    [
        ["layer0"],
        ["layer1", "--preset", "qwen3-30b-a3b", "--dtype", "fp16"],
        ["moe", "--backward", "--preset", "deepseek-v3", "--world-size", "4", "--trace", "t.json"],
        [
            "moe",
            "--tokens",
            "100",
            "--hidden",
            "64",
            "--ffn",
            "96",
            "--experts",
            "6",
            "--topk",
            "3",
            "--activation",
            "gelu",
            "--score-func",
            "sigmoid",
        ],
        ["ag-matmul", "--preset", "gpt3-175b", "-m", "1024"],
        ["matmul-rs", "--preset", "mixtral-8x7b", "--baselines", "mm,nccl"],
        ["all", "--presets", "tiny,olmoe", "--ops", "layer0,moe", "--backward"],
        ["tune", "--preset", "mixtral-8x7b", "--op", "layer1"],
    ],
)
def test_every_subcommand_parses(argv):
    args = build_parser().parse_args(argv)
    assert args.cmd == argv[0]


def test_parser_rejects_unknown_preset():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["layer0", "--preset", "no-such-model"])


@pytest.mark.parametrize(
    "text,want",
    [("20", ("n", 20)), ("100ms", ("ms", 100.0)), ("0.5s", ("ms", 500.0)), (7, ("n", 7))],
)
def test_parse_amount(text, want):
    assert Hn.parse_amount(text) == want


@pytest.mark.parametrize("bad", ["-3", "fast", "0ms", ""])
def test_parse_amount_rejects(bad):
    with pytest.raises(ValueError, match="count"):
        Hn.parse_amount(bad)


# ------------------------------------------------------------------------------- presets
def test_presets_match_anchors():
    want = {  # ANCHORS.md: H, F, E, K
        "mixtral-8x7b": (4096, 14336, 8, 2),
        "mixtral-8x22b": (6144, 16384, 8, 2),
        "phi-3.5-moe": (4096, 6400, 16, 2),
        "qwen1.5-moe": (2048, 1408, 60, 4),
        "qwen3-30b-a3b": (2048, 768, 128, 8),
        "deepseek-v3": (7168, 2048, 256, 8),
        "olmoe": (2048, 1024, 64, 8),
    }
    assert set(P.MODEL_PRESETS) == set(want)
    for name, (H, F, E, K) in want.items():
        s = P.PRESETS[name]
        assert (s.hidden, s.ffn, s.experts, s.topk) == (H, F, E, K)
        assert s.tokens == (8192 if name == "deepseek-v3" else 16384)


def test_shape_overrides_and_errors():
    s = P.get_moe_shape("olmoe", tokens=100, topk=2)
    assert (s.tokens, s.topk, s.hidden, s.name) == (100, 2, 2048, "olmoe+custom")
    assert P.get_moe_shape("olmoe") is P.PRESETS["olmoe"]
    with pytest.raises(ValueError, match="topk"):
        P.get_moe_shape("tiny", topk=9)
    with pytest.raises(ValueError, match="dense"):
        P.get_moe_shape("gpt3-175b")
    ag = P.get_dense_shape("ag-matmul", "gpt3-175b")
    rs = P.get_dense_shape("matmul-rs", "gpt3-175b")
    assert (ag.m, ag.n, ag.k) == (8192, 49152, 12288)
    assert (rs.n, rs.k) == (12288, 49152)
    m = P.get_dense_shape("matmul-rs", "mixtral-8x7b", m=1000)
    assert (m.m, m.n, m.k) == (1000, 4096, 14336)


def test_configs_roundtrip(tmp_path):
    path = tmp_path / "c.json"
    assert P.lookup_config("layer0", {"H": 1}, "bf16", path=path) is None
    shape = {"tokens": 8, "hidden": 16}
    P.store_config("layer0", shape, "bf16", "GPU X", {"BLOCK_M": 128}, path=path)
    P.store_config("layer0", shape, "bf16", "GPU X", {"BLOCK_M": 64}, path=path)  # replaces
    P.store_config("layer1", shape, "bf16", "GPU X", {"BLOCK_N": 32}, path=path)
    assert P.lookup_config("layer0", dict(reversed(shape.items())), "bf16", "GPU X", path=path) == {
        "BLOCK_M": 64
    }
    assert P.lookup_config("layer0", shape, "bf16", "GPU Y", path=path) is None
    assert P.lookup_config("layer0", shape, "bf16", None, path=path) == {"BLOCK_M": 64}
    assert len(json.loads(path.read_text())["entries"]) == 2
    # the shipped table is valid
    assert isinstance(P.load_configs()["entries"], list)


# ------------------------------------------------------------------------------- FLOPs
def test_flop_formulas():
    M, H, F = 16384 * 2, 4096, 14336  # Mixtral, 16k tokens x top-2
    assert Hn.flops_layer0(M, H, F, "swiglu") == 2 * M * H * 2 * F
    assert Hn.flops_layer0(M, H, F, "gelu") == 2 * M * H * F
    assert Hn.flops_layer1(M, F, H) == 2 * M * F * H
    fwd = Hn.flops_moe(M, H, F)
    assert fwd == 2 * M * H * 2 * F + 2 * M * F * H
    assert Hn.flops_moe(M, H, F, backward=True) == 3 * fwd
    # ANCHORS: grouped_mm up+gate 11.3 ms at 672-679 TFLOP/s (within rounding of 11.3)
    assert 670 < Hn.flops_layer0(M, H, F) / 11.3e-3 / 1e12 < 690
    assert Hn.flops_dense("ag-matmul", 8192, 49152, 12288, 8) == 2 * 8192 * 6144 * 12288
    assert Hn.flops_dense("matmul-rs", 8192, 12288, 49152, 8) == 2 * 8192 * 12288 * 6144


def test_metrics_ratios_and_comm():
    spec = Hn.RunSpec("moe", P.PRESETS["tiny"], torch.float32, torch.device("cpu"), world_size=2)
    ok = lambda role, flops=1e9: {"role": role, "status": "ok", "flops_total": flops}
    merged = {
        "status": {
            "grouped_mm": ok("floor"),
            "torchtitan": dict(ok("baseline"), rel_err={"loop": 1e-6}),
            "loop": ok("baseline"),
            "comm": ok("comm", 0.0),
            "fused": dict(ok("candidate"), rel_err={"torchtitan": 1e-3, "loop": 0.5}),
            "gone": {"role": "candidate", "status": "unavailable", "reason": "nope"},
        },
        "times": {
            "grouped_mm": [1.0, 1.0, 1.0],
            "torchtitan": [3.0, 2.0, 4.0],
            "loop": [4.0],
            "comm": [2.0],
            "fused": [1.5, 1.5],
        },
    }
    m = Hn.metrics(spec, merged)
    assert m["fastest_baseline"] == "torchtitan" and m["floor"] == "grouped_mm"
    assert m["ratios"]["fused"]["torchtitan"] == pytest.approx(3.0 / 1.5)
    assert m["ratios"]["fused"]["grouped_mm"] == pytest.approx(1.0 / 1.5)
    cm = m["comm"]["fused"]
    assert cm["effective_comm_ms"] == pytest.approx(0.5)
    assert cm["hidden_share"] == pytest.approx((1.0 + 2.0 - 1.5) / 2.0)
    by = {c["name"]: c for c in m["cases"]}
    assert by["fused"]["err_ref"] == "torchtitan" and by["fused"]["check"] == "ok"
    assert by["fused"]["tflops"] == pytest.approx(1e9 / 1.5e-3 / 1e12)
    assert by["gone"]["status"] == "unavailable"
    text = R.format_table(
        {
            "op": "moe",
            "preset": "tiny",
            "shape": P.PRESETS["tiny"].as_dict(),
            "dtype": "float32",
            "world_size": 2,
            "world": "emulated",
            "device": "cpu",
            "backward": False,
            **m,
        }
    )
    assert "75% hidden" in text and "unavailable" in text


@pytest.mark.parametrize(
    ("counts", "want"),
    [
        ([128, 256], 1.0),
        ([0, 128, 129, 1], 258 / (4 * 128)),  # an empty expert takes no tile
        ([1], 1 / 128),
        ([300, 0, 0], 300 / 384),  # everything on one expert
        ([0, 0], None),  # no rows: no tiles
    ],
)
def test_tile_fill(counts, want):
    """Real rows over rows in whole 128-row tiles per expert, summed over the input sets."""
    p = B.make_moe_problem(P.PRESETS["tiny"], 1, 0, torch.float32, "cpu", n_sets=2)

    class Info:  # what _tile_fill reads of a set's layout
        def __init__(self, c):
            self.counts = c

    p.cache["sort"] = [Info(counts), Info(counts)]
    got = Hn._tile_fill(p, None)
    assert got == (None if want is None else pytest.approx(want))
    run = {"tile_fill_per_rank": [got, got]}
    line = R.fill_line(run)
    assert (line is None) == (want is None)
    if line:
        assert f"{want:.1%}" in line and "over ranks" not in line
    spread = R.fill_line({"tile_fill_per_rank": [0.5, 0.75]})
    assert "50.0%-75.0% (over ranks)" in spread
    dense = B.make_dense_problem(
        "ag-matmul", P.get_dense_shape("ag-matmul", "tiny"), 1, 0, torch.float32, "cpu"
    )
    assert Hn._tile_fill(dense, None) is None and R.fill_line({}) is None


def test_min_bytes_worked_examples():
    """Weights once per GEMM that reads them (twice with the backward, plus their gradients),
    the op's token inputs/outputs once; by hand for deepseek-v3 and a dense shape."""
    ds = P.PRESETS["deepseek-v3"]  # T 8192, H 7168, F 2048, E 256
    T, H, F, E = 8192, 7168, 2048, 256
    w1, w2 = E * 2 * F * H, E * H * F
    M = T * 8
    assert Hn.min_bytes("moe", ds, M, 1, 2, True) == 2 * (3 * (w1 + w2) + 4 * T * H)
    assert Hn.min_bytes("moe", ds, M, 1, 2, True) / 1e9 == pytest.approx(68.1, abs=0.05)
    assert Hn.min_bytes("moe", ds, M, 1, 2, False) == 2 * (w1 + w2 + 2 * T * H)
    assert Hn.min_bytes("layer0", ds, M, 1, 2, False) == 2 * (w1 + T * H + M * F)
    assert Hn.min_bytes("layer1", ds, M, 1, 2, False) == 2 * (w2 + M * F + T * H)
    # four ranks: a quarter of the experts each, the rank's own tokens
    assert Hn.min_bytes("layer1", ds, 1000, 4, 2, False) == 2 * (w2 // 4 + 1000 * F + T * H)
    d = P.DenseShape("d", 256, 96, 64)
    assert Hn.min_bytes("ag-matmul", d, 0, 2, 4, False) == 4 * (256 * 64 + 48 * 64 + 256 * 48)
    assert Hn.min_bytes("matmul-rs", d, 0, 2, 4, False) == 4 * (256 * 32 + 96 * 32 + 128 * 96)
    with pytest.raises(ValueError, match="unknown op"):
        Hn.min_bytes("gemm", d, 0, 1, 2, False)


def test_bounds_floors_and_line():
    """The floors: issued FLOPs (over the fill) at the probed matmul rate against the bytes at
    the probed bandwidth, the slowest rank's, and each candidate's share of the larger."""
    ds = P.PRESETS["deepseek-v3"]
    spec = Hn.RunSpec("moe", ds, torch.bfloat16, torch.device("cpu"), world_size=2, backward=True)
    merged = {"M": [30000, 35536], "fill": [0.75, 0.8]}
    rates = {"mm_n": 8192, "mm_tflops": 800.0, "copy_tb_s": 3.0}
    b = Hn.bounds(spec, merged, rates)
    fl = [Hn.flops_moe(m, 7168, 2048, "swiglu", True) for m in merged["M"]]
    issued = max(fl[0] / 0.75, fl[1] / 0.8)
    assert b["compute_floor_ms"] == pytest.approx(issued / 800e12 * 1e3)
    by = max(Hn.min_bytes("moe", ds, m, 2, 2, True) for m in merged["M"])
    assert b["memory_floor_ms"] == pytest.approx(by / 3e12 * 1e3)
    assert b["bound"] == ("compute" if b["compute_floor_ms"] >= b["memory_floor_ms"] else "memory")
    slow = dict(rates, copy_tb_s=0.3)  # a tenth of the bandwidth: memory-bound
    assert Hn.bounds(spec, merged, slow)["bound"] == "memory"
    floor = max(b["compute_floor_ms"], b["memory_floor_ms"])
    run = {
        "bounds": b,
        "cases": [
            {"name": "fused", "role": "candidate", "share_of_floor": floor / (2 * floor)},
            {"name": "unfused", "role": "baseline", "share_of_floor": 0.25},
        ],
    }
    line = R.bounds_line(run)
    assert f"compute {b['compute_floor_ms']:.3f} ms" in line and "800 TFLOP/s" in line
    assert f"memory {b['memory_floor_ms']:.3f} ms" in line and "3.00 TB/s" in line
    assert f"{b['bound']}-bound" in line and "fused at 50% of the floor" in line
    assert R.bounds_line({"bounds": Hn.bounds(spec, merged, None)}) is None
    assert R.bounds_line({}) is None
    assert Hn.device_rates("cpu", torch.float32) is None


def test_rel_error():
    a = torch.ones(4)
    assert Hn.rel_error(a, a) == 0.0
    assert Hn.rel_error(a, torch.ones(5)) is None
    assert Hn.rel_error(torch.full((4,), float("nan")), a) == float("inf")
    assert Hn.rel_error((a, 2 * a), (a, a)) == pytest.approx(1.0)


def test_git_commit_marks_a_dirty_tree(tmp_path):
    """A table's commit line must not name a commit whose code was changed (A/B device runs)."""
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"

    def git(*args):
        subprocess.run(
            ["git", "-C", str(tmp_path), *args], check=True, env=env, capture_output=True
        )

    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", "x")
    sha = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    sub = tmp_path / "pkg"
    sub.mkdir()
    assert R._git_commit(sub) == sha
    (tmp_path / "untracked.txt").write_text("scratch output does not count\n")
    assert R._git_commit(sub) == sha
    (tmp_path / "f.py").write_text("a = 2\n")
    assert R._git_commit(sub) == sha + "+dirty"


# ------------------------------------------------------------------------------- trace
def test_trace_chrome_json_and_summary(tmp_path):
    buf = Tr.synthetic_buffer(world_size=3, sms=4, tiles_per_sm=5, pad_rows=7)
    bad = torch.tensor([[0, 1, 2, 500, 400, 600]], dtype=torch.int64)  # wait before start
    buf = torch.cat([buf, bad])
    ev = Tr.valid_events(buf)
    assert ev.shape[0] == 3 * 4 * 5 and int(ev[:, 3].min()) == 0
    path = Tr.write_chrome(buf, tmp_path / "t.json")
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2}
    assert {e["tid"] for e in xs} == {0, 1, 2, 3}
    assert sum(e["cat"] == "compute" for e in xs) == 60
    assert any(e["cat"] == "wait" for e in xs)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    names = [e for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in names] == ["rank 0", "rank 1", "rank 2"]
    s = Tr.summarize(buf)
    assert s["events"] == 60 and s["dropped"] == 8
    assert s["ranks"][0]["wait_share"] == 0.0 and s["ranks"][1]["wait_share"] > 0
    aligned = Tr.valid_events(buf, align_ranks=True)
    for r in range(3):
        assert int(aligned[aligned[:, 0] == r][:, 3].min()) == 0


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib missing")
def test_trace_png(tmp_path):
    p = Tr.write_png(Tr.synthetic_buffer(), tmp_path / "t.png", title="synthetic")
    assert p is not None and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_rejects_bad_buffers():
    with pytest.raises(ValueError, match="n_events"):
        Tr.valid_events(torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        Tr.valid_events(torch.zeros(3, 6))
    with pytest.raises(ValueError, match="capacity"):
        Tr.new_buffer(0)
    assert Tr.to_chrome(Tr.new_buffer(4))["traceEvents"] == []


# ------------------------------------------------------------------------- baselines
SHAPE = P.MoEShape("t", 24, 16, 24, 4, 2)  # multiples of 4 floats: grouped_mm may run


def _ref_y(x, ids, w, w1, w2, act="swiglu"):
    return reference.experts(x.double(), ids, w.double(), w1.double(), w2.double(), activation=act)


def _ref_h(x, ids, w1, act, El, first=0):
    """Canonical layer-0 rows: (local expert, token), float64."""
    rows = []
    for e in range(El):
        t = (ids == e + first).nonzero(as_tuple=True)[0]  # token order (ids distinct per row)
        rows.append(B.activation_fn(x[t].double() @ w1[e].double().t(), act))
    return torch.cat(rows)


def _run_cases(op, p, world, names):
    out = {}
    for n in names:
        try:
            c = B.build_baseline(op, n, p, world)
        except B.Unavailable:
            continue
        if c.canon is None and c.role != "floor":
            continue
        res = c.step(0)
        out[n] = res if c.canon is None else c.canon(res)
    return out


@needs_ref
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_baselines_match_reference_one_rank(act):
    from moe_overlap.world import local_world

    shape = P.MoEShape("t", 24, 16, 24, 4, 3, activation=act)
    world = local_world("cpu")
    p = B.make_moe_problem(shape, 1, 0, torch.float32, "cpu", n_sets=2)
    s = p.sets[0]
    want_y = _ref_y(s.x_TH, s.topk_ids_TK, s.topk_w_TK, p.w1, p.w2, act)
    want_h = _ref_h(s.x_TH, s.topk_ids_TK, p.w1, act, 4)  # rows in (expert, token) order
    got0 = _run_cases("layer0", p, world, B.baseline_names("layer0"))
    assert {"unfused", "torchtitan", "loop"} <= set(got0)
    for name in ("unfused", "torchtitan", "loop"):
        assert Hn.rel_error(got0[name], want_h) < 1e-5, name
    F = shape.ffn
    floor = got0["grouped_mm"].double()  # the GEMM alone: activation applied here
    assert Hn.rel_error(B.activation_fn(floor, act), want_h) < 1e-5
    assert floor.shape[1] == (2 * F if act == "swiglu" else F)
    got1 = _run_cases("layer1", p, world, B.baseline_names("layer1"))
    for name in ("unfused", "torchtitan", "loop"):
        assert Hn.rel_error(got1[name], want_y) < 1e-5, name
    got = _run_cases("moe", p, world, ["torchtitan", "unfused", "loop", "mo_baseline"])
    assert {"torchtitan", "unfused", "loop"} <= set(got)
    for name, y in got.items():
        assert Hn.rel_error(y, want_y) < 1e-5, name


def test_loop_baseline_backward_writes_each_weight_gradient_once():
    """The per-expert loop's backward must not write one all-experts-sized tensor per expert
    (what indexing the stacked leaf, ``w1[e]``, costs: 14 GiB each, 256 times, at deepseek-v3),
    or it measures PyTorch's select backward instead of the loop HF runs."""
    from moe_overlap.testing import ops_writing
    from moe_overlap.world import local_world

    p = B.make_moe_problem(SHAPE, 1, 0, torch.float32, "cpu", n_sets=1, backward=True)
    assert len(set(p.sets[0].topk_ids_TK.reshape(-1).tolist())) >= 3  # several experts hit
    case = B.build_baseline("moe", "loop", p, local_world("cpu"))
    got = []
    writes = ops_writing(lambda: got.extend(case.step(0)), [p.w1.shape, p.w2.shape])
    assert got[3].shape == p.w1.shape and got[4].shape == p.w2.shape
    for shape, ops in writes.items():
        assert len(ops) == 1, f"{len(ops)} tensors of shape {shape} written: {ops}"


@needs_ref
def test_baselines_backward_match_reference():
    from moe_overlap.world import local_world

    world = local_world("cpu")
    p = B.make_moe_problem(SHAPE, 1, 0, torch.float32, "cpu", n_sets=2, backward=True)
    s = p.sets[1]
    leaves = [t.detach().double().requires_grad_(True) for t in (s.x_TH, p.wr_EH, p.w1, p.w2)]
    x, wr, w1, w2 = leaves
    ids, w = B.torch_route(x, wr, SHAPE.topk)
    assert torch.equal(ids, s.topk_ids_TK)
    y = reference.experts(x, ids, w, w1, w2)
    want = (y, *torch.autograd.grad(y, leaves, s.gy_TH.double()))
    for name in ("torchtitan", "unfused", "loop", "mo_baseline"):
        try:
            c = B.build_baseline("moe", name, p, world)
        except B.Unavailable:
            assert name == "mo_baseline"
            continue
        got = c.step(1)
        assert len(got) == 5
        for k, (g, r) in enumerate(zip(got, want)):
            assert Hn.rel_error(g, r) < 1e-5, (name, k)
    floor = B.build_baseline("moe", "grouped_mm", p, world)
    assert len(floor.step(0)) == 4  # dx, dw1, dh, dw2 of the two GEMMs


@needs_ref
def test_baselines_two_emulated_ranks_match_reference():
    from moe_overlap.testing import spawn

    shape = P.MoEShape("t", 20, 16, 24, 4, 2)

    def fn(world):
        p = B.make_moe_problem(shape, 2, world.rank, torch.float32, "cpu", n_sets=2)
        out = {op: _run_cases(op, p, world, B.baseline_names(op)) for op in ("layer0", "layer1")}
        out["moe"] = _run_cases("moe", p, world, ["torchtitan", "mo_baseline"])
        return p, out

    res = spawn(2, fn)
    w1 = torch.cat([p.w1 for p, _ in res])
    w2 = torch.cat([p.w2 for p, _ in res])
    for r, (p, out) in enumerate(res):
        s = p.sets[0]
        want_y = _ref_y(s.x_TH, s.topk_ids_TK, s.topk_w_TK, w1, w2)
        assert Hn.rel_error(out["layer1"]["torchtitan"], want_y) < 1e-5
        assert Hn.rel_error(out["layer1"]["unfused"], want_y) < 1e-5
        assert Hn.rel_error(out["moe"]["torchtitan"], want_y) < 1e-5
        # layer 0 on rank r: rows of its 2 local experts, (expert, source rank, token) order
        want_h = []
        for e in range(2):
            for src_p, _ in res:
                ss = src_p.sets[0]
                want_h.append(
                    _ref_h(ss.x_TH, ss.topk_ids_TK, p.w1[e : e + 1], "swiglu", 1, first=2 * r + e)
                )
        assert Hn.rel_error(out["layer0"]["torchtitan"], torch.cat(want_h)) < 1e-5
        assert "unfused" not in out["layer0"] and "loop" not in out["layer0"]


def test_dense_baselines_and_check(tmp_path):
    from moe_overlap.world import local_world

    world = local_world("cpu")
    shape = P.DenseShape("d", 12, 8, 16)
    for op in ("ag-matmul", "matmul-rs"):
        p = B.make_dense_problem(op, shape, 1, 0, torch.float32, "cpu", n_sets=2)
        mm = B.build_baseline(op, "mm", p, world)
        want = p.xs[1].double() @ p.weight.double().t()
        assert Hn.rel_error(mm.step(1), want) < 1e-6
        assert (
            Hn.rel_error(
                Hn._dense_check_case(p, world).step(0), p.xs[0].double() @ p.weight.double().t()
            )
            < 1e-6
        )
        for name in ("nccl", "symm_mem", "comm"):
            with pytest.raises(B.Unavailable):
                B.build_baseline(op, name, p, world)


def test_grouped_mm_fallback_matches_loop():
    a = torch.randn(13, 8)
    b = torch.randn(3, 8, 5)
    offs = torch.tensor([4, 4, 13], dtype=torch.int32)
    want = torch.cat([a[:4] @ b[0], a[4:13] @ b[2]])
    assert torch.allclose(B.grouped_mm(a, b, offs, "loop"), want, atol=1e-5)
    assert B.grouped_mm_mode("cpu", None, torch.float32, False) in ("native", "padded", "loop")


def test_grouped_mm_fallback_backward_writes_the_weight_gradient_once():
    from moe_overlap.testing import ops_writing

    a = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)  # [E, N, K], as w1
    offs = torch.tensor([4, 4, 13], dtype=torch.int32)
    gy = torch.randn(13, 5, dtype=torch.float64)
    got = []

    def step():
        y = B.grouped_mm(a, w.transpose(1, 2), offs, "loop")
        got.extend(torch.autograd.grad(y, [a, w], gy))

    # the loop sees w transposed: a per-expert write may come in either layout
    writes = ops_writing(step, [w.shape, w.transpose(1, 2).shape])
    assert sum(len(ops) for ops in writes.values()) == 1, writes
    y = torch.cat([a[:4] @ w[0].t(), a[4:13] @ w[2].t()])
    for g, r in zip(got, torch.autograd.grad(y, [a, w], gy)):
        assert torch.allclose(g, r, atol=1e-12)


# ------------------------------------------------------------------------------- the CLI
def test_cli_layer0_json_png_md(tmp_path, capsys):
    j, png, md = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.md"
    rc = main(
        [
            "layer0",
            "--preset",
            "tiny",
            *FAST,
            "--json",
            str(j),
            "--png",
            str(png),
            "--md",
            str(md),
            "--trace",
            str(tmp_path / "t.json"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "numbers mean nothing" in out.splitlines()[-6:][-1] or "mean nothing" in out
    data = json.loads(j.read_text())
    assert data["env"]["command"].startswith("moe-overlap-bench layer0")
    run = data["runs"][0]
    names = {c["name"]: c for c in run["cases"]}
    for b in ("grouped_mm", "unfused", "torchtitan", "loop"):
        assert names[b]["status"] == "ok" and names[b]["median_ms"] > 0
        # every timed call, in the order timed: the stats are theirs
        samples = names[b]["samples_ms"]
        assert len(samples) == names[b]["n"]
        assert min(samples) == pytest.approx(names[b]["min_ms"], abs=1e-4)
        assert statistics.median(samples) == pytest.approx(names[b]["median_ms"], abs=1e-4)
    assert names["unfused"]["err"] < 1e-5
    # the interpreter runs the fused kernels: a crash or a wrong output must fail here
    assert names["fused"]["status"] == "ok", names["fused"]
    assert names["fused"]["check"] == "ok" and names["fused"]["median_ms"] > 0
    assert "| case |" in md.read_text()
    # the tiles' fill, from this run's own routing, in the JSON, the table and the markdown
    p = B.make_moe_problem(P.PRESETS["tiny"], 1, 0, torch.float32, "cpu", n_sets=run["input_sets"])
    n = [torch.bincount(s.topk_ids_TK.flatten(), minlength=4).tolist() for s in p.sets]
    want = sum(map(sum, n)) / (128 * sum(-(-c // 128) for cs in n for c in cs))
    assert run["tile_fill_per_rank"] == [pytest.approx(want)]
    assert f"fill {want:.1%} of their 128-row GEMM tiles" in md.read_text()
    assert f"fill {want:.1%}" in out
    # the byte and FLOP counts of the floors; no probe (and so no floors line) off the GPU
    b = run["bounds"]
    assert b["rates"] is None and "bound" not in b and "floors:" not in out
    want_b = Hn.min_bytes("layer0", P.PRESETS["tiny"], run["kept_rows_per_rank"][0], 1, 4, False)
    assert b["per_rank"][0]["bytes_min"] == want_b
    assert b["per_rank"][0]["flops_issued"] == pytest.approx(b["per_rank"][0]["flops"] / want)
    if HAS_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv",
    [
        ["layer1", "--candidates", "none"],
        ["moe", "--backward", "--baselines", "grouped_mm,torchtitan", "--candidates", "none"],
        ["layer0", "--world-size", "2", "--candidates", "none"],
        ["ag-matmul", "--world-size", "2"],
        [
            "all",
            "--presets",
            "tiny",
            "--ops",
            "layer1,matmul-rs",
            "--candidates",
            "none",
            "--quiet",
        ],
    ],
)
def test_cli_runs_on_cpu(argv, capsys):
    assert main([*argv, *FAST]) == 0
    out = capsys.readouterr().out
    assert "summary" in out or "--quiet" in argv


def test_cli_reports_missing_and_broken_candidates(monkeypatch, capsys):
    def missing(p, world):
        return Hn._import_attrs("moe_overlap.no_such_module", "layer0")

    def broken(p, world):
        def step(i):
            raise RuntimeError("kernel exploded")

        return B.Case("broken", "candidate", step, lambda y: y, 1.0)

    monkeypatch.setitem(Hn.CANDIDATES, "layer0", {"fused": missing, "broken": broken})
    assert main(["layer0", *FAST]) == 0
    out = capsys.readouterr().out
    assert "fused unavailable: moe_overlap.no_such_module does not import" in out
    assert "broken failed: first call: RuntimeError: kernel exploded" in out


def test_cli_tune_on_the_cpu_writes_nothing(tmp_path, capsys):
    """The tuning plumbing runs; the interpreter's timings (of its own blocks) are not pinned."""
    path = tmp_path / "c.json"
    rc = main(["tune", "--preset", "tiny", "--configs", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "not written" in out and "'l0'" in out and not path.exists()


@pytest.mark.parametrize("argv,msg", [
    (["layer0", "--preset", "tiny", "--tokens", "-5"], "tokens"),
    (["layer0", "--preset", "tiny", "--world-size", "3"], "world-size 3"),
    (["layer0", "--preset", "tiny", "--world-size", "0"], "world-size"),
    (["layer0", "--preset", "tiny", "--sets", "0"], "--sets"),
    (["layer0", "--preset", "tiny", "--rounds", "0"], "--rounds"),
    (["layer0", "--preset", "tiny", "--rep", "-3"], "rep"),
    (["layer0", "--preset", "tiny", "--backward"], "--backward"),
    (["layer0", "--preset", "tiny", "--topk", "9"], "top"),
    (["matmul-rs", "--preset", "tiny", "--world-size", "2", "-m", "7"], "multiple"),
    (["ag-matmul", "--preset", "tiny", "--world-size", "4", "-n", "30"], "N = 30"),
    (["matmul-rs", "--preset", "tiny", "--world-size", "4", "-k", "30"], "K = 30"),
    (["layer0", "--preset", "tiny", "--candidates", "foo"], "unknown ['foo']"),
    (["layer0", "--preset", "tiny", "--baselines", "deepspeed"], "unknown ['deepspeed']"),
    (["all", "--presets", "tiny", "--baselines", "nope"], "unknown ['nope']"),
    (["tune", "--preset", "tiny", "--world-size", "3"], "world-size 3"),
])  # fmt: skip
def test_cli_usage_errors_are_one_line(argv, msg, capsys):
    """Bad sizes and counts end in a one-line error before any run, not a traceback."""
    with pytest.raises(SystemExit) as ei:
        main([*argv, "--device", "cpu"] if argv[0] != "tune" else argv)
    text = str(ei.value.code) + capsys.readouterr().err
    assert msg in text, text


def test_all_gives_each_op_the_names_it_has():
    """``all`` with names that belong to some ops only: each op runs the ones it has (and
    none where it has none), rather than the whole run stopping at the first op without them."""
    from moe_overlap.bench.__main__ import _specs

    argv = ["all", "--presets", "tiny", "--ops", "layer0,moe,ag-matmul"]
    argv += ["--baselines", "grouped_mm,deepspeed"]
    args = build_parser().parse_args([*argv, "--candidates", "fused", "--device", "cpu"])
    specs = {s.op: s for s in _specs(args, torch.device("cpu"), torch.float32, 1)}
    assert specs["layer0"].baselines == ["grouped_mm"] and specs["layer0"].candidates == ["fused"]
    assert specs["moe"].baselines == ["grouped_mm", "deepspeed"] and specs["moe"].candidates == []
    assert specs["ag-matmul"].baselines == [] and specs["ag-matmul"].candidates == ["fused"]
    args = build_parser().parse_args(["all", "--presets", "tiny", "--device", "cpu"])
    assert all(s.baselines is None for s in _specs(args, torch.device("cpu"), torch.float32, 1))


def test_python_m_entry_point():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_overlap.bench",
            "layer0",
            "--preset",
            "tiny",
            "--candidates",
            "none",
            *FAST,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "summary" in r.stdout and "mean nothing" in r.stdout


# Prepended to the child scripts below (a process group of their own, some over two spawned
# processes). A stuck child prints every thread's stack and exits, so the test fails with
# where it hung instead of eating the CI's time: once, a two-process DeepSpeed run used all
# 300 s of its timeout with nothing on stderr. A dead peer's collective raises after
# TIMEOUT rather than gloo's default half hour.
_BOUNDED = """import datetime, faulthandler, os
# spawned ranks (__mp_main__) first, so their stacks come before the parent gives up
HANG_S = float(os.environ.get("CHILD_HANG_S", "150"))
faulthandler.dump_traceback_later(HANG_S + (__name__ != "__mp_main__") * min(20, HANG_S), exit=True)
TIMEOUT = datetime.timedelta(seconds=120)"""


def _run_child(argv: list, marker: str, env: dict) -> None:
    """Runs ``python *argv PORT`` and asserts it printed ``marker``. A child that hung (its
    stack dump says "Timeout (...)!") runs once more, the first stacks kept in a warning: the hangs
    seen were in the third-party CPU runs around the baseline, never in its result, which a
    second run still checks in full."""
    env = dict(os.environ, TRITON_INTERPRET="1", **env)
    for attempt in (1, 2):
        try:
            r = subprocess.run([sys.executable, *argv, str(free_port())], capture_output=True,
                               text=True, timeout=300, env=env)  # fmt: skip
        except subprocess.TimeoutExpired as e:  # the stack dump itself did not come
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            pytest.fail(f"{argv[0]} ran past 300 s; its stderr ends:\n{(err or '')[-3000:]}")
        ok = r.returncode == 0 and marker in r.stdout
        hung = re.search(r"Timeout \(\d+:\d\d:\d\d\)!", r.stderr)
        # the stacks first: mp.spawn's own traceback after them would fill a plain tail
        err = r.stderr[hung.start() :][:6000] + "\n...\n" if hung else ""
        err += r.stderr[-2000:]
        if not ok and attempt == 1 and hung:
            import warnings

            warnings.warn(f"{argv[0]} hung once, ran again; stderr:\n{err}", stacklevel=2)
            continue
        assert ok, f"rc {r.returncode}; stdout ends {r.stdout[-500:]!r}; stderr:\n{err}"
        return


def test_a_hung_child_fails_with_its_stacks_after_one_more_try(tmp_path):
    """The guard above: two spawned ranks that never finish end in a failure that shows where
    they were, after a second try and a warning, in seconds (not the 300 s timeout)."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import time\n" + _BOUNDED + "\nimport torch.multiprocessing as mp\n"
        "def main(rank, port):\n    time.sleep(600)\n"
        "if __name__ == '__main__':\n    mp.spawn(main, args=('0',), nprocs=2)\n"
    )
    with pytest.warns(UserWarning, match="hung once"), pytest.raises(AssertionError) as ei:
        _run_child([str(script)], "NEVER", {"CHILD_HANG_S": "6"})
    assert "most recent call first" in str(ei.value) and "hang.py" in str(ei.value), ei.value


_DS_SCRIPT = """
import os, sys, torch, torch.distributed as dist
{bounded}
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = sys.argv[2]
alone = sys.argv[1] == "alone"  # no process group: one rank needs none
if not alone:
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=TIMEOUT)
from moe_overlap import reference
from moe_overlap.bench import baselines as B, harness as Hn, presets as P
from moe_overlap.world import local_world
shape = P.MoEShape("t", 24, 16, 24, 4, 2)
for bwd in (False, True):
    p = B.make_moe_problem(shape, 1, 0, torch.float32, "cpu", n_sets=2, backward=bwd)
    world = local_world("cpu")
    ds = B.build_baseline("moe", "deepspeed", p, world)
    tt = B.build_baseline("moe", "torchtitan", p, world)
    got, want = ds.canon(ds.step(0)), tt.canon(tt.step(0))
    s = p.sets[0]
    ref = reference.experts(s.x_TH.double(), s.topk_ids_TK, s.topk_w_TK.double(),
                            p.w1.double(), p.w2.double())
    assert Hn.rel_error(got, ref) < 1e-5, (bwd, Hn.rel_error(got, ref))
    assert Hn.rel_error(got, want) < 1e-5, (bwd, Hn.rel_error(got, want))
    assert dist.is_initialized() != alone  # the baseline started no group of its own
if not alone:
    dist.destroy_process_group()
print("DEEPSPEED-OK")
""".replace("{bounded}", _BOUNDED)


_DS_EP2_SCRIPT = """
import os, sys, torch, torch.distributed as dist
{bounded}
import torch.multiprocessing as mp

def main(rank, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    # DeepSpeed's CPU shared-memory allreduce (a C++ op it builds and starts on CPU only)
    # aborted one process now and then ("terminate called without an active exception");
    # the baseline runs on NCCL on GPUs, so the CPU test keeps to plain gloo.
    import deepspeed.comm.torch as ds_torch
    ds_torch.build_shm_op = lambda: None
    from moe_overlap import reference
    from moe_overlap.bench import baselines as B, harness as Hn, presets as P

    class Procs:  # what _moe_deepspeed touches of a torchrun world
        world_size = 2
        def __init__(self, rank):
            self.rank = rank
        def all_gather_ints(self, vals):
            out = [None] * 2
            dist.all_gather_object(out, [int(v) for v in vals])
            return out

    shape = P.MoEShape("t", 24, 16, 24, 4, 2)
    for bwd in (False, True):
        p = B.make_moe_problem(shape, 2, rank, torch.float32, "cpu", n_sets=2, backward=bwd)
        ds = B.build_baseline("moe", "deepspeed", p, Procs(rank))
        got = ds.step(0)
        got = got[0] if bwd else got
        full = []
        for w in (p.w1, p.w2):
            parts = [torch.empty_like(w) for _ in range(2)]
            dist.all_gather(parts, w.contiguous())
            full.append(torch.cat(parts))
        s = p.sets[0]
        ref = reference.experts(s.x_TH.double(), s.topk_ids_TK, s.topk_w_TK.double(),
                                full[0].double(), full[1].double())
        assert Hn.rel_error(got, ref) < 1e-5, (rank, bwd, Hn.rel_error(got, ref))
    # Both ranks done, then leave without interpreter teardown: a rank tearing down its gloo
    # group while the peer (whose TCP store it may host) still exits aborted now and then
    # ("terminate called without an active exception").
    dist.barrier()
    if rank == 0:
        print("DEEPSPEED-EP2-OK", flush=True)
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
""".replace("{bounded}", _BOUNDED)


@needs_ref
def test_deepspeed_baseline_with_two_processes(tmp_path):
    """Expert parallel over two processes (gloo): DeepSpeed's comm set up and its expert
    group made, dropless capacity agreed across ranks (it raised, then aborted the job)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    script = tmp_path / "ds_ep2.py"
    script.write_text(_DS_EP2_SCRIPT)
    _run_child([str(script)], "DEEPSPEED-EP2-OK", {"DS_ACCELERATOR": "cpu"})


@needs_ref
@pytest.mark.parametrize("group", ["torchrun", "alone"])
def test_deepspeed_baseline_matches(group):
    """Against the float64 reference and the TorchTitan-style baseline, forward and backward,
    under a process group the caller made (torchrun) and without one (the one-rank tables)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    _run_child(["-c", _DS_SCRIPT, group], "DEEPSPEED-OK", {})


@needs_ref
def test_cli_tables_show_deepspeed_at_one_rank_without_torchrun(tmp_path):
    """The one-rank tables (no torchrun, as ``tests/gpu/bench_h200.sh`` runs them) measure
    DeepSpeed's layer; emulated ranks in one process cannot host it and say why."""
    import importlib.util
    import json

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    for ws in ("1", "2"):
        out = tmp_path / f"ds{ws}.json"
        argv = [
            "moe",
            "--preset",
            "tiny",
            "--baselines",
            "deepspeed,unfused",
            "--candidates",
            "none",
            "--device",
            "cpu",
            "--world-size",
            ws,
            "--json",
            str(out),
            *FAST,
        ]
        r = subprocess.run(
            [sys.executable, "-m", "moe_overlap.bench", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        data = json.loads(out.read_text())
        run = data["runs"][0] if "runs" in data else data
        ds = {c["name"]: c for c in run["cases"]}["deepspeed"]
        if ws == "1":
            assert ds["status"] == "ok", ds
            assert ds["rel_err"]["reference"] < 1e-5, ds
        else:
            assert ds["status"] != "ok" and "one process per rank" in json.dumps(ds), ds


_TORCHRUN_MERGE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
{bounded}
import torch.multiprocessing as mp

def main(rank, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    from moe_overlap.bench import harness as Hn, presets as P
    from moe_overlap.world import local_world
    from moe_overlap.world.dist_collectives import DistCollectives

    spec = Hn.RunSpec(op="layer1", shape=P.get_moe_shape("tiny"), dtype=torch.float32,
                      device=torch.device("cpu"), world_size=2, baselines=["grouped_mm"],
                      candidates=[], warmup=("n", 1), rep=("n", 2), rounds=1, check=False)
    one = Hn.run_rank(local_world("cpu"), spec)  # a real result; made rank-specific below
    one["rank"] = rank
    st = one["status"]["grouped_mm"]
    st["flops"] = 1000.0 * (rank + 1)  # uneven routing: rank 1 holds twice rank 0's rows
    st["rel_err"] = {"torchtitan": 0.5 if rank == 1 else 1e-7}  # only rank 1 is wrong
    Hn.run_rank = lambda world, spec: one

    class Procs(DistCollectives):  # what a torch_symm / nvshmem world is to the harness
        world_size, group = 2, dist.group.WORLD

    w = Procs()
    w.rank = rank
    assert Hn._is_dist(w)
    out = Hn.run(spec, world=w)
    case = {c["name"]: c for c in out["cases"]}["grouped_mm"]
    assert case["flops"] == 3000.0, case  # both ranks' rows (rank 0's alone, scaled: 2000)
    assert case["rel_err"]["torchtitan"] == 0.5, case  # rank 1's check is not dropped
    assert out["world"] == "torchrun"
    # Both ranks done, then leave without interpreter teardown: a rank tearing down its gloo
    # group while the peer (whose TCP store it may host) still exits aborted now and then
    # ("terminate called without an active exception").
    dist.barrier()
    if rank == 0:
        print("MERGE-OK", flush=True)
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
""".replace("{bounded}", _BOUNDED)


def test_torchrun_results_merge_every_rank(tmp_path):
    """Under torchrun each process holds only its own rank's result: FLOPs (uneven routing)
    and every rank's correctness check must come from all of them, not rank 0 alone."""
    script = tmp_path / "merge.py"
    script.write_text(_TORCHRUN_MERGE_SCRIPT)
    _run_child([str(script)], "MERGE-OK", {})


class _LoggedCase:
    """A timing case that records its calls (its own, and its name into a shared ``log``) and
    raises once it has been called more than ``fail_at`` times."""

    def __init__(self, name, log, fail_at=None):
        self.name, self.log, self.fail_at, self.calls = name, log, fail_at, []

    def step(self, i):
        self.calls.append(i)
        self.log.append(self.name)
        if self.fail_at is not None and len(self.calls) > self.fail_at:
            raise RuntimeError("boom")


def test_measure_interleaved_rotates_splits_and_drops_failures():
    """Rounds give every case its share of the calls, the order rotating; the counts add up
    to the requested ones; input sets keep rotating; a case that raises is dropped."""
    log = []

    cases = [_LoggedCase("a", log), _LoggedCase("b", log), _LoggedCase("c", log, fail_at=4)]
    world = type("W", (), {"world_size": 1})()  # one rank: no collectives are called
    timings, failures = Hn.measure_interleaved(
        cases, torch.device("cpu"), world, ("n", 3), ("n", 7), rounds=3
    )
    assert set(timings) == {"a", "b"} and set(failures) == {"c"}
    assert "RuntimeError: boom" in failures["c"]
    assert len(timings["a"]["ms"]) == 7 and len(timings["b"]["ms"]) == 7
    assert cases[0].calls == list(range(10)), "warm-up + timed calls rotate the input sets"
    # Round order: a b c / b c a / c a b; c raises on its 5th call (round 1), so round 2 is a b.
    firsts = []
    for name in log:
        if not firsts or firsts[-1] != name:
            firsts.append(name)
    assert firsts == ["a", "b", "c", "b", "c", "a", "b"], firsts
    # One timed call asked for: one round has it, the others skip the case.
    one = _LoggedCase("one", [])
    t, f = Hn.measure_interleaved([one], torch.device("cpu"), world, ("n", 0), ("n", 1), 5)
    assert not f and len(t["one"]["ms"]) == 1 and one.calls == [0]


def test_duration_counts_have_a_floor_per_device(monkeypatch):
    """A duration gives as many calls as fit, within [floor, 1000]; the floor is 20 timed
    calls on a GPU (medians of 10 power-capped 50 ms calls were 7% apart) and 5 on the CPU;
    an explicit count is taken as it is."""
    assert Hn._counts(("ms", 100.0), ("ms", 500.0), 50.0) == (2, 10)
    assert Hn._counts(("ms", 100.0), ("ms", 500.0), 50.0, min_rep=20) == (2, 20)
    assert Hn._counts(("ms", 100.0), ("ms", 500.0), 1.0, min_rep=20) == (100, 500)
    assert Hn._counts(("ms", 1e6), ("ms", 1e9), 1e-6) == (200, 1000)
    assert Hn._counts(("n", 0), ("n", 3), 50.0, min_rep=20) == (0, 3)
    assert Hn.MIN_TIMED_CALLS["cuda"] == 20 and "cpu" not in Hn.MIN_TIMED_CALLS
    # On the CPU a duration still means at least 5 calls (with 5 rounds: one a round).
    log = []
    slow = _LoggedCase("slow", log)
    world = type("W", (), {"world_size": 1})()
    monkeypatch.setattr(Hn, "_estimate_ms", lambda step, device: 1e4)  # a call "takes" 10 s
    t, f = Hn.measure_interleaved([slow], torch.device("cpu"), world, ("n", 0), ("ms", 1.0), 5)
    assert not f and len(t["slow"]["ms"]) == 5


def test_measure_interleaved_call_mode_takes_the_cases_in_turn():
    """``interleave="call"``: each round's warm-up and timed calls go case by case in turn (a b
    a b ...), the order rotating between rounds; counts and input sets as in block mode; a case
    that raises is dropped and the others keep their calls."""
    log = []

    world = type("W", (), {"world_size": 1})()
    a, b = _LoggedCase("a", log), _LoggedCase("b", log)
    t, f = Hn.measure_interleaved(
        [a, b], torch.device("cpu"), world, ("n", 2), ("n", 6), rounds=2, interleave="call"
    )
    assert not f and len(t["a"]["ms"]) == len(t["b"]["ms"]) == 6
    assert a.calls == b.calls == list(range(8)), "warm-up + timed calls rotate the input sets"
    # round 0: 1 warm-up and 3 timed calls each, a first; round 1 the same, b first
    assert "".join(log) == "ab" + "ababab" + "ba" + "bababa", "".join(log)
    log.clear()
    a, b, c = _LoggedCase("a", log), _LoggedCase("b", log), _LoggedCase("c", log, fail_at=2)
    t, f = Hn.measure_interleaved(
        [a, b, c], torch.device("cpu"), world, ("n", 0), ("n", 6), rounds=2, interleave="call"
    )
    assert set(t) == {"a", "b"} and f == {"c": "RuntimeError: boom"}
    assert len(t["a"]["ms"]) == len(t["b"]["ms"]) == 6
    # round 0: c raises on its 3rd call and is dropped; round 1 (order b c a) skips it
    assert "".join(log) == "abcabcabc" + "bababa", "".join(log)
    with pytest.raises(ValueError, match="interleave"):
        Hn.measure_interleaved([a], torch.device("cpu"), world, ("n", 0), ("n", 1), 1, "row")


def test_cli_call_interleave_end_to_end(tmp_path):
    """``--interleave call`` through the CLI: every case timed and checked, the mode in the
    JSON."""
    j = tmp_path / "r.json"
    rc = main(
        [
            "layer1",
            "--preset",
            "tiny",
            *FAST,
            "--rounds",
            "2",
            "--interleave",
            "call",
            "--baselines",
            "grouped_mm,unfused",
            "--json",
            str(j),
            "--no-bounds",
        ]
    )
    assert rc == 0
    run = json.loads(j.read_text())["runs"][0]
    assert run["interleave"] == "call"
    names = {c["name"]: c for c in run["cases"]}
    assert set(names) == {"grouped_mm", "unfused", "fused"}
    assert all(c["status"] == "ok" and c["n"] == 1 for c in names.values()), names
    assert names["fused"]["check"] == "ok"


@pytest.mark.parametrize("interleave", ["block", "call"])
@pytest.mark.parametrize("when", ["estimate", "warm-up", "timed"])
def test_a_case_failing_on_one_rank_is_dropped_on_every_rank(when, interleave):
    """One rank's failure (an out-of-memory on its uneven share, a timeout only it saw) must
    drop the case on every rank together: a rank that skipped the case's collectives while its
    peers ran them left them waiting until the barrier timeout, and every result was lost."""

    class FakeCase:
        def __init__(self, name, world, fail_on_call=None):
            self.name, self.world, self.fail_on_call, self.n = name, world, fail_on_call, 0

        def step(self, i):
            self.n += 1
            if self.world.rank == 1 and self.n == self.fail_on_call:
                raise RuntimeError("out of memory on rank 1")

    from moe_overlap.testing import spawn

    # Counts in milliseconds take an estimate (calls 1-2) first; counts in calls do not, and
    # then each of the 3 rounds makes 1 warm-up call and 2 timed ones (calls 1-3, 4-6, 7-9).
    call = {"estimate": 1, "warm-up": 4, "timed": 5}[when]
    warm = ("ms", 0.01) if when == "estimate" else ("n", 3)

    def fn(world):
        cases = [FakeCase("a", world), FakeCase("b", world, call), FakeCase("c", world)]
        t, f = Hn.measure_interleaved(
            cases, torch.device("cpu"), world, warm, ("n", 6), 3, interleave
        )
        return t, f, cases[1].n

    res = spawn(2, fn, timeout=60)
    for rank, (timings, failures, _) in enumerate(res):
        assert set(timings) == {"a", "c"} and set(failures) == {"b"}, (rank, failures)
        assert len(timings["a"]["ms"]) == len(timings["c"]["ms"]) == 6
    assert res[1][1]["b"] == "RuntimeError: out of memory on rank 1"
    assert res[0][1]["b"] == "failed on rank 1"
    # rank 0 learns of the failure before its next timed call of b (a collective would wait
    # for rank 1 there), and only the calls of b already under way finish
    assert res[0][2] == {"estimate": 2, "warm-up": 4, "timed": 6}[when], res[0][2]


def test_json_holds_no_infinity_or_nan(tmp_path):
    """A candidate whose output holds NaN has relative error inf: strict JSON parsers refuse
    Python's ``Infinity``, so non-finite numbers are written as strings."""
    run = {"status": {"c": {"rel_err": {"b": math.inf, "d": 0.5}, "x": [math.nan, -math.inf]}}}
    path = R.write_json([run], {"gpu": None, "t": math.inf}, tmp_path / "r.json")

    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")

    doc = json.loads(path.read_text(), parse_constant=refuse)
    assert doc["runs"][0]["status"]["c"] == {
        "rel_err": {"b": "inf", "d": 0.5},
        "x": ["nan", "-inf"],
    }
    assert doc["env"]["t"] == "inf"


def test_cpu_device_on_a_gpu_machine_is_a_cpu_run(monkeypatch):
    """``--device cpu`` where CUDA exists: the CLI must still re-run itself under the
    interpreter, and the environment must not credit the CPU timings to GPU 0."""
    from moe_overlap.bench.__main__ import _needs_interpreter

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = build_parser().parse_args(["layer0", "--device", "cpu"])
    assert _needs_interpreter(args)
    assert not _needs_interpreter(build_parser().parse_args(["layer0", "--device", "cuda:0"]))
    assert not _needs_interpreter(build_parser().parse_args(["layer0"]))
    env = R.environment(torch.device("cpu"))
    assert env["gpu"] is None and "mean nothing" in env["note"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _needs_interpreter(args)  # already interpreted: no second re-execution


def test_a_case_built_on_one_rank_only_is_dropped_on_every_rank(monkeypatch):
    """A baseline whose setup fails on one rank (an out-of-memory on its uneven share) must be
    dropped everywhere: the first calls meet at a barrier per case, which that rank skipped."""
    from moe_overlap.testing import spawn

    build = B.build_baseline

    def flaky(op, name, problem, world):
        if name == "unfused" and world.rank == 1:
            raise RuntimeError("out of memory on rank 1")
        return build(op, name, problem, world)

    monkeypatch.setattr(B, "build_baseline", flaky)
    spec = Hn.RunSpec(
        op="layer1",
        shape=P.PRESETS["tiny"],
        dtype=torch.float32,
        device=torch.device("cpu"),
        world_size=2,
        baselines=["grouped_mm", "unfused"],
        candidates=[],
        warmup=("n", 0),
        rep=("n", 1),
        rounds=1,
    )
    res = spawn(2, lambda world: Hn.run_rank(world, spec), timeout=120)
    assert [r["status"]["unfused"]["status"] for r in res] == ["failed", "failed"]
    assert "out of memory on rank 1" in res[1]["status"]["unfused"]["reason"]
    assert "failed on rank 1" in res[0]["status"]["unfused"]["reason"]
    assert all(r["status"]["grouped_mm"]["status"] == "ok" for r in res)
    assert all(set(r["timings"]) == {"grouped_mm"} for r in res)


@pytest.mark.parametrize("interleave", ["block", "call"])
def test_a_lazily_raised_timeout_drops_the_case_that_timed_out(interleave):
    """Fused ops raise a timed-out wait at the next op: checked after each block of calls, the
    case whose kernels gave up is dropped, not the next case on the world. Call-interleaved,
    it surfaces only after the round: every case of that round is dropped, each with the
    error and a note that it could be any of them."""

    class World:
        world_size, pending = 1, False

        def check(self):
            if self.pending:
                self.pending = False
                raise RuntimeError("CommTimeoutError: rank 0 ...")

    world = World()

    class Case:
        def __init__(self, name, times_out=False):
            self.name, self.times_out = name, times_out

        def step(self, i):
            if self.times_out and i == 2:
                world.pending = True  # recorded on the device, raised later

    cases = [Case("a", times_out=True), Case("b")]
    t, f = Hn.measure_interleaved(
        cases, torch.device("cpu"), world, ("n", 0), ("n", 4), 1, interleave
    )
    if interleave == "block":
        assert set(f) == {"a"} and set(t) == {"b"}, (f, t)
    else:
        assert not t and set(f) == {"a", "b"}
        assert all("CommTimeoutError" in v and "any of its cases" in v for v in f.values()), f
