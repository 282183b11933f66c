"""Testing helpers: emulated SPMD runs, one dtype-keyed tolerance table, verbose comparisons.

``spawn(world_size, fn, *args, device="cpu")`` runs ``fn(world, *args)`` for every virtual rank
of an emulated world (one thread per rank) and returns the per-rank results in rank order. A
rank that raises aborts the others' barriers, and spawn re-raises the first real error with its
rank, so a failing test never hangs.
"""

from __future__ import annotations

import threading
import traceback

import torch

from .world import resolve_device
from .world.emulated import EmulatedWorld, _Group, prefer_eager_module_loading

# Relative tolerances against a float64 reference (||out - ref|| / ||ref|| and elementwise).
# fp32 entries allow tf32-class dots (Triton's default on the GPU); the interpreter is exact fp32.
TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.float32: dict(rtol=2e-3, atol=2e-3),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def tolerance(dtype: torch.dtype) -> dict:
    return dict(TOLERANCES[dtype])


def spawn(
    world_size: int,
    fn,
    *args,
    device="cpu",
    mode: str = "sequential",
    timeout: float = 300.0,
    join_timeout: float | None = None,
    seed: int = 0,
    **kwargs,
):
    """Run ``fn(world, *args, **kwargs)`` on ``world_size`` emulated ranks; list of results."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if mode not in ("sequential", "concurrent"):
        raise ValueError(f"mode must be 'sequential' or 'concurrent', got {mode!r}")
    device = torch.device(device)
    if device.type == "cuda" and mode == "concurrent" and world_size > 1:
        prefer_eager_module_loading()  # before CUDA starts: see world/emulated.py
    device = resolve_device(device)
    if mode == "concurrent" and device.type != "cuda":
        raise ValueError("the concurrent mode needs a CUDA device")
    group = _Group(world_size, device, mode, timeout)
    # ``timeout`` bounds each barrier wait (one rank waiting for another); ``join_timeout``
    # bounds the whole run (default: no longer than a barrier plus a minute; long jobs such as
    # the training recipe pass their own).
    limit = timeout + 60 if join_timeout is None else join_timeout
    results = [None] * world_size
    errors: list = [None] * world_size

    def run(rank):
        # Backward on this rank's own thread: by default autograd runs every thread's CUDA nodes
        # on one shared device worker, where any host wait inside one rank's backward (a host
        # sync in a torch op, a cuBLAS handle made on first use, a barrier) sits in front of
        # the peer's launch its spinning kernel needs (world/emulated.py, "Backward threads").
        with torch.autograd.set_multithreading_enabled(False):
            _run(rank)

    def _run(rank):
        try:
            stream = group.streams[rank] if group.streams is not None else None
            if stream is not None:
                with torch.cuda.stream(stream):
                    world = EmulatedWorld(group, rank, seed=seed)
                    results[rank] = fn(world, *args, **kwargs)
                stream.synchronize()
            else:
                world = EmulatedWorld(group, rank, seed=seed)
                results[rank] = fn(world, *args, **kwargs)
        except threading.BrokenBarrierError as e:
            errors[rank] = e
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            e.__rank__ = rank
            e.__tb_text__ = traceback.format_exc()
            errors[rank] = e
            group.barrier.abort()

    if world_size == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit)
        if any(t.is_alive() for t in threads):
            group.barrier.abort()
            raise TimeoutError(f"emulated ranks did not finish within {limit} s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        e = real[0]
        if hasattr(e, "add_note"):
            e.add_note(f"(raised on emulated rank {e.__rank__})")
        raise e
    broken = [e for e in errors if e is not None]
    if broken:
        raise TimeoutError(f"an emulated barrier timed out after {timeout} s: {broken[0]!r}")
    return results


def randn(shape, dtype=torch.float32, device="cpu", generator=None, scale: float = 1.0):
    """Fresh random normal data (generated in fp32 on the CPU, so every device sees the same)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    t = torch.randn(*shape, generator=generator, dtype=torch.float32, device=gen_device) * scale
    return t.to(dtype=dtype, device=device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) or a sentinel (ints) so unwritten elements show."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-0x7EADBEEF if t.dtype in (torch.int32, torch.int64) else 0x7F)
    return t


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype=None,
    rtol=None,
    atol=None,
    name: str = "output",
    max_report: int = 5,
    baseline: torch.Tensor | None = None,
):
    """Compare against a (float64) reference with a report that says where and how much.

    Passes when every element satisfies ``|a - e| <= atol * scale + rtol * |e|`` where
    ``scale`` is the reference's RMS (so tolerances are relative to the data's magnitude), and
    no NaN/inf appears where the reference is finite.

    ``baseline``: the same quantity from a plain torch computation in the tested dtype (for
    example bf16 autograd). Where given, elements outside the table's tolerance are accepted
    when the whole tensor is as accurate as the baseline: max abs error and rel. error at most
    twice the baseline's. Rounding-order noise (a relu kink flipped by rounding, a long bf16
    sum of one sign) stays within that; a wrong row or a missing token moves values by the
    data's own scale and still fails.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    dtype = dtype or actual.dtype
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    rtol = tol["rtol"] if rtol is None else rtol
    atol = tol["atol"] if atol is None else atol
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if a.numel() == 0:
        return
    scale = e.pow(2).mean().sqrt().item() or 1.0
    bad_nonfinite = ~torch.isfinite(a) & torch.isfinite(e)
    diff = (a - e).abs()
    limit = atol * scale + rtol * e.abs()
    bad = (diff > limit) | bad_nonfinite
    if bad.any():
        n = int(bad.sum())
        idx = bad.nonzero()[:max_report]
        rows = [
            f"  at {tuple(i.tolist())}: got {a[tuple(i)].item():.6g}, "
            f"expected {e[tuple(i)].item():.6g}"
            for i in idx
        ]
        rel = (diff.nan_to_num(float("inf")).norm() / (e.norm() + 1e-30)).item()
        note = ""
        if baseline is not None:
            bdiff = (baseline.detach().to(torch.float64).cpu() - e).abs().nan_to_num(float("inf"))
            brel = (bdiff.norm() / (e.norm() + 1e-30)).item()
            bmax = bdiff.max().item()
            amax = diff.nan_to_num(float("inf")).max().item()
            if not bad_nonfinite.any() and amax <= 2 * bmax + 1e-12 and rel <= 2 * brel + 1e-12:
                return
            note = f"; baseline max abs diff {bmax:.3g}, rel. error {brel:.3g} (allowed 2x)"
        raise AssertionError(
            f"{name}: {n} of {a.numel()} elements differ ({int(bad_nonfinite.sum())} "
            f"non-finite); rel. error {rel:.3g} (rtol {rtol}, atol {atol} x rms {scale:.3g}); "
            f"max abs diff {diff.nan_to_num(float('inf')).max().item():.3g}{note}\n"
            + "\n".join(rows)
        )


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    return ((a - e).norm() / (e.norm() + 1e-30)).item()


def free_port() -> int:
    """A localhost TCP port nothing listens on now, for a process group's store. Ports derived
    from the pid could meet one a leftover process still serves, and a rank that joins a
    stranger's store waits forever."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ops_writing(fn, shapes) -> dict:
    """Run ``fn()`` and return ``{shape: [aten op, ...]}``: every op whose output has one of
    ``shapes``, in call order (views left out: they write nothing). Catches a backward that
    writes a whole weight-sized tensor per expert (what ``w[e]`` on a stacked leaf costs in
    autograd) where one write should do."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen = {tuple(s): [] for s in shapes}

    class _Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:
                return out
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and tuple(t.shape) in seen:
                    seen[tuple(t.shape)].append(str(func))
            return out

    with _Writes():
        fn()
    return seen
