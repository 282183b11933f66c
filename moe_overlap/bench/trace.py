"""Per-tile timelines: a Chrome/Perfetto trace and a PNG from a fused kernel's event buffer.

Buffer contract (what a fused kernel writes when called with ``trace=buf``)
--------------------------------------------------------------------------
``buf`` is an int64 tensor ``[n_events, 6]``, one row per tile a program processed:

====  ==================  =====================================================
col   name                meaning
====  ==================  =====================================================
0     rank                the rank that ran the tile
1     sm                  SM id (``%smid``) or program id where no SM id is read
2     tile                tile id (op-defined: M-tile * n_tiles_n + N-tile, ...)
3     t_start_ns          global timer (``%globaltimer``) when the tile began
4     t_wait_done_ns      when its last wait returned (= t_start when it waited for nothing)
5     t_end_ns            when its epilogue stores were issued
====  ==================  =====================================================

Rows never written keep the fill of :func:`new_buffer` (zeros) and are dropped: a row counts
when ``t_end > 0`` and ``t_start <= t_wait_done <= t_end``; a ``t_wait_done`` of 0 means no wait
was recorded and reads as ``t_start``. The global timer is one clock for every SM of a GPU, so
emulated ranks on one GPU share a time axis; on several GPUs each rank's clock is its own (the
trace aligns each rank to its own first event and says so).

Output: the Chrome trace has one process per rank and one thread per SM, two complete events
per tile ("wait" and "compute", microseconds); the PNG draws, per rank and SM, wait time in one
colour and compute time in another. Both work on any such buffer (tests use a synthetic one
from :func:`synthetic_buffer`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "COLUMNS",
    "new_buffer",
    "valid_events",
    "summarize",
    "to_chrome",
    "write_chrome",
    "write_png",
    "synthetic_buffer",
]

COLUMNS = ("rank", "sm", "tile", "t_start_ns", "t_wait_done_ns", "t_end_ns")
WAIT_COLOR = "#e4572e"
COMPUTE_COLOR = "#2e86ab"


def new_buffer(capacity: int, device="cpu") -> torch.Tensor:
    """A zeroed ``[capacity, 6]`` int64 event buffer for a kernel's ``trace=`` argument."""
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    return torch.zeros((capacity, len(COLUMNS)), dtype=torch.int64, device=device)


def valid_events(buf: torch.Tensor, align_ranks: bool = False) -> torch.Tensor:
    """The written rows of ``buf`` as a CPU int64 tensor ``[n, 6]``, times in ns from the first
    event (of each rank when ``align_ranks``: separate clocks on separate GPUs)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() != 2 or buf.shape[1] != len(COLUMNS):
        raise ValueError(f"buf must be [n_events, {len(COLUMNS)}], got {tuple(buf.shape)}")
    if buf.dtype != torch.int64:
        raise TypeError(f"buf must be int64, got {buf.dtype}")
    ev = buf.detach().cpu().clone()
    wait = ev[:, 4]
    ev[:, 4] = torch.where(wait == 0, ev[:, 3], wait)
    ok = (ev[:, 5] > 0) & (ev[:, 3] <= ev[:, 4]) & (ev[:, 4] <= ev[:, 5]) & (ev[:, 0] >= 0)
    ev = ev[ok]
    if ev.numel() == 0:
        return ev
    if align_ranks:
        for r in ev[:, 0].unique().tolist():
            m = ev[:, 0] == r
            t0 = ev[m, 3].min()
            ev[m, 3:] -= t0
    else:
        ev[:, 3:] -= ev[:, 3].min()
    return ev


def summarize(buf: torch.Tensor, align_ranks: bool = False) -> dict:
    """Per rank: tiles, SMs, makespan, summed wait and compute time, wait share, SM busy share."""
    ev = valid_events(buf, align_ranks)
    out = {"events": int(ev.shape[0]), "dropped": int(buf.shape[0] - ev.shape[0]), "ranks": {}}
    for r in sorted(ev[:, 0].unique().tolist()):
        e = ev[ev[:, 0] == r]
        wait = (e[:, 4] - e[:, 3]).sum().item()
        comp = (e[:, 5] - e[:, 4]).sum().item()
        span = (e[:, 5].max() - e[:, 3].min()).item()
        sms = int(e[:, 1].unique().numel())
        out["ranks"][int(r)] = {
            "tiles": int(e.shape[0]),
            "sms": sms,
            "makespan_us": span / 1e3,
            "wait_us": wait / 1e3,
            "compute_us": comp / 1e3,
            "wait_share": wait / max(wait + comp, 1),
            "busy_share": comp / max(span * sms, 1),
        }
    return out


def to_chrome(buf: torch.Tensor, name: str = "tile", align_ranks: bool = False) -> dict:
    """A Chrome / Perfetto trace (JSON object format): pid = rank, tid = SM, "X" events in us."""
    ev = valid_events(buf, align_ranks)
    events = []
    ranks = sorted(ev[:, 0].unique().tolist()) if ev.numel() else []
    for r in ranks:
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": int(r),
                "tid": 0,
                "args": {"name": f"rank {r}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": int(r),
                "tid": 0,
                "args": {"sort_index": int(r)},
            }
        )
        for sm in sorted(ev[ev[:, 0] == r][:, 1].unique().tolist()):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": int(r),
                    "tid": int(sm),
                    "args": {"name": f"SM {sm}"},
                }
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": int(r),
                    "tid": int(sm),
                    "args": {"sort_index": int(sm)},
                }
            )
    for rank, sm, tile, t0, tw, t1 in ev.tolist():
        if tw > t0:
            events.append(
                {
                    "name": f"wait {tile}",
                    "cat": "wait",
                    "ph": "X",
                    "pid": rank,
                    "tid": sm,
                    "ts": t0 / 1e3,
                    "dur": (tw - t0) / 1e3,
                    "args": {"tile": tile},
                }
            )
        events.append(
            {
                "name": f"{name} {tile}",
                "cat": "compute",
                "ph": "X",
                "pid": rank,
                "tid": sm,
                "ts": tw / 1e3,
                "dur": (t1 - tw) / 1e3,
                "args": {"tile": tile},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "columns": list(COLUMNS),
            "align_ranks": align_ranks,
            "summary": summarize(buf, align_ranks),
        },
    }


def write_chrome(buf: torch.Tensor, path, name: str = "tile", align_ranks: bool = False) -> Path:
    """Write :func:`to_chrome` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_chrome(buf, name, align_ranks), f)
    return path


def write_png(
    buf: torch.Tensor,
    path,
    title: str = "",
    align_ranks: bool = False,
    max_sms_per_rank: int | None = None,
) -> Path | None:
    """Draw the timeline: one row per (rank, SM), wait in one colour, compute in another.

    Returns the path, or ``None`` (with nothing written) when matplotlib is missing.
    ``max_sms_per_rank`` keeps the first SMs of each rank only (long timelines stay readable).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    ev = valid_events(buf, align_ranks)
    ranks = sorted(ev[:, 0].unique().tolist()) if ev.numel() else []
    rows, y = {}, 0
    bounds = []
    for r in ranks:
        sms = sorted(ev[ev[:, 0] == r][:, 1].unique().tolist())
        if max_sms_per_rank is not None:
            sms = sms[:max_sms_per_rank]
        start = y
        for sm in sms:
            rows[(r, sm)] = y
            y += 1
        bounds.append((r, start, y))
        y += 1  # a blank row between ranks
    n_rows = max(y, 1)
    fig_h = min(2.0 + 0.06 * n_rows, 40.0)
    fig, ax = plt.subplots(figsize=(14, fig_h))
    waits: dict = {}
    comps: dict = {}
    for rank, sm, _tile, t0, tw, t1 in ev.tolist():
        row = rows.get((rank, sm))
        if row is None:
            continue
        if tw > t0:
            waits.setdefault(row, []).append((t0 / 1e3, (tw - t0) / 1e3))
        comps.setdefault(row, []).append((tw / 1e3, (t1 - tw) / 1e3))
    for row, segs in comps.items():
        ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=COMPUTE_COLOR, linewidth=0)
    for row, segs in waits.items():
        ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=WAIT_COLOR, linewidth=0)
    ax.set_ylim(n_rows, -1)
    ax.set_yticks([(a + b - 1) / 2 for _, a, b in bounds])
    ax.set_yticklabels([f"rank {r}\n({b - a} SMs)" for r, a, b in bounds])
    for _, a, _b in bounds[1:]:
        ax.axhline(a - 1, color="0.8", linewidth=0.5)
    ax.set_xlabel("time (us)" + (", each rank from its own first tile" if align_ranks else ""))
    summ = summarize(buf, align_ranks)
    shares = ", ".join(
        f"r{r}: wait {v['wait_share']:.0%}, busy {v['busy_share']:.0%}"
        for r, v in summ["ranks"].items()
    )
    ax.set_title((title + "\n" if title else "") + shares, fontsize=9)
    ax.legend(
        handles=[
            Patch(color=WAIT_COLOR, label="wait"),
            Patch(color=COMPUTE_COLOR, label="compute"),
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def synthetic_buffer(
    world_size: int = 4, sms: int = 8, tiles_per_sm: int = 6, seed: int = 0, pad_rows: int = 5
) -> torch.Tensor:
    """A made-up buffer with the kernel's layout: tiles on each (rank, SM) back to back, the
    first tiles of remote data waiting longer; ``pad_rows`` unwritten (zero) rows at the end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    base = 1_000_000_000
    for r in range(world_size):
        for sm in range(sms):
            t = base + int(torch.randint(0, 2000, (1,), generator=g))
            for j in range(tiles_per_sm):
                tile = sm * tiles_per_sm + j
                wait = int(torch.randint(0, 4000, (1,), generator=g)) if j < 2 and r % 2 else 0
                comp = 5000 + int(torch.randint(0, 3000, (1,), generator=g))
                rows.append([r, sm, tile, t, t + wait, t + wait + comp])
                t += wait + comp + 200
    buf = torch.tensor(rows, dtype=torch.int64)
    return torch.cat([buf, torch.zeros((pad_rows, len(COLUMNS)), dtype=torch.int64)])


def main(argv=None) -> int:
    """``python -m moe_overlap.bench.trace BUF.pt OUT.json [--png OUT.png]``: convert a saved
    buffer (``torch.save`` of the int64 tensor)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moe_overlap.bench.trace")
    ap.add_argument("buffer", help="a torch.save'd int64 [n, 6] tensor")
    ap.add_argument("out", help="Chrome trace JSON path")
    ap.add_argument("--png", default=None)
    ap.add_argument("--align-ranks", action="store_true")
    a = ap.parse_args(argv)
    buf = torch.load(a.buffer, map_location="cpu")
    write_chrome(buf, a.out, align_ranks=a.align_ranks)
    print(f"wrote {a.out}")
    if a.png:
        p = write_png(buf, a.png, align_ranks=a.align_ranks)
        print(f"wrote {a.png}" if p else "matplotlib missing: no PNG")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
