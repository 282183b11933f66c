"""The tuning hook and the pinned-config lookup of the fused MoE GEMMs."""

import json
import os

import pytest
import torch

from moe_overlap.experts import tuning
from moe_overlap.testing import spawn


def test_tune_returns_a_joint_config_with_one_block_m():
    shape = dict(tokens=12, hidden=16, ffn=8, experts=4, topk=2)
    cfg = spawn(2, lambda w: tuning.tune("moe", shape, torch.float32, w))[0]
    assert cfg["l0"]["BM"] == cfg["l1"]["BM"]
    assert set(cfg["l0"]) == {"BM", "BN", "BK", "num_warps", "num_stages", "GM"}
    assert set(cfg["candidates_ms"]) == {"layer0", "layer1", "backward_dispatch"}
    assert cfg["ms"]["layer0"] > 0 and cfg["ms"]["layer1"] > 0
    # the backward's dispatch GEMM gets its own config, at the pair's BLOCK_M
    assert cfg["l0b"]["BM"] == cfg["l0"]["BM"] and cfg["ms"]["backward_dispatch"] > 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_candidates_are_timed_in_turn_each_under_its_own_config(monkeypatch, device):
    """All candidates share every round, call by call (so all see one GPU clock), each call
    under its own config; one that raises is left out; none left is an error. ``"cuda"`` runs
    the GPU's counts on the CPU (CUDA events swapped for the host clock)."""
    from moe_overlap.bench import harness

    log = []
    if device == "cuda":
        dev = torch.device("cuda")
        monkeypatch.setattr(harness, "_sync", lambda d: None)
        monkeypatch.setattr(harness.torch.cuda, "Event", _HostEvent)
    else:
        dev = torch.device("cpu")
    world = type("W", (), {"world_size": 1, "device": dev})()

    def cand(name, fail=False):
        def fn():
            log.append((name, tuning.getenv("MOE_OVERLAP_L0_CONFIG")))
            if fail:
                raise RuntimeError("out of resources")

        return fn, {"MOE_OVERLAP_L0_CONFIG": name}

    t = tuning._time_candidates({"a": cand("a"), "b": cand("b"), "c": cand("c", True)}, world)
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())
    assert all(name == cfg for name, cfg in log), "each call under its own config"
    order = "".join(n for n, _ in log)
    if device == "cpu":
        assert order == "abc"
    else:
        # 5 rounds, the order rotating (a b c, b c a, c a b, ...); 2 warm-up calls (rounds 0
        # and 1) and 10 timed ones (2 a round) each; c raises on its first call, in round 0
        want = "abc" + "abab" + "ba" + "baba" + "abab" + "abab" + "baba"
        assert order == want, order
    with pytest.raises(RuntimeError, match="every candidate failed"):
        tuning._time_candidates({"c": cand("c", True)}, world)
    assert tuning._time_candidates({}, world) == {}  # e.g. no backward candidate at a BLOCK_M


class _HostEvent:
    """Stands in for ``torch.cuda.Event`` where a test runs the GPU path on the CPU."""

    def __init__(self, **kw):
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_tune_times_the_triton_kernels_and_restores_the_environment(monkeypatch):
    # The candidates are Triton blocks: the warp-specialized Gluon kernels, which would take
    # layer 0's GEMMs at one rank on Hopper whatever the candidate, are off while tune() times.
    seen = []

    def fake(op, shape, dtype, world):
        names = ("MOE_OVERLAP_L0_WS", "MOE_OVERLAP_DACT_WS", "MOE_OVERLAP_L1_WS")
        seen.append(tuple(tuning.getenv(n) for n in names))
        return {}

    monkeypatch.setattr(tuning, "_tune", fake)
    monkeypatch.setenv("MOE_OVERLAP_L0_WS", "1")
    monkeypatch.delenv("MOE_OVERLAP_DACT_WS", raising=False)
    tuning.tune("moe", {}, torch.bfloat16, None)
    assert seen == [("0", "0", "0")]
    assert os.environ["MOE_OVERLAP_L0_WS"] == "1" and "MOE_OVERLAP_DACT_WS" not in os.environ
    assert tuning.getenv("MOE_OVERLAP_L0_WS") == "1"


def test_pinned_backward_dispatch_config_is_used(monkeypatch):
    from moe_overlap.experts import fused

    monkeypatch.setattr(fused, "interpreted", lambda: False)
    pin = {
        "l0": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, GM=16),
        "l1": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, GM=8),
        "l0b": dict(BM=128, BN=64, BK=64, num_warps=4, num_stages=4, GM=8),
    }
    assert fused.layer0_config("dact", 2, pin) == pin["l0b"]
    del pin["l0b"]  # older tables: the measured default, never the forward's config
    dflt = fused.layer0_config("dact", 2, pin)
    assert (dflt["BM"], dflt["BN"], dflt["num_stages"], dflt["EPI"]) == (128, 256, 3, 4)
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", "128,128,64,8,3,16")
    assert fused.layer0_config("dact", 2, pin)["num_stages"] == 3
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", "128,256,64,8,3,16,2")
    assert fused.layer0_config("dact", 2, pin)["EPI"] == 2
    for bad in (
        "128,256,64,8,3,16,3",
        "128,16,64,8,3,16,4",
        "128,32,64,8,3,16,8",
        "128,256,64,8,3,16,16",
        "128,256,64,8,3,16,2,1",
    ):
        monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", bad)
        with pytest.raises(ValueError, match="MOE_OVERLAP_L0B_CONFIG"):
            fused.layer0_config("dact", 2, pin)


def test_pinned_lookup_matches_shape_and_ignores_tokens(tmp_path, monkeypatch):
    entry = {
        "device": "NVIDIA H200",
        "op": "moe",
        "dtype": "bf16",
        "world_size": 1,
        "shape": {"tokens": 16384, "hidden": 4096, "ffn": 14336, "experts": 8, "topk": 2},
        "config": {
            "l0": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
            "l1": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
        },
    }
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"version": 1, "note": "", "entries": [entry]}))
    monkeypatch.setenv("MOE_OVERLAP_CONFIGS", str(path))
    tuning._table_entries.cache_clear()
    try:
        got = tuning._table_entries("NVIDIA H200", "bf16")
        assert len(got) == 1 and got[0]["config"]["l0"]["BM"] == 64
        assert tuning._table_entries("NVIDIA H100", "bf16") == ()
        # pinned() only applies on CUDA devices: the CPU always uses the interpreter configs.
        assert tuning.pinned(torch.device("cpu"), torch.bfloat16, 4096, 14336, 8, 2) is None
    finally:
        tuning._table_entries.cache_clear()


def test_no_pinned_switch_is_read_at_every_call(tmp_path, monkeypatch):
    """``MOE_OVERLAP_NO_PINNED=1`` turns the table off even after a shape was looked up (the
    switch sat inside the cached lookup)."""
    cfg = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4}
    entry = {"device": "NVIDIA H200", "op": "moe", "dtype": "bf16", "world_size": 1,
             "shape": {"tokens": 16, "hidden": 64, "ffn": 32, "experts": 4, "topk": 2},
             "config": {"l0": cfg, "l1": cfg}}  # fmt: skip
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"version": 1, "note": "", "entries": [entry]}))
    monkeypatch.setenv("MOE_OVERLAP_CONFIGS", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    tuning._table_entries.cache_clear()
    tuning._pinned.cache_clear()
    try:
        args = (torch.device("cuda", 0), torch.bfloat16, 64, 32, 4, 2)
        assert tuning.pinned(*args)["l0"]["BM"] == 64
        monkeypatch.setenv("MOE_OVERLAP_NO_PINNED", "1")
        assert tuning.pinned(*args) is None
        monkeypatch.delenv("MOE_OVERLAP_NO_PINNED")
        assert tuning.pinned(*args)["l0"]["BM"] == 64
    finally:
        tuning._table_entries.cache_clear()
        tuning._pinned.cache_clear()


def test_env_config_takes_group_m_and_rejects_bad_lengths(monkeypatch):
    from moe_overlap.experts import fused

    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", "128,128,64,8,4,32")
    assert fused.layer0_config("swiglu") == dict(
        BM=128, BN=128, BK=64, num_warps=8, num_stages=4, GM=32
    )
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", "128,128,64")
    try:
        fused.layer0_config("swiglu")
    except ValueError as e:
        assert "MOE_OVERLAP_L0_CONFIG" in str(e)
    else:
        raise AssertionError("a 3-field config was accepted")


def test_pinned_swiglu_config_does_not_leak_into_plain_gemms(monkeypatch):
    from moe_overlap.experts import fused

    monkeypatch.setattr(fused, "interpreted", lambda: False)
    pin = {
        "l0": dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, GM=16),
        "l1": dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, GM=8),
    }
    assert fused.layer0_config("swiglu", 2, pin) == pin["l0"]
    plain = fused.layer0_config("plain", 2, pin)
    assert plain["BM"] == 64 and plain["BN"] == 256 and "GM" not in plain


def test_tune_on_emulated_ranks_keeps_its_switches_per_thread(monkeypatch):
    """``tune`` runs on every emulated rank as a thread at once: its switches hold on every
    rank while it times, never leak into the process's environment, and every rank returns
    the same choice (each candidate's slowest rank decides)."""
    import os
    import threading

    from moe_overlap.experts import fused
    from moe_overlap.testing import spawn

    seen = []
    real = fused._bwd_dispatch

    def spy(*a, **k):
        seen.append((threading.current_thread().name, tuning.getenv("MOE_OVERLAP_DACT_WS")))
        return real(*a, **k)

    monkeypatch.setattr(fused, "_bwd_dispatch", spy)
    monkeypatch.delenv("MOE_OVERLAP_DACT_WS", raising=False)
    monkeypatch.delenv("MOE_OVERLAP_L0_WS", raising=False)
    shape = dict(tokens=8, hidden=16, ffn=8, experts=4, topk=2)
    for _ in range(3):
        seen.clear()
        outs = spawn(2, lambda w: tuning.tune("moe", shape, torch.float32, w))
        assert seen and all(v == "0" for _, v in seen), seen
        assert "MOE_OVERLAP_DACT_WS" not in os.environ and "MOE_OVERLAP_L0_WS" not in os.environ
        assert outs[0]["ms"] == outs[1]["ms"] and outs[0]["l0"] == outs[1]["l0"]
    assert tuning.getenv("MOE_OVERLAP_DACT_WS") is None


def test_checked_in_table_is_consistent(monkeypatch):
    """The shipped ``moe_overlap/bench/configs.json``: one entry per (device, preset, dtype,
    world size), each entry's shape its preset's, a joint config the lookup accepts (one block
    M for both layers, valid block sizes), every preset pinned on the H100 and on the H200,
    and each card's entries found under its own name."""
    from moe_overlap.bench.presets import MODEL_PRESETS, get_moe_shape, load_configs

    monkeypatch.delenv("MOE_OVERLAP_CONFIGS", raising=False)  # the shipped table, not a copy
    entries = [e for e in load_configs()["entries"] if e.get("op") == "moe"]
    keys = [(e["device"], e["preset"], e["dtype"], e["world_size"]) for e in entries]
    assert len(keys) == len(set(keys)), keys
    for e in entries:
        s, cfg = get_moe_shape(e["preset"]), e["config"]
        want = {"hidden": s.hidden, "ffn": s.ffn, "experts": s.experts, "topk": s.topk}
        assert {k: e["shape"][k] for k in want} == want, e["preset"]
        assert cfg["l0"]["BM"] == cfg["l1"]["BM"], e["preset"]
        for part in ("l0", "l1", "l0b"):
            if part in cfg:
                c = cfg[part]
                assert {"BM", "BN", "BK", "num_warps", "num_stages"} <= set(c), (e["preset"], c)
                assert all(c[k] in (16, 32, 64, 128, 256) for k in ("BM", "BN", "BK")), c
                assert c["num_warps"] in (4, 8) and 2 <= c["num_stages"] <= 5, c
    for card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        pinned = {p for d, p, dt, w in keys if d == card and dt == "bf16"}
        assert pinned == set(MODEL_PRESETS), (card, sorted(set(MODEL_PRESETS) - pinned))
    tuning._table_entries.cache_clear()
    try:
        for d in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
            got = {e["preset"] for e in tuning._table_entries(d, "bf16")}
            assert got == {p for dd, p, dt, w in keys if dd == d and dt == "bf16"}, d
    finally:
        tuning._table_entries.cache_clear()
