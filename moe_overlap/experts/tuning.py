"""Block configs of the fused MoE GEMMs: defaults, pinned (tuned) configs, and the tuner.

``moe-overlap-bench tune --preset NAME --op moe`` calls :func:`tune`, which times every
candidate on the preset's shape and returns the fastest; the CLI stores it in
``moe_overlap/bench/configs.json`` keyed by device, dtype, world size and shape. At run time
:func:`pinned` finds an entry for the same device, dtype, hidden size, FFN size, expert count
and top-k (any token count: the best tile shape depends on the GEMM's N and K far more than on
M), so a benchmark or training run never spends its minutes tuning.

One config covers both layers: layer 0 and layer 1 share BLOCK_M (experts are padded to it in
the routing layout); their N/K blocks, warps and stages are separate. ``--op moe`` also tunes
the backward's dispatch GEMM (``"l0b"``, same BLOCK_M): its epilogue loads the saved
pre-activations, so the forward's best tile is not its best. Tables written before it existed
have no ``"l0b"``; the backward then takes the measured default of ``layer0_config("dact")``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading

import torch

# (BM, BN, BK, warps, stages, GROUP_M) candidates; BM shared by both layers. Layer 0 runs two
# accumulators under SwiGLU, so its BN=128 is a 128x256 output tile. GROUP_M trades L2 reuse of
# the gathered rows (large) against reuse of the expert's weight slab (small): Mixtral's w1[e] is
# 235 MB, far over the H200's 50 MB of L2, so the sweep order decides how often it is re-read.
L0_CANDIDATES = [
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 3, 16),
    (128, 128, 64, 8, 4, 32),
    (128, 64, 64, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
]
L1_CANDIDATES = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 16),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
]

# The backward's dispatch GEMM (one accumulator; its epilogue also loads the saved gate and up
# tiles). The 7th field slices that epilogue into column pieces so 128x256 does not spill:
# measured on the H200 (tests/gpu/sweep_bwd.py, mixtral-8x7b / qwen3-30b-a3b / deepseek-v3),
# 128x256 in 4 slices 6.65 / 0.875 / 4.01 ms, in 2 slices 6.67 / 0.897 / 4.06, 128x128
# unsliced 7.96 / 1.205 / 4.64, 128x256 unsliced 16.6 / 3.3 (spilled).
L0B_CANDIDATES = [
    (128, 256, 64, 8, 3, 8, 4),
    (128, 256, 64, 8, 3, 8, 2),
    (128, 256, 64, 8, 3, 16, 4),
    (128, 256, 64, 8, 4, 8, 4),
    (128, 128, 64, 8, 4, 8),
    (64, 256, 64, 4, 3, 8, 4),
]


@functools.lru_cache(maxsize=64)
def _table_entries(device_name: str, dtype: str):
    try:
        from ..bench.presets import load_configs

        entries = load_configs()["entries"]
    except Exception:  # noqa: BLE001 - a broken table must not break the op: use defaults
        return ()
    keep = []
    for e in entries:
        if e.get("op") == "moe" and e.get("dtype") == dtype and e.get("device") == device_name:
            keep.append(e)
    return tuple(keep)


def pinned(device: torch.device, dtype: torch.dtype, H: int, F: int, E: int, K: int):
    """The pinned joint config ``{"l0": {...}, "l1": {...}}`` for this shape, or None
    (``MOE_OVERLAP_NO_PINNED=1``: None; read at every call, the table lookup is cached)."""
    if device.type != "cuda" or os.environ.get("MOE_OVERLAP_NO_PINNED") == "1":
        return None
    return _pinned(device, dtype, H, F, E, K)


@functools.lru_cache(maxsize=256)
def _pinned(device: torch.device, dtype: torch.dtype, H: int, F: int, E: int, K: int):
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype)
    name = torch.cuda.get_device_name(device)
    for e in _table_entries(name, short):
        s = e.get("shape", {})
        if (s.get("hidden"), s.get("ffn"), s.get("experts"), s.get("topk")) == (H, F, E, K):
            cfg = e.get("config", {})
            if "l0" in cfg and "l1" in cfg and cfg["l0"]["BM"] == cfg["l1"]["BM"]:
                return cfg
    return None


def _as_cfg(c):
    cfg = dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4], GM=c[5])
    if len(c) > 6:
        cfg["EPI"] = c[6]  # the epilogue's column slices
    return cfg


_THREAD = threading.local()


def getenv(name: str):
    """``os.environ.get(name)``, under this thread's :func:`_env` overrides: the switches and
    block configs ``tune`` varies are read through this. Emulated ranks are threads of one
    process timing candidates at once; edits of ``os.environ`` itself raced (one rank's
    restore unset what another was timing under, and a switch could stay set afterwards)."""
    over = getattr(_THREAD, "env", None)
    if over is not None and name in over:
        return over[name]
    return os.environ.get(name)


@contextlib.contextmanager
def _env(**kv):
    """This thread's overrides of :func:`getenv` for the block (nested blocks stack)."""
    prev = getattr(_THREAD, "env", None)
    _THREAD.env = {**(prev or {}), **kv}
    try:
        yield
    finally:
        _THREAD.env = prev


def tune(op: str, shape: dict, dtype: torch.dtype, world) -> dict:
    """Time every candidate pair on ``shape`` (tokens, hidden, ffn, experts, topk) and return
    the fastest as ``{"l0": cfg, "l1": cfg, "ms": {...}}``; ``op`` is "moe", "layer0" or
    "layer1" (which layer's time decides). Collective on ``world``.

    The candidates are the Triton kernels' blocks, so the warp-specialized Gluon kernels
    (``kernels/moe_ws.py``, which take both layers' GEMMs at one rank on Hopper and have
    configs of their own) are off while it times."""
    with _env(MOE_OVERLAP_L0_WS="0", MOE_OVERLAP_DACT_WS="0", MOE_OVERLAP_L1_WS="0"):
        return _tune(op, shape, dtype, world)


class _Candidate:
    """One config's call for :func:`_time_candidates`: ``fn()`` under this thread's ``env``."""

    def __init__(self, name, fn, env):
        self.name, self.fn, self.env = name, fn, env

    def step(self, i):
        with _env(**self.env):
            return self.fn()


def _time_candidates(cands: dict, world) -> dict:
    """``{key: median ms}`` of ``{key: (fn, env)}``, timed together: call by call in turn
    (``measure_interleaved(..., interleave="call")``), over rotating rounds, so that all of them
    see one clock. Timed one after another (``do_bench`` each, as before 2026-12-07), the first
    candidates ran at the card's top clock and the later ones nearer its power limit: at
    mixtral-8x22b on an H100 (2026-12-06) the first of six layer-0 candidates took 17.8 ms and
    the third, which differs from it only in ``GROUP_M``, 19.9, a gap of the size the power
    limit makes (the SM clock falls from 1.98 GHz to 1.1-1.6 within a second of such GEMMs;
    BENCHMARKS.md, "2026-12-07, later"). A candidate that raises (out of resources) is left
    out; none left is an error (no candidates at all: ``{}``, as the callers expect)."""
    from ..bench.harness import measure_interleaved

    if not cands:
        return {}

    dev = world.device
    cases = [_Candidate(k, fn, env) for k, (fn, env) in cands.items()]
    if dev.type == "cuda":
        warm, rep, rounds = ("n", 2), ("n", 10), 5
    else:  # the interpreter: prove the plumbing in one call each
        warm, rep, rounds = ("n", 0), ("n", 1), 1
    timings, failures = measure_interleaved(cases, dev, world, warm, rep, rounds, "call")
    if not timings:
        raise RuntimeError(f"tune: every candidate failed: {failures}")
    return {k: statistics.median(t["ms"]) for k, t in timings.items()}


def _agree(world, times: dict) -> dict:
    """Each candidate's time on its slowest rank (the same dict on every rank)."""
    if world.world_size == 1 or not times:
        return times
    keys = sorted(times)
    per_rank = world.all_gather_ints([round(times[k] * 1e6) for k in keys])
    return {k: max(r[i] for r in per_rank) / 1e6 for i, k in enumerate(keys)}


def _tune(op: str, shape: dict, dtype: torch.dtype, world) -> dict:
    from . import fused

    if op not in ("moe", "layer0", "layer1"):
        raise ValueError(f"tune supports the MoE ops moe, layer0, layer1; got {op!r}")
    T, H, F = int(shape["tokens"]), int(shape["hidden"]), int(shape["ffn"])
    E, K = int(shape["experts"]), int(shape["topk"])
    dev = world.device
    g = torch.Generator(device="cpu").manual_seed(1234 + world.rank)
    x = (torch.randn(T, H, generator=g) * 0.5).to(dev, dtype)
    logits = torch.randn(T, E, generator=g).to(dev)
    wts, ids = logits.softmax(-1).topk(K, -1)
    El = E // world.world_size
    w1 = (torch.randn(El, 2 * F, H, generator=g) * 0.02).to(dev, dtype)
    w2 = (torch.randn(El, H, F, generator=g) * 0.02).to(dev, dtype)

    # Each layer is timed on its own (a layer's time does not depend on the other's blocks), so
    # the sweep compiles len(L0) + len(L1) kernels rather than every pair; the pair is then chosen
    # among those sharing BLOCK_M (the layout pads experts to it).
    l0, l1 = list(L0_CANDIDATES), list(L1_CANDIDATES)
    if dev.type != "cuda":
        l0, l1 = l0[:1], l1[:1]  # the interpreter ignores block shapes' speed; prove the plumbing
    c0s = {}
    for c0 in l0:
        env = {"MOE_OVERLAP_L0_CONFIG": ",".join(map(str, c0))} if dev.type == "cuda" else {}
        with _env(**env):
            layout = fused.dispatch_layout(ids, E, world)
        c0s[c0] = (lambda layout=layout: fused.layer0(x, layout, w1, world), env)
    t0s = _time_candidates(c0s, world)
    c1s = {}
    for c1 in l1:
        # layer 0 at c1's BLOCK_M with its default blocks makes layer 1's input and layout
        c0 = next((c for c in l0 if c[0] == c1[0]), None)
        if c0 is None:
            continue
        env = {}
        if dev.type == "cuda":
            env = {
                "MOE_OVERLAP_L0_CONFIG": ",".join(map(str, c0)),
                "MOE_OVERLAP_L1_CONFIG": ",".join(map(str, c1)),
            }
        with _env(**env):
            layout = fused.dispatch_layout(ids, E, world)
            h = fused.layer0(x, layout, w1, world)
        c1s[c1] = (lambda layout=layout, h=h: fused.layer1(h, layout, wts, w2, world), env)
    t1s = _time_candidates(c1s, world)
    # One choice on every rank (they build one layout with its BLOCK_M): each candidate's
    # slowest rank decides.
    t0s, t1s = _agree(world, t0s), _agree(world, t1s)
    best = None
    for c0, t0 in t0s.items():
        for c1, t1 in t1s.items():
            if c0[0] != c1[0]:
                continue
            score = {"moe": t0 + t1, "layer0": t0, "layer1": t1}[op]
            if best is None or score < best[0]:
                best = (score, c0, c1, t0, t1)
    _, c0, c1, t0, t1 = best
    out = {
        "l0": _as_cfg(c0),
        "l1": _as_cfg(c1),
        "ms": {"layer0": t0, "layer1": t1},
        "candidates_ms": {
            "layer0": {",".join(map(str, c)): round(t, 4) for c, t in t0s.items()},
            "layer1": {",".join(map(str, c)): round(t, 4) for c, t in t1s.items()},
        },
    }
    if op == "moe":
        # The backward's dispatch GEMM, at the pair's BLOCK_M, on the pair's layout and saved
        # pre-activations (fused_experts' backward then reads it as "l0b").
        lb = [c for c in L0B_CANDIDATES if c[0] == c0[0]]
        if dev.type != "cuda":
            lb = lb[:1]
        env = {}
        if dev.type == "cuda":
            env = {"MOE_OVERLAP_L0_CONFIG": ",".join(map(str, c0))}
        with _env(**env):
            layout = fused.dispatch_layout(ids, E, world)
            ws = fused._workspace(world, layout, H, dtype)
            _, gu = fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws, save_gu=True)
            wflat = wts.contiguous().view(-1)
            row_scale = fused._bwd_row_scale(layout, wflat, fused._row_slots(layout, ws.slot))
            dy = (torch.randn(T, H, generator=g) * 0.5).to(dev, dtype)
            a_rows = None
            if world.world_size == 1:
                a_rows = fused._gather_rows(layout, dy, ws.recv, row_scale=row_scale)

            dw_slot = fused._dw_slot(layout, world, None, dy, w2.shape[2])
            args = (dy, layout, w2, world, wflat, row_scale, ws, gu, "swiglu", a_rows)

            def bwd():
                return fused._bwd_dispatch(*args, dw_slot=dw_slot)

            cbs = {}
            for cb in lb:
                benv = {"MOE_OVERLAP_L0B_CONFIG": ",".join(map(str, cb))}
                cbs[cb] = (bwd, {**env, **benv} if dev.type == "cuda" else env)
            tbs = _time_candidates(cbs, world)
        tbs = _agree(world, tbs)
        if tbs:
            cb = min(tbs, key=tbs.get)
            out["l0b"] = _as_cfg(cb)
            out["ms"]["backward_dispatch"] = tbs[cb]
            out["candidates_ms"]["backward_dispatch"] = {
                ",".join(map(str, c)): round(t, 4) for c, t in tbs.items()
            }
    return out
