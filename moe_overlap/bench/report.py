"""Benchmark output: a table on stdout (rich when it is there and stdout is a terminal), JSON
with every number and the environment, a PNG bar chart, and a markdown table for BENCHMARKS.md.

Ratios read ``t_baseline / t_candidate``: above 1 the candidate is faster. The summary lines
printed last say, per candidate, its time, TFLOP/s, its ratio to the GEMM floor
(``torch._grouped_mm`` / ``mm`` alone) and to the fastest baseline computing the same function,
and its relative error against that baseline.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = [
    "environment",
    "format_table",
    "summary_lines",
    "print_report",
    "write_json",
    "write_png",
    "append_markdown",
]


def environment(device=None) -> dict:
    """Versions, GPU name, date and the command line: enough to reproduce a number."""
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from .. import __version__

        env["moe_overlap"] = __version__
    except ImportError:
        env["moe_overlap"] = None
    env["git_commit"] = _git_commit()
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if on_gpu:
        idx = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        env["gpu"] = torch.cuda.get_device_name(idx)
        env["gpu_count"] = torch.cuda.device_count()
        env["sms"] = props.multi_processor_count
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        env["gpu"] = None
        env["note"] = "CPU run: timings are host wall-clock and mean nothing for performance"
    return env


def _command() -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if prog in ("__main__.py", "-m", "-c", ""):
        prog = "python -m moe_overlap.bench"
    return " ".join([prog] + sys.argv[1:])


def _git_commit(start: Path | None = None) -> str | None:
    """HEAD of the checkout this package lives in, read from .git without running git.

    A tree with uncommitted changes to tracked files (an A/B run copies one onto a device) gets
    ``+dirty``, so a table never claims a commit its code is not; that check needs ``git`` and
    is skipped where it is missing or slow.
    """
    here = Path(__file__).resolve() if start is None else Path(start).resolve()
    for d in (here, *here.parents):
        head = d / ".git" / "HEAD"
        if head.is_file():
            ref = head.read_text().strip()
            if ref.startswith("ref: "):
                f = d / ".git" / ref[5:]
                sha = f.read_text().strip() if f.is_file() else None
            else:
                sha = ref
            if sha is not None and _git_dirty(d):
                sha += "+dirty"
            return sha
    return None


def _git_dirty(root: Path) -> bool:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def _fmt(v, spec="{:.3f}", none="-"):
    return none if v is None else spec.format(v)


def _fmt_tf(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _fmt_err(c) -> str:
    if "err" not in c:
        return c.get("check_note", "-") if c.get("status") == "ok" else "-"
    mark = "" if c.get("check") == "ok" else " MISMATCH"
    return f"{c['err']:.1e} vs {c['err_ref']}{mark}"


def _title(run: dict) -> str:
    s = run["shape"]
    if run["op"] in ("ag-matmul", "matmul-rs"):
        dims = f"M={s['m']} N={s['n']} K={s['k']}"
    else:
        dims = (
            f"T={s['tokens']} H={s['hidden']} F={s['ffn']} E={s['experts']} K={s['topk']} "
            f"{s['activation']}"
        )
    bwd = " fwd+bwd" if run.get("backward") else ""
    return (
        f"{run['op']}{bwd} | {run['preset']} | {dims} | {run['dtype']} | "
        f"W={run['world_size']} ({run['world']}) | {run['device']}"
    )


def table_rows(run: dict) -> list[list[str]]:
    fastest = run.get("fastest_baseline")
    floor = run.get("floor")
    rows = []
    for c in run["cases"]:
        r = run["ratios"].get(c["name"], {})
        if c["status"] != "ok":
            rows.append([c["name"], c["role"], c["status"], "", "", "", "", c.get("reason", "")])
            continue
        rows.append(
            [
                c["name"] + (" *" if c["name"] == fastest else ""),
                c["role"],
                _fmt(c.get("median_ms")),
                _fmt_tf(c.get("tflops")),
                _fmt(r.get(floor), "{:.3f}x") if floor else "-",
                _fmt(r.get(fastest), "{:.3f}x") if fastest else "-",
                _fmt_err(c),
                c.get("note", ""),
            ]
        )
    return rows


HEADER = ["case", "role", "median ms", "TFLOP/s", "vs floor", "vs fastest", "rel. error", "note"]


def fill_line(run: dict) -> str | None:
    """How full the grouped GEMMs' row tiles are (MoE ops), or None."""
    from .harness import FILL_TILE_M

    fills = [f for f in run.get("tile_fill_per_rank") or [] if f is not None]
    if not fills:
        return None
    lo, hi = min(fills), max(fills)
    share = f"{lo:.1%}" if hi - lo < 5e-4 else f"{lo:.1%}-{hi:.1%} (over ranks)"
    return (
        f"routed rows fill {share} of their {FILL_TILE_M}-row GEMM tiles (each expert's rows "
        "rounded up to whole tiles; TFLOP/s count real rows only)"
    )


def bounds_line(run: dict) -> str | None:
    """The op's floors on this card (see ``harness.bounds``), or None without a GPU probe."""
    b = run.get("bounds") or {}
    if "bound" not in b:
        return None
    r = b["rates"]
    worst = max(b["per_rank"], key=lambda p: p["flops_issued"])
    cands = [
        c for c in run.get("cases", []) if c.get("share_of_floor") and c["role"] == "candidate"
    ]
    best = max(cands, key=lambda c: c["share_of_floor"]) if cands else None
    gb = max(p["bytes_min"] for p in b["per_rank"]) / 1e9
    line = (
        f"floors: compute {b['compute_floor_ms']:.3f} ms ({worst['flops_issued'] / 1e12:.2f} "
        f"TFLOP issued at this card's {r['mm_n']}^3 matmul rate, {r['mm_tflops']:.0f} TFLOP/s), "
        f"memory {b['memory_floor_ms']:.3f} ms (>= {gb:.2f} "
        f"GB at its copy bandwidth, {r['copy_tb_s']:.2f} TB/s): {b['bound']}-bound"
    )
    if best is not None:
        line += f"; {best['name']} at {best['share_of_floor']:.0%} of the floor"
    return line


def format_table(run: dict) -> str:
    """A plain-text table of one run."""
    rows = [HEADER] + table_rows(run)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    lines = [_title(run)]
    for k, r in enumerate(rows):
        cells = [r[i].ljust(widths[i]) for i in range(len(widths))] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    for cand, m in run.get("comm", {}).items():
        line = (
            f"{cand}: effective communication {m['effective_comm_ms']:.3f} ms "
            f"(overall - {m['gemm_case']} {m['gemm_ms']:.3f} ms)"
        )
        if "hidden_share" in m:
            line += (
                f"; communication alone {m['comm_alone_ms']:.3f} ms, {m['hidden_share']:.0%} hidden"
            )
        lines.append(line)
    for extra in (fill_line(run), bounds_line(run)):
        if extra:
            lines.append(extra)
    return "\n".join(lines)


def summary_lines(run: dict) -> list[str]:
    """The short lines printed last: one per candidate."""
    fastest, floor = run.get("fastest_baseline"), run.get("floor")
    by = {c["name"]: c for c in run["cases"]}
    out = []
    head = f"{run['op']}{' fwd+bwd' if run.get('backward') else ''} {run['preset']}"
    for c in run["cases"]:
        if c["role"] != "candidate":
            continue
        if c["status"] != "ok":
            out.append(f"{head}: {c['name']} {c['status']}: {c.get('reason', '')}")
            continue
        r = run["ratios"].get(c["name"], {})
        parts = [f"{head}: {c['name']} {c['median_ms']:.3f} ms"]
        if c.get("tflops"):
            parts.append(f"{_fmt_tf(c['tflops'])} TFLOP/s")
        if floor in r:
            parts.append(f"{r[floor]:.3f}x {floor}")
        if fastest in r:
            parts.append(
                f"{r[fastest]:.3f}x fastest baseline ({fastest} {by[fastest]['median_ms']:.3f} ms)"
            )
        if "err" in c:
            parts.append(f"rel. err {c['err']:.1e} vs {c['err_ref']} [{c['check']}]")
        elif c.get("check_note"):
            parts.append(f"check: {c['check_note']}")
        m = run.get("comm", {}).get(c["name"])
        if m:
            parts.append(f"effective comm {m['effective_comm_ms']:.3f} ms")
            if "hidden_share" in m:
                parts.append(f"{m['hidden_share']:.0%} of comm hidden")
        out.append(", ".join(parts))
    if not any(c["role"] == "candidate" for c in run["cases"]):
        out.append(f"{head}: no candidate requested")
    return out


def print_report(runs: list, env: dict, file=None) -> None:
    """Tables of every run, then the summary lines (CPU warning last of all)."""
    file = file or sys.stdout
    use_rich = file is sys.stdout and sys.stdout.isatty()
    for run in runs:
        if use_rich:
            try:
                _print_rich(run)
                continue
            except ImportError:
                pass
        print(format_table(run), file=file)
        print(file=file)
    print(
        "summary (ratios = t_baseline / t_candidate; > 1 means the candidate is faster):", file=file
    )
    for run in runs:
        for line in summary_lines(run):
            print("  " + line, file=file)
    if env.get("gpu") is None:
        print(
            "  NOTE: CPU run (no CUDA): host wall-clock timings of tiny shapes; these "
            "numbers mean nothing for performance.",
            file=file,
        )


def _print_rich(run: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=_title(run))
    for h in HEADER:
        t.add_column(h)
    for r in table_rows(run):
        t.add_row(*r)
    con = Console()
    con.print(t)
    for line in format_table(run).splitlines()[len(table_rows(run)) + 3 :]:
        con.print(line)


def _jsonable(run: dict) -> dict:
    return _finite({k: v for k, v in run.items() if k != "traces"})


def _finite(v):
    """JSON has no inf or NaN (Python writes ``Infinity``, which strict parsers refuse): they
    become the strings "inf", "-inf", "nan". A candidate whose output holds NaN (a timed-out
    wait's tile) has relative error inf, and that is worth keeping as such."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def write_json(runs: list, env: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": _finite(env), "runs": [_jsonable(r) for r in runs]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    return path


def write_png(runs: list, env: dict, path) -> Path | None:
    """One horizontal bar chart per run: TFLOP/s per case (ms where FLOPs mean nothing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in runs if any("median_ms" in c for c in r["cases"])]
    if not runs:
        return None
    colors = {"candidate": "#2e86ab", "baseline": "#a0a0a0", "floor": "#f18f01", "comm": "#c73e1d"}
    n = len(runs)
    fig, axes = plt.subplots(
        n,
        1,
        figsize=(10, 1.2 + 0.45 * sum(1 + sum("median_ms" in c for c in r["cases"]) for r in runs)),
        squeeze=False,
    )
    for ax, run in zip(axes[:, 0], runs):
        cs = [c for c in run["cases"] if "median_ms" in c]
        use_tf = all(c.get("tflops") for c in cs if c["role"] != "comm")
        cs = [c for c in cs if not (use_tf and c["role"] == "comm")]
        vals = [c["tflops"] if use_tf else c["median_ms"] for c in cs]
        ax.barh([c["name"] for c in cs], vals, color=[colors.get(c["role"], "k") for c in cs])
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.1f}" if use_tf else f" {v:.3f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s (higher is better)" if use_tf else "median ms (lower is better)")
        ax.set_title(_title(run), fontsize=8)
    where = env.get("gpu") or "CPU (numbers mean nothing)"
    fig.suptitle(f"moe_overlap benchmarks on {where}, torch {env.get('torch')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def append_markdown(runs: list, env: dict, path) -> Path:
    """Append one markdown table per run (BENCHMARKS.md style) with the exact command."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"<!-- moe-overlap-bench {env['date']} -->",
        f"Command: `{env['command']}`  ",
        f"Device: {env.get('gpu') or 'CPU (numbers mean nothing)'}, torch {env['torch']}, "
        f"triton {env.get('triton')}, commit {env.get('git_commit') or '?'}",
        "",
    ]
    for run in runs:
        lines.append(f"**{_title(run)}**")
        lines.append("")
        lines.append("| " + " | ".join(HEADER) + " |")
        lines.append("|" + "---|" * len(HEADER))
        for r in table_rows(run):
            lines.append("| " + " | ".join(x.replace("|", "/") for x in r) + " |")
        for cand, m in run.get("comm", {}).items():
            s = f"{cand}: effective communication {m['effective_comm_ms']:.3f} ms"
            if "hidden_share" in m:
                s += f", {m['hidden_share']:.0%} of communication hidden"
            lines += ["", s]
        for extra in (fill_line(run), bounds_line(run)):
            if extra:
                lines += ["", extra]
        lines.append("")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return path
