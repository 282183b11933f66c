"""Block configs of the fused MoE GEMMs: defaults, pinned (tuned) configs, and the tuner.

``moe-overlap-bench tune --preset NAME --op moe`` calls :func:`tune`, which times every
candidate on the preset's shape and returns the fastest; the CLI stores it in
``moe_overlap/bench/configs.json`` keyed by device, dtype, world size and shape. At run time
:func:`pinned` finds an entry for the same device, dtype, hidden size, FFN size, expert count
and top-k (any token count: the best tile shape depends on the GEMM's N and K far more than on
M), so a benchmark or training run never spends its minutes tuning.

One config covers both layers: layer 0 and layer 1 share BLOCK_M (experts are padded to it in
the routing layout); their N/K blocks, warps and stages are separate.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

# (BM, BN, BK, warps, stages) candidates; BM shared by both layers.
L0_CANDIDATES = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),
]
L1_CANDIDATES = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 256, 32, 8, 4),
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


@functools.lru_cache(maxsize=256)
def pinned(device: torch.device, dtype: torch.dtype, H: int, F: int, E: int, K: int):
    """The pinned joint config ``{"l0": {...}, "l1": {...}}`` for this shape, or None (cached:
    this runs on every forward)."""
    if device.type != "cuda" or os.environ.get("MOE_OVERLAP_NO_PINNED") == "1":
        return None
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
    return dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4])


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update(kv)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tune(op: str, shape: dict, dtype: torch.dtype, world) -> dict:
    """Time every candidate pair on ``shape`` (tokens, hidden, ffn, experts, topk) and return
    the fastest as ``{"l0": cfg, "l1": cfg, "ms": {...}}``; ``op`` is "moe", "layer0" or
    "layer1" (which layer's time decides). Collective on ``world``."""
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

    def timed(fn):
        if dev.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    results = []
    pairs = [(a, b) for a in L0_CANDIDATES for b in L1_CANDIDATES if a[0] == b[0]]
    if dev.type != "cuda":
        pairs = pairs[:1]  # the interpreter ignores block shapes' speed; prove the plumbing
    for c0, c1 in pairs:
        env = {
            "MOE_OVERLAP_L0_CONFIG": ",".join(map(str, c0)),
            "MOE_OVERLAP_L1_CONFIG": ",".join(map(str, c1)),
        }
        if dev.type != "cuda":
            env = {}
        with _env(**env):
            layout = fused.dispatch_layout(ids, E, world)
            h = fused.layer0(x, layout, w1, world)
            t0 = timed(lambda layout=layout: fused.layer0(x, layout, w1, world))
            t1 = timed(lambda layout=layout, h=h: fused.layer1(h, layout, wts, w2, world))
        score = {"moe": t0 + t1, "layer0": t0, "layer1": t1}[op]
        results.append((score, c0, c1, t0, t1))
    score, c0, c1, t0, t1 = min(results, key=lambda r: r[0])
    return {"l0": _as_cfg(c0), "l1": _as_cfg(c1), "ms": {"layer0": t0, "layer1": t1}}
