"""Benchmark harness: builds every case of one op, checks it, times it, derives the metrics.

Flow of one run (:func:`run`), the same on every rank:

1. Build the rank's random inputs (never zeros; several input sets that rotate so the L2
   cache does not hold them across calls), then every requested baseline and candidate. A
   missing fused op or baseline becomes ``unavailable: <reason>``, never a crash.
2. Call each case once (compiles, warms caches) and keep its output of set 0 in canonical form.
   Every output is compared with every baseline computing the same function (relative error
   ``||a - b|| / ||b||``), so the report can quote the error against the fastest baseline.
   Then the outputs are freed.
3. Time the cases interleaved (``--rounds``, default 5: each round warms and times every case
   for its share of the calls, the order rotating), per-call CUDA events (host clock on the
   CPU), median of all calls. ``--warmup``/``--rep`` take counts (``20``) or milliseconds
   (``100ms``: counts derived from a two-call estimate, at least 20 timed calls on a GPU, 5 on
   the CPU) per case, split over the rounds. All ranks run the same counts.
4. Metrics: TFLOP/s from the counted FLOPs (:func:`flops_layer0` ...), each candidate's speedup
   over each baseline (``t_baseline / t_candidate``), and with several ranks the effective
   communication time (``candidate - best non-split GEMM``) and, where the communication alone
   was measured (real ranks), the share of it hidden. On a GPU, the op's floors
   (:func:`bounds`): issued GEMM FLOPs at the card's dense matmul rate and the op's least HBM
   traffic (:func:`min_bytes`) at its copy bandwidth, both probed at the start of the run
   (:func:`device_rates`), and each case's share of the larger.

Several ranks: emulated ranks on one GPU (``testing.spawn(..., mode="concurrent")``) share the
device clock, so an iteration's time is ``max(end) - min(start)`` over the ranks' events; real
ranks (torchrun) use the slowest rank's time per iteration. Each rank's events are recorded on
its own stream. FLOPs and TFLOP/s count all ranks together.
"""

from __future__ import annotations

import importlib
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..world import resolve_device
from . import baselines as B
from .baselines import Case, Unavailable
from .presets import DenseShape, MoEShape

__all__ = [
    "RunSpec",
    "flops_layer0",
    "flops_layer1",
    "flops_moe",
    "flops_dense",
    "min_bytes",
    "parse_amount",
    "run",
    "rel_error",
    "CANDIDATES",
]

MOE_OPS = ("layer0", "layer1", "moe")
DENSE_OPS = ("ag-matmul", "matmul-rs")
ALL_OPS = MOE_OPS + DENSE_OPS


# ------------------------------------------------------------------------------------ FLOPs
def flops_layer0(M: int, H: int, F: int, activation: str = "swiglu") -> float:
    """Layer 0 (gate+up or up): ``2 * M * H * (2F for swiglu, else F)``, M = kept rows T*K."""
    return 2.0 * M * H * (2 * F if activation == "swiglu" else F)


def flops_layer1(M: int, F: int, H: int) -> float:
    """Layer 1 (down): ``2 * M * F * H``."""
    return 2.0 * M * F * H


def flops_moe(M: int, H: int, F: int, activation: str = "swiglu", backward: bool = False) -> float:
    """Both expert GEMMs (router excluded); backward adds 2x (dgrad + wgrad): 3x in all."""
    f = flops_layer0(M, H, F, activation) + flops_layer1(M, F, H)
    return 3.0 * f if backward else f


def flops_dense(op: str, M: int, N: int, K: int, world_size: int = 1) -> float:
    """Per-rank FLOPs: ag-matmul ``2 M (N/W) K``; matmul-rs ``2 M N (K/W)``."""
    if op == "ag-matmul":
        return 2.0 * M * (N // world_size) * K
    if op == "matmul-rs":
        return 2.0 * M * N * (K // world_size)
    raise ValueError(f"unknown dense op {op!r}")


# ------------------------------------------------------------------------------------- spec
def parse_amount(text) -> tuple[str, float]:
    """``"100ms"`` -> ``("ms", 100.0)``; ``"20"`` -> ``("n", 20)``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return ("n", int(text))
    s = str(text).strip().lower()
    try:
        if s.endswith("ms"):
            v = float(s[:-2])
            if v <= 0:
                raise ValueError
            return ("ms", v)
        if s.endswith("s"):
            v = float(s[:-1]) * 1e3
            if v <= 0:
                raise ValueError
            return ("ms", v)
        v = int(s)
        if v < 0:
            raise ValueError
        return ("n", v)
    except ValueError:
        raise ValueError(
            f"expected a count (20) or a duration (100ms, 0.5s), got {text!r}"
        ) from None


@dataclass
class RunSpec:
    """What to run. ``shape`` is a MoEShape (layer0/layer1/moe) or a DenseShape."""

    op: str
    shape: MoEShape | DenseShape
    dtype: torch.dtype
    device: torch.device
    world_size: int = 1
    backward: bool = False
    baselines: list | None = None  # None: all of the op's
    candidates: list | None = None  # None: all of the op's
    warmup: tuple = ("ms", 100.0)
    rep: tuple = ("ms", 500.0)
    rounds: int = 5  # timing rounds, every case in each (see measure_interleaved)
    interleave: str = "block"  # "block" or "call" (see measure_interleaved)
    n_sets: int | None = None
    check: bool = True
    trace: bool = False
    trace_capacity: int = 1 << 18
    bounds: bool = True  # probe the GPU's matmul rate and copy bandwidth for the floors
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------- candidates
def _import_attrs(module: str, *names: str):
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - anything failing at import makes it unavailable
        raise Unavailable(f"{module} does not import ({type(e).__name__}: {e})") from e
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise Unavailable(f"{module} has no {', '.join(missing)} yet")
    return [getattr(mod, n) for n in names]


def _takes_trace(fn) -> bool:
    try:
        return "trace" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _layout_perm(layout, n_rows: int, W: int) -> torch.Tensor:
    """Rows of a fused layer-0 output in canonical order: (local expert, source rank, source
    order), padding rows left out. Needs the layout's ``row_src`` / ``row_local_expert``."""
    src = getattr(layout, "row_src", None)
    le = getattr(layout, "row_local_expert", None)
    if src is None or le is None:
        raise Unavailable("the layout has no row_src / row_local_expert to compare rows")
    R = min(n_rows, src.numel())
    src = src[:R].long()
    le = le[:R].long()
    tok = getattr(layout, "row_tok", None)
    valid = src >= 0
    if tok is not None:
        valid &= tok[:R].long() != -2
    idx = torch.arange(R, device=src.device)[valid]
    key = le[valid] * (W * R) + src[valid] * R + idx
    return idx[torch.sort(key).indices]


def _cand_layer(p: B.MoEProblem, world, which: str) -> Case:
    dispatch_layout, layer0, layer1 = _import_attrs(
        "moe_overlap.experts.fused", "dispatch_layout", "layer0", "layer1"
    )
    s, W = p.shape, world.world_size
    n = len(p.sets)
    # The tuned config that fused_experts would use for this shape (None when none is pinned).
    pin_fn = getattr(importlib.import_module("moe_overlap.experts.tuning"), "pinned", None)
    pin = pin_fn(p.device, p.dtype, s.hidden, s.ffn, s.experts, s.topk) if pin_fn else None
    layouts = [dispatch_layout(x.topk_ids_TK, s.experts, world, pinned=pin) for x in p.sets]
    infos = B._sorted_info(p, world)
    M = B._M(infos)
    if which == "layer0":

        def step(i, trace=None):
            kw = {} if trace is None else {"trace": trace}
            return layer0(
                p.sets[i % n].x_TH, layouts[i % n], p.w1, world, activation=s.activation, **kw
            )

        def canon(h):
            try:
                return h.index_select(0, _layout_perm(layouts[0], h.shape[0], W))
            except Unavailable:
                return None

        return Case(
            "fused",
            "candidate",
            step,
            canon,
            B._flops_l0(p, M),
            note="moe_overlap.experts.fused.layer0",
            trace_step=step if _takes_trace(layer0) else None,
        )
    # Layer 1's input in the fused layout: layer 0 runs once per set (untimed; with several
    # ranks it also records on the layout where remote rows landed, which layer 1 needs),
    # then its rows are replaced by the baselines' canonical ones so both sides get the same
    # input (kept as they are when the layout cannot be mapped).
    hs = []
    for st, h_c, lay in zip(p.sets, B.layer0_h(p, world), layouts):
        h = layer0(st.x_TH, lay, p.w1, world, activation=s.activation)
        try:
            perm = _layout_perm(lay, h.shape[0], W)
            h = torch.zeros_like(h)
            h[perm] = h_c
        except Unavailable:
            pass
        hs.append(h)
    w_dtype = [torch.float32]

    def call(i, trace=None):
        kw = {} if trace is None else {"trace": trace}
        st = p.sets[i % n]
        return layer1(hs[i % n], layouts[i % n], st.topk_w_TK.to(w_dtype[0]), p.w2, world, **kw)

    try:  # the weights' dtype is not pinned by the contract: fp32 first, then x's
        call(0)
    except TypeError:
        w_dtype[0] = p.dtype
    return Case(
        "fused",
        "candidate",
        call,
        lambda y: y,
        B._flops_l1(p, M),
        note="moe_overlap.experts.fused.layer1",
        trace_step=call if _takes_trace(layer1) else None,
    )


def _cand_layer0(p, world):
    return _cand_layer(p, world, "layer0")


def _cand_layer1(p, world):
    return _cand_layer(p, world, "layer1")


def _cand_fused_experts(p: B.MoEProblem, world, static: bool = False) -> Case:
    """``static``: ``max_tokens_per_rank`` = the tokens per rank, so the layout is sized for the
    worst case and the layer has no host sync (the exact sizing reads the counts back once)."""
    (fused_experts,) = _import_attrs("moe_overlap", "fused_experts")
    s = p.shape

    def fwd(x, wr, w1, w2, j):
        ids, w = B.torch_route(x, wr, s.topk, s.score_func)
        kw = {"max_tokens_per_rank": x.shape[0]} if static else {}
        return fused_experts(x, ids, w, w1, w2, world=world, activation=s.activation, **kw)

    step, canon = B._moe_step(p, fwd)
    name = "fused_experts_static" if static else "fused_experts"
    note = "torch router + moe_overlap.fused_experts"
    return Case(
        name,
        "candidate",
        step,
        canon,
        B._moe_flops(p, B._M(B._sorted_info(p, world))),
        note=note + (" (max_tokens_per_rank: no host sync)" if static else ""),
    )


def _cand_fused_experts_static(p: B.MoEProblem, world) -> Case:
    return _cand_fused_experts(p, world, static=True)


def _cand_moe_layer(p: B.MoEProblem, world) -> Case:
    MoEConfig, MoELayer = _import_attrs("moe_overlap", "MoEConfig", "MoELayer")
    s = p.shape
    cfg = MoEConfig(
        s.hidden,
        s.ffn,
        s.experts,
        s.topk,
        score_func=s.score_func,
        norm_topk_prob=True,
        activation=s.activation,
    )
    layer = MoELayer(cfg, world=world, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        layer.router.weight.copy_(p.wr_EH)
        # Share the problem's expert weights instead of copying them (22 GB at DeepSeek-V3).
        for name, w in (("gate_up_proj", p.w1), ("down_proj", p.w2)):
            cur = getattr(layer.experts, name)
            if cur.shape == w.shape and cur.dtype == w.dtype:
                setattr(layer.experts, name, torch.nn.Parameter(w.detach()))
            else:
                cur.copy_(w)
    n = len(p.sets)
    params = [layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    if p.backward:
        xs = [st.x_TH.detach().clone().requires_grad_(True) for st in p.sets]

        def step(i):
            x = xs[i % n]
            y = layer(x)
            g = torch.autograd.grad(y, [x, *params], p.sets[i % n].gy_TH)
            return (y.detach(), *g)
    else:

        def step(i):
            with torch.no_grad():
                return layer(p.sets[i % n].x_TH)

    return Case(
        "MoELayer",
        "candidate",
        step,
        B.bwd_canon if p.backward else (lambda o: o),
        B._moe_flops(p, B._M(B._sorted_info(p, world))),
        note="moe_overlap.MoELayer (its own router)",
    )


def _cand_dense(p: B.DenseProblem, world) -> Case:
    name = "all_gather_matmul" if p.op == "ag-matmul" else "matmul_reduce_scatter"
    (fn,) = _import_attrs("moe_overlap", name)
    n = len(p.xs)

    def step(i, trace=None):
        kw = {} if trace is None else {"trace": trace}
        return fn(p.xs[i % n], p.weight, world, **kw)

    return Case(
        "fused",
        "candidate",
        step,
        lambda y: y,
        B._dense_flops(p),
        note=f"moe_overlap.{name}",
        trace_step=step if _takes_trace(fn) else None,
    )


CANDIDATES: dict[str, dict[str, Callable]] = {
    "layer0": {"fused": _cand_layer0},
    "layer1": {"fused": _cand_layer1},
    "moe": {
        "fused_experts": _cand_fused_experts,
        "fused_experts_static": _cand_fused_experts_static,
        "MoELayer": _cand_moe_layer,
    },
    "ag-matmul": {"fused": _cand_dense},
    "matmul-rs": {"fused": _cand_dense},
}


# ---------------------------------------------------------------------------- check cases
def _ref_check_case(p: B.MoEProblem, world) -> Case:
    """moe_overlap.reference on set 0 in float64 (forward output only): not timed."""
    if world.world_size > 1:
        raise Unavailable("the float64 reference check runs with one rank")
    limit = (12 << 30) if p.device.type == "cuda" else (1 << 30)
    if (p.w1.numel() + p.w2.numel()) * 8 > limit:
        raise Unavailable("weights too large for a float64 copy")
    try:
        from .. import reference
    except Exception as e:  # noqa: BLE001 - being written in parallel
        raise Unavailable(f"moe_overlap.reference does not import: {e!r}") from e
    if not hasattr(reference, "experts"):
        raise Unavailable("moe_overlap.reference has no experts()")
    st, s = p.sets[0], p.shape

    def step(i):
        with torch.no_grad():
            return reference.experts(
                st.x_TH.double(),
                st.topk_ids_TK,
                st.topk_w_TK.double(),
                p.w1.double(),
                p.w2.double(),
                activation=s.activation,
            )

    return Case("reference", "check", step, lambda y: y, 0.0, note="float64 reference")


def _dense_check_case(p: B.DenseProblem, world) -> Case:
    """The op's result through plain gathers on every rank (untimed), for any world."""
    W = world.world_size

    def gather(t):
        if W == 1:
            return [t]
        if hasattr(world, "all_gather_tensor"):
            return world.all_gather_tensor(t)
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(out, t.contiguous(), group=world.group)
        return out

    def step(i):
        x = p.xs[0]
        if p.op == "ag-matmul":
            return torch.cat(gather(x)).float() @ p.weight.float().t()
        part = x.float() @ p.weight.float().t()
        total = sum(gather(part))
        m = part.shape[0] // W
        return total[world.rank * m : (world.rank + 1) * m]

    return Case("reference", "check", step, lambda y: y, 0.0, note="gather + fp32 mm")


# ----------------------------------------------------------------------------- measuring
def _sync(device):
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _check(world) -> None:
    """Raise a timed-out wait of the calls just made here, not at the next case's first op
    (fused ops raise lazily): the case whose kernels gave up is the one dropped."""
    check = getattr(world, "check", None)
    if check is not None:
        check()


# Fewest timed calls a duration (``--rep 500ms``) gives a case on a GPU. Ten calls of a 50 ms
# step were too few under the power cap: on an H100 (2026-12-07) three candidates running the
# same kernels came out 7% apart at mixtral-8x7b fwd+bwd with 10 calls each, the order of the
# three reversed in three runs of 30 calls (at most 5% apart). Elsewhere (the CPU interpreter,
# where timings mean nothing) _MIN_TIMED_CALLS_ELSEWHERE.
MIN_TIMED_CALLS = {"cuda": 20}
_MIN_TIMED_CALLS_ELSEWHERE = 5


def _counts(warm, rep, est_ms, min_rep: int = _MIN_TIMED_CALLS_ELSEWHERE) -> tuple[int, int]:
    def n_of(spec, lo, hi):
        kind, v = spec
        if kind == "n":
            return int(v)
        return int(min(hi, max(lo, math.ceil(v / max(est_ms, 1e-3)))))

    return n_of(warm, 1, 200), max(1, n_of(rep, min_rep, 1000))


def _estimate_ms(step, device) -> float:
    """Mean time of two calls (host clock), on this rank only."""
    _sync(device)
    t0 = time.perf_counter()
    for i in range(2):
        step(i)
    _sync(device)
    return (time.perf_counter() - t0) / 2 * 1e3


def _agree(world, err: str | None, *values: int) -> tuple[str | None, list[list[int]]]:
    """One collective every rank reaches at the same point whether or not its part raised:
    ``(error, values of every rank)``, the error set on every rank if any rank failed (its
    own message where it failed, the failing ranks' numbers elsewhere). A rank that skipped
    a collective after its own failure would leave its peers waiting for it."""
    if world.world_size == 1:
        return err, [list(values)]
    got = world.all_gather_ints([int(err is not None), *values])
    bad = [r for r, v in enumerate(got) if v[0]]
    if bad and err is None:
        err = f"failed on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
    return err, [v[1:] for v in got]


def _timed_calls(step, device, first: int, n: int) -> dict:
    """``n`` calls ``step(first + j)``, each between two CUDA events (host clock on the CPU)."""
    if device.type == "cuda":
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        for j, (a, b) in enumerate(ev):
            a.record()
            step(first + j)
            b.record()
        _sync(device)
        return {"ms": [a.elapsed_time(b) for a, b in ev], "events": ev}
    ms = []
    for j in range(n):
        t = time.perf_counter()
        step(first + j)
        ms.append((time.perf_counter() - t) * 1e3)
    return {"ms": ms}


def measure_interleaved(
    cases, device, world, warm, rep, rounds: int, interleave: str = "block"
) -> tuple[dict, dict]:
    """Time every case of ``cases`` (objects with ``name`` and ``step``) in ``rounds`` rounds:
    each round gives every case its share of the warm-up and of the timed calls, the case order
    rotating from round to round. A GPU's clock follows its temperature and power draw, so
    cases timed one after another in a fixed order are not timed under the same conditions
    (measured on the H200, 2026-12-03: the same fused kernel took 11.0 ms in a short profiled
    burst and 12.7 ms after a long run of other GEMMs); interleaving spreads that drift over
    all cases alike.

    ``interleave="block"`` (the default) times each case's share of a round as one block of
    back-to-back calls. ``"call"`` runs the round's calls case by case in turn (A B C A B C
    ...), with no synchronization between them, so every case sees the same clock within a
    call of the others. That matters where a GEMM holds the card at its power limit: there the
    SM clock swings between ~1.15 and ~1.6 GHz over tenths of a second with what ran before, and
    a block of 100 ms catches one level or the other whole (H100, 2026-12-07, mixtral-8x22b
    layer 0: blocks of six calls at 18 or at 22 ms for ``grouped_mm`` and the fused kernel
    alike, the SM clock 1.42-1.58 GHz in the fast blocks and 1.16-1.25 in the slow ones), so a
    median over five blocks moves by whole blocks. Call by call, a case's first kernel waits
    for the host only where the case before it synchronized; and a wait that timed out is
    raised only after the round, so it drops all of the round's cases.

    Returns ``(timings, failures)``: ``{name: {"ms": [...], "events": [...]}}`` and ``{name:
    "Type: message"}`` for cases whose timing raised (dropped from later rounds)."""
    if interleave not in ("block", "call"):
        raise ValueError(f"interleave must be 'block' or 'call', got {interleave!r}")
    rounds = max(1, int(rounds))
    plan, failures = {}, {}
    for c in cases:
        est, err = 1.0, None
        if warm[0] == "ms" or rep[0] == "ms":
            try:
                est = _estimate_ms(c.step, device)
            except Exception as e:  # noqa: BLE001 - a broken case must not stop the others
                err = f"{type(e).__name__}: {e}"
        # Every rank runs the same counts: the slowest rank's estimate sets them.
        err, ests = _agree(world, err, int(est * 1000))
        if err is not None:
            failures[c.name] = err
            continue
        plan[c.name] = _counts(
            warm,
            rep,
            max(v[0] for v in ests) / 1000,
            MIN_TIMED_CALLS.get(device.type, _MIN_TIMED_CALLS_ELSEWHERE),
        )
    live = [c for c in cases if c.name in plan]
    timings = {c.name: {"ms": [], "events": []} for c in live}
    calls = dict.fromkeys(plan, 0)  # input sets keep rotating across rounds
    for r in range(rounds):
        k = r % len(live) if live else 0
        if interleave == "call":
            _call_round(
                live[k:] + live[:k], plan, calls, timings, failures, device, world, r, rounds
            )
            continue
        for c in live[k:] + live[:k]:
            if c.name in failures:  # agreed by every rank, so all skip it alike
                continue
            # Round r's share: the counts split as evenly as they go (1 call: round 0 only).
            n_warm, n_rep = (n // rounds + (r < n % rounds) for n in plan[c.name])
            if n_rep == 0:
                continue
            err = None
            try:
                for _ in range(n_warm):
                    c.step(calls[c.name])
                    calls[c.name] += 1
                _sync(device)
                _check(world)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
            # Agreeing doubles as the barrier that starts every rank's timed calls together.
            err, _ = _agree(world, err)
            if err is None:
                try:
                    t = _timed_calls(c.step, device, calls[c.name], n_rep)
                    calls[c.name] += n_rep
                    _check(world)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
                err, _ = _agree(world, err)
            if err is not None:
                failures[c.name] = err
                continue
            timings[c.name]["ms"] += t["ms"]
            timings[c.name]["events"] += t.get("events", [])
    for name in failures:
        timings.pop(name, None)
    for t in timings.values():
        if not t["events"]:
            t.pop("events")
    return timings, failures


def _call_round(order, plan, calls, timings, failures, device, world, r, rounds) -> None:
    """One round of :func:`measure_interleaved` with ``interleave="call"``: warm-up and timed
    calls case by case in turn. A case that raises is dropped on every rank alike: the ranks
    agree on each case after the warm-up (so none starts timed calls of a collective case that
    another rank gave up) and after the timed calls, as the block mode does per case."""
    note = " (raised after a call-interleaved round: any of its cases)"
    share = {}
    for c in order:
        if c.name in failures:
            continue
        n_warm, n_rep = (n // rounds + (r < n % rounds) for n in plan[c.name])
        if n_rep:
            share[c.name] = (n_warm, n_rep)
    live = [c for c in order if c.name in share]
    errs: dict = {}

    def one(c, ev=None):
        try:
            if ev is not None:
                ev[0].record()
            c.step(calls[c.name])
            if ev is not None:
                ev[1].record()
            calls[c.name] += 1
        except Exception as e:  # noqa: BLE001 - a broken case must not stop the others
            errs[c.name] = f"{type(e).__name__}: {e}"

    def settle(into: dict) -> None:
        # A wait that timed out is raised here, after all the calls: which case's kernels gave
        # up is not known, so every case not yet failed takes the error.
        try:
            _sync(device)
            _check(world)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}{note}"
            errs.update({c.name: msg for c in live if c.name not in errs})
        for c in live:  # one collective per case, on every rank, whatever failed where
            err, _ = _agree(world, errs.get(c.name))
            if err is not None:
                into[c.name] = err

    for j in range(max((w for w, _ in share.values()), default=0)):
        for c in live:
            if j < share[c.name][0] and c.name not in errs:
                one(c)
    settle(errs)
    got = {c.name: [] for c in live}
    for j in range(max(n for _, n in share.values()) if share else 0):
        for c in live:
            if j < share[c.name][1] and c.name not in errs:
                if device.type == "cuda":
                    ev = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    one(c, ev)
                    got[c.name].append(ev)
                else:
                    t = time.perf_counter()
                    one(c)
                    got[c.name].append((time.perf_counter() - t) * 1e3)
    settle(failures)
    for c in live:
        if c.name in failures:
            continue
        vals = got[c.name]
        if device.type == "cuda":
            timings[c.name]["ms"] += [a.elapsed_time(b) for a, b in vals]
            timings[c.name]["events"] += vals
        else:
            timings[c.name]["ms"] += vals


def stats(ms: list) -> dict:
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]
    return {
        "median_ms": statistics.median(s),
        "min_ms": s[0],
        "max_ms": s[-1],
        "mean_ms": statistics.fmean(s),
        "p20_ms": q(0.2),
        "p80_ms": q(0.8),
        "n": len(s),
    }


def rel_error(a, b) -> float | None:
    """``||a - b|| / ||b||`` in float64; tuples compare element-wise (max) over their common
    prefix; ``None`` when shapes differ. NaN anywhere gives ``inf``."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        aa = list(a) if isinstance(a, (tuple, list)) else [a]
        bb = list(b) if isinstance(b, (tuple, list)) else [b]
        errs = []
        for x, y in zip(aa, bb):
            if x is None or y is None:
                continue
            e = rel_error(x, y)
            if e is None:
                return None
            errs.append(e)
        return max(errs) if errs else None
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    x = a.detach().to(torch.float64)
    y = b.detach().to(torch.float64).to(x.device)
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - y).norm() / (y.norm() + 1e-30))


# ------------------------------------------------------------------------------ one rank
def _build_problem(spec: RunSpec, world):
    if spec.op in MOE_OPS:
        return B.make_moe_problem(
            spec.shape,
            world.world_size,
            world.rank,
            spec.dtype,
            spec.device,
            spec.n_sets,
            spec.backward,
            spec.seed,
        )
    return B.make_dense_problem(
        spec.op,
        spec.shape,
        world.world_size,
        world.rank,
        spec.dtype,
        spec.device,
        spec.n_sets,
        spec.seed,
    )


def _names(requested, available) -> list:
    if requested is None:
        return list(available)
    bad = [n for n in requested if n not in available]
    if bad:
        raise ValueError(f"unknown name(s) {bad}; choose from {list(available)}")
    return list(requested)


def case_names(op: str) -> tuple[list, list]:
    """(baseline names, candidate names) of ``op``."""
    return B.baseline_names(op), list(CANDIDATES[op])


def run_rank(world, spec: RunSpec) -> dict:
    """Everything one rank does (see the module docstring). Returns raw, per-rank results."""
    torch.manual_seed(spec.seed)
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    problem = _build_problem(spec, world)
    base_names, cand_names = case_names(spec.op)
    builders = []
    for n in _names(spec.baselines, base_names):
        builders.append((n, "baseline", lambda n=n: B.build_baseline(spec.op, n, problem, world)))
    for n in _names(spec.candidates, cand_names):
        builders.append((n, "candidate", lambda n=n: CANDIDATES[spec.op][n](problem, world)))
    if spec.check:
        chk = _ref_check_case if spec.op == "moe" and not spec.backward else None
        if spec.op in DENSE_OPS:
            chk = _dense_check_case
        if chk is not None:
            builders.append(("reference", "check", lambda chk=chk: chk(problem, world)))

    cases: list[Case] = []
    status: dict = {}
    for name, role, build in builders:
        c = None
        try:
            c = build()
        except Unavailable as e:
            status[name] = {"role": role, "status": "unavailable", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - a broken case must not stop the others
            status[name] = {
                "role": role,
                "status": "failed",
                "reason": f"setup: {type(e).__name__}: {e}",
            }
        # Built on every rank or dropped on every rank: the first calls below meet at one
        # barrier per case, which a rank without the case would skip.
        err, _ = _agree(world, None if c is not None else "not built")
        if c is not None and err is None:
            cases.append(c)
        elif c is not None:
            status[name] = {"role": role, "status": "failed", "reason": f"setup: {err}"}
    # First call of each case: compile, warm, capture the canonical output of set 0.
    outputs = {}
    for c in cases:
        try:
            out = c.step(0)
            _sync(spec.device)
            outputs[c.name] = c.canon(out) if (c.canon is not None and spec.check) else None
            del out
            status[c.name] = {"role": c.role, "status": "ok", "note": c.note, "flops": c.flops}
        except Exception as e:  # noqa: BLE001
            status[c.name] = {
                "role": c.role,
                "status": "failed",
                "reason": f"first call: {type(e).__name__}: {e}",
                "note": c.note,
            }
        if world.world_size > 1:
            world.barrier()
    refs = [
        c.name for c in cases if c.role in ("baseline", "check") and outputs.get(c.name) is not None
    ]
    for c in cases:
        if outputs.get(c.name) is None:
            continue
        errs = {}
        for r in refs:
            if r != c.name:
                e = rel_error(outputs[c.name], outputs[r])
                if e is not None:
                    errs[r] = e
        status[c.name]["rel_err"] = errs
        if c.canon is not None and not errs and c.role == "candidate":
            status[c.name]["check_note"] = "no comparable baseline output"
    if spec.check:
        for c in cases:
            if (
                c.canon is not None
                and outputs.get(c.name) is None
                and c.name in status
                and status[c.name]["status"] == "ok"
            ):
                status[c.name]["check_note"] = "output layout not comparable"
    outputs.clear()
    status = {n: status[n] for n, _, _ in builders if n in status}
    # Timing: interleaved rounds, floors and baselines first in the first; checks not timed.
    order = {"floor": 0, "comm": 1, "baseline": 2, "candidate": 3}
    timings = {}

    def all_ok(name) -> bool:
        # Collective cases must run on every rank or on none: a rank that skips one while the
        # others wait for it would hang them until their timeouts.
        ok = status[name]["status"] == "ok"
        if world.world_size == 1:
            return ok
        return all(v[0] for v in world.all_gather_ints([int(ok)]))

    timed = []
    for c in sorted((c for c in cases if c.role != "check"), key=lambda c: order[c.role]):
        if all_ok(c.name):
            timed.append(c)
        elif status[c.name]["status"] == "ok":
            status[c.name].update(status="failed", reason="failed on another rank")
    timings, failures = measure_interleaved(
        timed, spec.device, world, spec.warmup, spec.rep, spec.rounds, spec.interleave
    )
    for name, why in failures.items():
        status[name].update(status="failed", reason=f"timing: {why}")
    traces = {}
    if spec.trace:
        from .trace import new_buffer

        for c in cases:
            if c.role != "candidate" or not all_ok(c.name):
                continue
            if c.trace_step is None:
                status[c.name]["trace"] = "unavailable: the op takes no trace= argument yet"
                continue
            buf = new_buffer(spec.trace_capacity, spec.device)
            try:
                c.trace_step(0, trace=buf)
                _sync(spec.device)
                traces[c.name] = buf.cpu()
            except Exception as e:  # noqa: BLE001
                status[c.name]["trace"] = f"failed: {type(e).__name__}: {e}"
    if _is_dist(world):
        for t in timings.values():
            per = world.all_gather_ints([int(v * 1e6) for v in t["ms"]])
            t["ms"] = [max(r[i] for r in per) / 1e6 for i in range(len(t["ms"]))]
            t.pop("events", None)
    return {
        "rank": world.rank,
        "status": status,
        "timings": timings,
        "traces": traces,
        "sets": len(problem.sets) if hasattr(problem, "sets") else len(problem.xs),
        "M": _kept_rows(problem, world),
        "fill": _tile_fill(problem, world),
    }


def _kept_rows(problem, world):
    if isinstance(problem, B.MoEProblem):
        return B._M(B._sorted_info(problem, world))
    return None


# The fused grouped GEMMs' row tile (BM of every pinned config in configs.json).
FILL_TILE_M = 128


def _tile_fill(problem, world):
    """Share of the rows in this rank's ``FILL_TILE_M``-row GEMM tiles that are real (each
    local expert's rows rounded up to whole tiles), over its input sets; None for dense ops.
    Routed rows per expert near a multiple of the tile leave about half an empty tile per
    expert: 0.80 at deepseek-v3 (256 rows an expert on average), 0.94 at qwen3-30b-a3b, 0.985
    at mixtral-8x7b. The TFLOP/s count real rows only, so this bounds them."""
    if not isinstance(problem, B.MoEProblem):
        return None
    rows = tiles = 0
    for info in B._sorted_info(problem, world):
        for n in info.counts:
            rows += int(n)
            tiles += -(-int(n) // FILL_TILE_M)
    return rows / (tiles * FILL_TILE_M) if tiles else None


def min_bytes(op: str, shape, M: int, world_size: int, itemsize: int, backward: bool) -> float:
    """A lower bound on one rank's HBM traffic for ``op``: every GEMM reads its whole weight
    (the rank's local experts, or its dense shard) once, the backward writes the weight
    gradients once, and the op's own inputs and outputs cross memory once (MoE: the rank's
    tokens ``x``/``y`` and in the backward ``dy``/``dx``, all ``[T, H]``; layer 0 writes
    ``h [M, F]``, layer 1 reads it). Intermediates between kernels are left out, so any
    implementation moves at least this much. ``M``: the rank's kept routed rows.

    Worked example, deepseek-v3 forward+backward at one rank (bf16): the weights are 15.0 GB
    (``w1``) + 7.5 GB (``w2``), read twice and written once as gradients: 67.6 GB, plus 4 x
    117 MB of tokens; ~68 GB, 20 ms at 3.35 TB/s (H100) and 14 ms at 4.8 TB/s (H200)."""
    W = world_size
    if op in MOE_OPS:
        El = shape.experts // W
        T, H, F = shape.tokens, shape.hidden, shape.ffn
        w1 = El * shape.w1_rows * H
        w2 = El * H * F
        if op == "layer0":
            n = w1 + T * H + M * F
        elif op == "layer1":
            n = w2 + M * F + T * H
        else:
            n = (3 * (w1 + w2) + 4 * T * H) if backward else (w1 + w2 + 2 * T * H)
        return float(n * itemsize)
    Mg, N, K = shape.m, shape.n, shape.k
    if op == "ag-matmul":  # gathered x [M, K] @ weight shard [N/W, K]^T -> [M, N/W]
        n = Mg * K + (N // W) * K + Mg * (N // W)
    elif op == "matmul-rs":  # x [M, K/W] @ weight [N, K/W]^T, reduced to [M/W, N]
        n = Mg * (K // W) + N * (K // W) + (Mg // W) * N
    else:
        raise ValueError(f"unknown op {op!r}")
    return float(n * itemsize)


def op_flops(op: str, shape, M: int, world_size: int, backward: bool) -> float:
    """One rank's GEMM FLOPs for ``op`` (the counts the TFLOP/s use)."""
    if op == "layer0":
        return flops_layer0(M, shape.hidden, shape.ffn, shape.activation)
    if op == "layer1":
        return flops_layer1(M, shape.ffn, shape.hidden)
    if op == "moe":
        return flops_moe(M, shape.hidden, shape.ffn, shape.activation, backward)
    return flops_dense(op, shape.m, shape.n, shape.k, world_size)


def device_rates(device, dtype, n: int = 8192, copy_bytes: int = 1 << 30) -> dict | None:
    """This GPU's dense ``n x n x n`` matmul rate in ``dtype`` and its device-to-device copy
    bandwidth (a ``copy_bytes`` buffer, read and written: 2x the bytes), medians of 10 timed
    calls after 3 warm ones, CUDA events; measured in the same run as the cases so the floors
    below use this card's numbers. None off the GPU (CPU times mean nothing)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    device = resolve_device(device)
    torch.cuda.set_device(device)

    def median_ms(fn):
        for _ in range(3):
            fn()
        ms = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        return statistics.median(ms)

    def mm_ms():
        x = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
        y = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
        z = torch.empty(n, n, device=device, dtype=dtype)
        return median_ms(lambda: torch.mm(x, y, out=z))

    def copy_ms():
        src = torch.randn(copy_bytes // 4, device=device)
        dst = torch.empty_like(src)
        return median_ms(lambda: dst.copy_(src))

    mm, cp = mm_ms(), copy_ms()
    torch.cuda.empty_cache()
    return {
        "mm_n": n,
        "mm_tflops": 2.0 * n**3 / (mm * 1e-3) / 1e12,
        "copy_tb_s": 2.0 * copy_bytes / (cp * 1e-3) / 1e12,
    }


def bounds(spec: RunSpec, merged: dict, rates: dict | None) -> dict:
    """What bounds the op on this card, per rank (the slowest rank's floor):
    ``flops_issued`` (the GEMM FLOPs over the row tiles' fill, as padding rows cost as much as
    real ones; applied to every GEMM, though the weight gradients' 64-row steps fill more),
    ``bytes_min`` (:func:`min_bytes`), and with ``rates`` the two floors,
    ``compute_floor_ms`` (issued FLOPs at the dense matmul's rate) and ``memory_floor_ms``
    (``bytes_min`` at the copy bandwidth), ``bound`` (the larger) and each timed candidate's
    ``share_of_floor`` (the larger floor over its median: 1.0 would be at the floor)."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    per_rank = []
    for r, (M, fill) in enumerate(zip(merged["M"], merged["fill"])):
        M = int(M or 0)
        fl = op_flops(spec.op, spec.shape, M, spec.world_size, spec.backward)
        per_rank.append(
            {
                "rank": r,
                "flops": fl,
                "flops_issued": fl / fill if fill else fl,
                "bytes_min": min_bytes(
                    spec.op, spec.shape, M, spec.world_size, itemsize, spec.backward
                ),
            }
        )
    out = {"per_rank": per_rank, "rates": rates}
    if rates:
        c = max(p["flops_issued"] for p in per_rank) / (rates["mm_tflops"] * 1e12) * 1e3
        m = max(p["bytes_min"] for p in per_rank) / (rates["copy_tb_s"] * 1e12) * 1e3
        out.update(compute_floor_ms=c, memory_floor_ms=m, bound="compute" if c >= m else "memory")
    return out


def _is_dist(world) -> bool:
    """A world of several processes (torch_symm on one node, nvshmem across nodes)."""
    from ..world.dist_collectives import DistCollectives

    return isinstance(world, DistCollectives) and world.world_size > 1


def _gather_rank_results(world, result: dict) -> list:
    """Every process's ``run_rank`` result, in rank order (each process of a torchrun job
    holds only its own: FLOPs, errors and kept rows of the other ranks would be missing)."""
    import torch.distributed as dist

    out = [None] * world.world_size
    dist.all_gather_object(out, result, group=world.group)
    return out


# ------------------------------------------------------------------------------ all ranks
def combine(rank_results: list, emulated_cuda: bool, world_size: int = 1) -> dict:
    """Merge per-rank results: status from rank 0 (errors: max over ranks), per-iteration
    times across ranks (shared clock: max end - min start; else the slowest rank)."""
    r0 = rank_results[0]
    status = {k: dict(v) for k, v in r0["status"].items()}
    for name, st in status.items():
        # One process of a torchrun job sees its own rank only: scale its count.
        scale = world_size / len(rank_results)
        st["flops_total"] = scale * sum(
            rr["status"].get(name, {}).get("flops", 0.0) for rr in rank_results
        )
    for rr in rank_results[1:]:
        for name, st in rr["status"].items():
            if st["status"] != "ok" and status.get(name, {}).get("status") == "ok":
                status[name] = dict(st, reason=f"rank {rr['rank']}: {st.get('reason')}")
            for ref, e in st.get("rel_err", {}).items():
                cur = status.get(name, {}).setdefault("rel_err", {})
                cur[ref] = max(cur.get(ref, 0.0), e)
    times = {}
    for name in r0["timings"]:
        per_rank = [rr["timings"].get(name) for rr in rank_results]
        if any(t is None for t in per_rank):
            continue
        n = min(len(t["ms"]) for t in per_rank)
        if emulated_cuda and len(per_rank) > 1 and all("events" in t for t in per_rank):
            ref = per_rank[0]["events"][0][0]
            ms = []
            for i in range(n):
                s = min(ref.elapsed_time(t["events"][i][0]) for t in per_rank)
                e = max(ref.elapsed_time(t["events"][i][1]) for t in per_rank)
                ms.append(e - s)
        else:
            ms = [max(t["ms"][i] for t in per_rank) for i in range(n)]
        times[name] = ms
    traces = {}
    for rr in rank_results:
        for name, buf in rr["traces"].items():
            traces.setdefault(name, []).append(buf)
    traces = {k: torch.cat(v) for k, v in traces.items()}
    return {
        "status": status,
        "times": times,
        "traces": traces,
        "sets": r0["sets"],
        "M": [rr["M"] for rr in rank_results],
        "fill": [rr["fill"] for rr in rank_results],
    }


def _tol(dtype) -> float:
    from ..testing import TOLERANCES

    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])["rtol"]


def metrics(spec: RunSpec, merged: dict) -> dict:
    """Per case stats, TFLOP/s, ratios, fastest baseline, communication metrics."""
    W = spec.world_size
    cases = []
    med = {}
    for name, st in merged["status"].items():
        row = {"name": name, "role": st["role"], "status": st["status"]}
        for k in ("reason", "note", "check_note", "trace"):
            if k in st:
                row[k] = st[k]
        if name in merged["times"]:
            row.update(stats(merged["times"][name]))
            # in the order timed (round by round): under a GPU's power cap the spread is the
            # clock moving, which the median alone hides
            row["samples_ms"] = [round(v, 4) for v in merged["times"][name]]
            med[name] = row["median_ms"]
            flops = st.get("flops_total", 0.0)
            row["flops"] = flops
            row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12 if flops else None
        row["rel_err"] = st.get("rel_err", {})
        cases.append(row)
    by = {c["name"]: c for c in cases}
    same_fn = [c["name"] for c in cases if c["role"] == "baseline" and c["name"] in med]
    fastest = min(same_fn, key=lambda n: med[n]) if same_fn else None
    floors = [c["name"] for c in cases if c["role"] == "floor" and c["name"] in med]
    best_floor = min(floors, key=lambda n: med[n]) if floors else None
    comm = [c["name"] for c in cases if c["role"] == "comm" and c["name"] in med]
    tol = _tol(spec.dtype)
    for c in cases:
        errs = c["rel_err"]
        ref = (
            fastest
            if fastest in errs
            else ("reference" if "reference" in errs else (next(iter(errs)) if errs else None))
        )
        if ref is not None:
            c["err_ref"] = ref
            c["err"] = errs[ref]
            c["check"] = "ok" if errs[ref] <= tol else "MISMATCH"
    ratios = {}
    for c in cases:  # every timed case against every baseline and floor
        if c["role"] not in ("candidate", "baseline") or c["name"] not in med:
            continue
        ratios[c["name"]] = {
            b: med[b] / med[c["name"]]
            for b in med
            if by[b]["role"] in ("baseline", "floor") and b != c["name"]
        }
    comm_metrics = {}
    if W > 1 and best_floor is not None:
        for cand in [n for n in ratios if by[n]["role"] == "candidate"]:
            m = {
                "gemm_ms": med[best_floor],
                "gemm_case": best_floor,
                "effective_comm_ms": med[cand] - med[best_floor],
            }
            if comm:
                cm = med[comm[0]]
                m["comm_alone_ms"] = cm
                m["hidden_share"] = min(1.0, max(0.0, (med[best_floor] + cm - med[cand]) / cm))
            comm_metrics[cand] = m
    return {
        "cases": cases,
        "fastest_baseline": fastest,
        "floor": best_floor,
        "ratios": ratios,
        "comm": comm_metrics,
        "tolerance": tol,
    }


def _spawn_ranks(spec: RunSpec) -> list:
    from ..testing import spawn

    mode = "concurrent" if spec.device.type == "cuda" else "sequential"
    return spawn(spec.world_size, run_rank, spec, device=spec.device, mode=mode, seed=spec.seed)


def run(spec: RunSpec, world=None) -> dict:
    """Run one op on this process's world (``world``: a real multi-process world, every rank
    calls this), a local single-rank world, or ``spec.world_size`` emulated ranks."""
    if spec.op not in ALL_OPS:
        raise ValueError(f"op must be one of {ALL_OPS}, got {spec.op!r}")
    t0 = time.perf_counter()
    # probed before the problem is built: the probe's buffers are gone by the time the cases
    # need the memory
    rates = device_rates(spec.device, spec.dtype) if spec.bounds else None
    emulated_cuda = False
    if world is not None:
        rank_results = [run_rank(world, spec)]
        if _is_dist(world):
            rank_results = _gather_rank_results(world, rank_results[0])
    elif spec.world_size == 1:
        from ..world import local_world

        rank_results = [run_rank(local_world(spec.device, seed=spec.seed), spec)]
    else:
        rank_results = _spawn_ranks(spec)
        emulated_cuda = spec.device.type == "cuda"
    merged = combine(rank_results, emulated_cuda, spec.world_size)
    out = {
        "op": spec.op,
        "preset": spec.shape.name,
        "shape": spec.shape.as_dict(),
        "dtype": str(spec.dtype).replace("torch.", ""),
        "device": str(spec.device),
        "world_size": spec.world_size,
        "world": (
            "torchrun"
            if world is not None and spec.world_size > 1
            else "emulated"
            if spec.world_size > 1
            else "local"
        ),
        "backward": spec.backward,
        "input_sets": merged["sets"],
        "kept_rows_per_rank": merged["M"],
        "tile_fill_per_rank": merged["fill"],
        "warmup": list(spec.warmup),
        "rep": list(spec.rep),
        "rounds": spec.rounds,
        "interleave": spec.interleave,
        "wall_s": None,
    }
    out.update(metrics(spec, merged))
    out["bounds"] = bounds(spec, merged, rates)
    floor = max(
        out["bounds"].get("compute_floor_ms", 0.0), out["bounds"].get("memory_floor_ms", 0.0)
    )
    for c in out["cases"]:
        if floor and c.get("median_ms") and c["role"] in ("candidate", "baseline"):
            c["share_of_floor"] = floor / c["median_ms"]
    out["traces"] = merged["traces"]  # tensors: the CLI writes them out and drops them
    out["wall_s"] = time.perf_counter() - t0
    return out
