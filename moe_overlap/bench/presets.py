"""Benchmark shapes (ANCHORS.md) and the pinned table of tuned kernel configs.

MoE presets give H, F (per expert), E, top-k, the router's score function and the token count
per rank (16384, DeepSeek-V3 8192, as in ANCHORS.md). ``tiny`` is for CPU smoke tests only:
its numbers mean nothing.

Dense TP ops (``ag-matmul``, ``matmul-rs``) take ``(M, N, K)`` with global sizes:

* ``ag-matmul``: ``x [M, K]`` is gathered from row shards ``[M/W, K]``; the weight is
  column-parallel, ``[N/W, K]`` per rank; each rank computes ``[M, N/W]``.
* ``matmul-rs``: the weight is row-parallel, ``[N, K/W]`` per rank; each rank computes the
  partial ``[M, N]`` and keeps its reduced ``[M/W, N]``.

A model preset maps to its expert MLP as a dense TP layer: ``ag-matmul`` is the up+gate
projection ``(M, N, K) = (tokens, w1 rows, H)``; ``matmul-rs`` is the down projection
``(tokens, H, F)``. ``gpt3-175b`` is Flux's dense shape ((N, K) = (49152, 12288) for AG+GEMM,
(12288, 49152) for GEMM+RS, M 8192).

Pinned configs (``configs.json`` beside this file): a list of entries keyed by device name,
op, dtype, world size and the exact shape, each holding the config dict a tuning hook returned.
Fused ops read theirs with :func:`lookup_config` (no match -> ``None``: use the op's defaults),
so a benchmark run never spends its minutes tuning; ``moe-overlap-bench tune`` rewrites one
entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "MoEShape",
    "DenseShape",
    "PRESETS",
    "MODEL_PRESETS",
    "DENSE_ONLY",
    "get_moe_shape",
    "get_dense_shape",
    "CONFIGS_PATH",
    "load_configs",
    "lookup_config",
    "store_config",
]


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer to benchmark. ``tokens`` is per rank."""

    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    activation: str = "swiglu"
    score_func: str = "softmax"
    note: str = ""

    def __post_init__(self):
        for k in ("tokens", "hidden", "ffn", "experts", "topk"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be a positive int, got {v!r}")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) must be <= experts ({self.experts})")
        if self.activation not in ("swiglu", "gelu", "relu", "silu"):
            raise ValueError(f"activation must be swiglu/gelu/relu/silu, got {self.activation!r}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be softmax/sigmoid, got {self.score_func!r}")

    @property
    def w1_rows(self) -> int:
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DenseShape:
    """A dense TP GEMM: global ``M`` rows, ``N`` outputs, ``K`` inputs (see module docstring)."""

    name: str
    m: int
    n: int
    k: int
    note: str = ""

    def __post_init__(self):
        for key in ("m", "n", "k"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key} must be a positive int, got {v!r}")

    def as_dict(self) -> dict:
        return asdict(self)


_P = MoEShape
PRESETS: dict[str, MoEShape] = {
    "mixtral-8x7b": _P("mixtral-8x7b", 16384, 4096, 14336, 8, 2, note="SwiGLU"),
    "mixtral-8x22b": _P("mixtral-8x22b", 16384, 6144, 16384, 8, 2),
    "phi-3.5-moe": _P("phi-3.5-moe", 16384, 4096, 6400, 16, 2),
    "qwen1.5-moe": _P(
        "qwen1.5-moe",
        16384,
        2048,
        1408,
        60,
        4,
        note="routed experts only (shared expert not benchmarked)",
    ),
    "qwen3-30b-a3b": _P("qwen3-30b-a3b", 16384, 2048, 768, 128, 8),
    "deepseek-v3": _P(
        "deepseek-v3",
        8192,
        7168,
        2048,
        256,
        8,
        score_func="sigmoid",
        note="routed experts only, sigmoid router without group limit",
    ),
    "olmoe": _P("olmoe", 16384, 2048, 1024, 64, 8),
    "tiny": _P("tiny", 64, 32, 48, 4, 2, note="CPU smoke test: numbers mean nothing"),
}
MODEL_PRESETS = tuple(k for k in PRESETS if k != "tiny")

# Dense-only presets: (M, N, K) for AG+GEMM; GEMM+RS swaps N and K.
DENSE_ONLY: dict[str, tuple[int, int, int]] = {
    "gpt3-175b": (8192, 49152, 12288),
}


def get_moe_shape(preset: str | None = None, **overrides) -> MoEShape:
    """A preset (default ``mixtral-8x7b``) with any non-None field in ``overrides`` replaced.

    ``overrides`` use the field names (tokens, hidden, ffn, experts, topk, activation,
    score_func); a shape with overrides is renamed ``<preset>+custom`` (or ``custom``).
    """
    if preset is not None and preset in DENSE_ONLY:
        raise ValueError(f"preset {preset!r} is a dense-TP shape: use ag-matmul / matmul-rs")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    base = PRESETS[preset or "mixtral-8x7b"]
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return base
    d = base.as_dict()
    d.update(changes)
    d["name"] = f"{preset}+custom" if preset else "custom"
    d["note"] = ""
    return MoEShape(**d)


def get_dense_shape(op: str, preset: str | None = None, m=None, n=None, k=None) -> DenseShape:
    """The ``(M, N, K)`` of ``op`` ('ag-matmul' or 'matmul-rs') for a preset, with overrides."""
    if op not in ("ag-matmul", "matmul-rs"):
        raise ValueError(f"op must be 'ag-matmul' or 'matmul-rs', got {op!r}")
    name = preset or "gpt3-175b"
    if name in DENSE_ONLY:
        M, N, K = DENSE_ONLY[name]
        if op == "matmul-rs":
            N, K = K, N
        note = "Flux's dense shape"
    elif name in PRESETS:
        s = PRESETS[name]
        M, N, K = (
            (s.tokens, s.w1_rows, s.hidden) if op == "ag-matmul" else (s.tokens, s.hidden, s.ffn)
        )
        note = "the expert MLP's " + ("up+gate" if op == "ag-matmul" else "down") + " projection"
    else:
        raise ValueError(
            f"unknown preset {name!r}; choose from {sorted(PRESETS) + sorted(DENSE_ONLY)}"
        )
    if any(v is not None for v in (m, n, k)):
        M, N, K = m or M, n or N, k or K
        name = f"{name}+custom"
        note = ""
    return DenseShape(name, M, N, K, note)


# ---------------------------------------------------------------------------- pinned configs
CONFIGS_PATH = Path(__file__).with_name("configs.json")


@dataclass
class _Table:
    version: int = 1
    note: str = ""
    entries: list = field(default_factory=list)


def _configs_path(path=None) -> Path:
    if path is not None:
        return Path(path)
    env = os.environ.get("MOE_OVERLAP_CONFIGS")
    return Path(env) if env else CONFIGS_PATH


def load_configs(path=None) -> dict:
    """The config table (``{"version", "note", "entries": [...]}``); empty if the file is absent.

    ``MOE_OVERLAP_CONFIGS`` points at another table (for example a freshly tuned one).
    """
    p = _configs_path(path)
    if not p.exists():
        return asdict(_Table())
    with open(p) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{p}: not a config table (needs a list under 'entries')")
    return data


def _norm_shape(shape: dict) -> dict:
    return {str(k): int(v) for k, v in sorted(shape.items())}


def lookup_config(
    op: str, shape: dict, dtype: str, device_name: str | None = None, world_size: int = 1, path=None
) -> dict | None:
    """The pinned config for ``op`` on this exact ``shape`` (dict of ints), or ``None``.

    ``dtype`` is a short name ('bf16', 'fp16', 'fp32'); ``device_name`` as
    ``torch.cuda.get_device_name()`` reports it (None matches any device).
    """
    want = _norm_shape(shape)
    for e in load_configs(path)["entries"]:
        if e.get("op") != op or e.get("dtype") != dtype:
            continue
        if int(e.get("world_size", 1)) != int(world_size):
            continue
        if device_name is not None and e.get("device") != device_name:
            continue
        if _norm_shape(e.get("shape", {})) == want:
            return dict(e.get("config", {}))
    return None


def store_config(
    op: str,
    shape: dict,
    dtype: str,
    device_name: str,
    config: dict,
    world_size: int = 1,
    preset: str | None = None,
    extra: dict | None = None,
    path=None,
) -> Path:
    """Insert or replace one entry and rewrite the table (sorted, stable diffs)."""
    p = _configs_path(path)
    table = load_configs(p)
    key = (device_name, op, dtype, int(world_size), json.dumps(_norm_shape(shape)))
    entries = [
        e
        for e in table["entries"]
        if (
            e.get("device"),
            e.get("op"),
            e.get("dtype"),
            int(e.get("world_size", 1)),
            json.dumps(_norm_shape(e.get("shape", {}))),
        )
        != key
    ]
    entry = {
        "device": device_name,
        "op": op,
        "dtype": dtype,
        "world_size": int(world_size),
        "preset": preset,
        "shape": _norm_shape(shape),
        "config": config,
    }
    if extra:
        entry.update(extra)
    entries.append(entry)
    entries.sort(
        key=lambda e: (e["device"], e["op"], str(e.get("preset")), e["dtype"], e["world_size"])
    )
    table["entries"] = entries
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, p)
    return p
