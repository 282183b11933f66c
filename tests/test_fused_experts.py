"""``fused_experts`` on emulated worlds (CPU, Triton interpreter, fp32): forward and backward.

Every rank holds LOCAL expert weights, slices ``[r * El, (r + 1) * El)`` of one GLOBAL set. The
float64 reference (``reference.experts``) runs every rank's tokens through the global weights;
the loss is ``sum_r <y_r, gy_r>`` with a fresh random upstream gradient per rank, so the
reference's global weight gradient collects every rank's tokens and a rank's local weight
gradient must equal its slice of it.

Cases are chosen pairwise (every world size x activation, every activation x bias, routings
spread over world sizes) instead of as a full product: the interpreter is slow and the CPU is
shared. Covered: W in {1, 2, 3, 4}, K = 1 and K = E, E up to 16, odd H and F (not multiples of
the interpreter's 16-wide tiles), uneven tokens per rank including ranks and whole worlds with
no tokens, all assignments on one expert (duplicate ids in a token), experts and whole ranks
with no tokens, -1 ids, more than one 64-row dispatch chunk from one source, repeated calls on
one world (flags and epochs reset; bitwise-identical results), a workspace grown by another
op between calls, two layers' backward in reverse order and a second backward (bitwise),
static sizing (also with duplicate ids, K > El), partial ``requires_grad``, non-contiguous
inputs and upstream gradient, fp16, topk_weights in another float dtype, the layer0/layer1
benchmark API, a peer whose producers never run (``CommTimeoutError`` naming the dispatch
stage), bad input rejected before any launch. The outputs are fresh tensors, so the poison
goes into the world's symmetric workspace (NaN bytes) before every run: a row read before it
was written shows as NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import moe_overlap as mo
from moe_overlap import CommTimeoutError, local_world
from moe_overlap import reference as ref
from moe_overlap.config import w1_rows
from moe_overlap.experts import fused
from moe_overlap.testing import assert_close, randn, spawn

f64 = torch.float64
GRAD_NAMES = ("x", "topk_weights", "w1", "w2", "b1", "b2")
STAGE_DISPATCH = 4  # errors.STAGES


# ------------------------------------------------------------------------------ problems
@dataclass(frozen=True)
class Case:
    W: int
    tokens: tuple  # tokens on each rank
    H: int
    F: int
    E: int
    K: int
    act: str = "swiglu"
    bias: bool = False
    routing: str = "uniform"
    seed: int = 0

    def __str__(self):
        return (
            f"W{self.W}-T{'_'.join(map(str, self.tokens))}-H{self.H}-F{self.F}-E{self.E}"
            f"-K{self.K}-{self.act}{'-bias' if self.bias else ''}-{self.routing}"
        )


def route_ids(routing: str, T: int, E: int, K: int, W: int, g: torch.Generator) -> torch.Tensor:
    """``[T, K]`` int64 global expert ids for one rank.

    uniform: K distinct experts per token; zipf: distinct experts drawn with Zipf-like
    probabilities over a random expert order (a few hot experts); hot: every assignment on one
    expert (duplicate ids inside a token when K > 1); sparse: the experts of the last rank (and
    so of a whole rank, when W > 1) never chosen; drop: uniform with about a third of the ids
    -1 and token 0 fully dropped; dup: ids drawn with replacement (duplicates, uneven load).
    """
    El = E // W
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if routing == "hot":
        e = int(torch.randint(E, (1,), generator=g))
        return torch.full((T, K), e, dtype=torch.int64)
    if routing == "dup":
        return torch.randint(E, (T, K), generator=g)
    if routing == "zipf":
        order = torch.randperm(E, generator=g)
        p = torch.empty(E)
        p[order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** 1.5
        return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    allowed = torch.arange(E)
    if routing == "sparse":
        allowed = torch.arange(E - El) if E - El >= K else torch.arange(K)
    ids = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:K]] for _ in range(T)])
    if routing == "drop":
        ids[torch.rand(T, K, generator=g) < 0.35] = -1
        ids[0] = -1
    elif routing not in ("uniform", "sparse"):
        raise ValueError(f"unknown routing {routing!r}")
    return ids


@dataclass
class Problem:
    case: Case
    glob: dict  # w1 [E, rows, H], w2 [E, H, F], b1 [E, rows] | None, b2 [E, H] | None
    x: list  # per rank [T_r, H]
    ids: list  # per rank [T_r, K] int64
    wts: list  # per rank [T_r, K]
    gy: list  # per rank [T_r, H] upstream gradient

    @property
    def El(self):
        return self.case.E // self.case.W


def make_problem(case: Case, dtype=torch.float32) -> Problem:
    """Fresh random inputs in ``dtype`` (the reference upcasts exactly these values)."""
    g = torch.Generator().manual_seed(1000 * case.seed + 17 * case.W + case.E + case.K)
    rows = w1_rows(case.act, case.F)
    glob = dict(
        w1=randn((case.E, rows, case.H), dtype, generator=g, scale=case.H**-0.5),
        w2=randn((case.E, case.H, case.F), dtype, generator=g, scale=case.F**-0.5),
        b1=randn((case.E, rows), dtype, generator=g, scale=0.5) if case.bias else None,
        b2=randn((case.E, case.H), dtype, generator=g, scale=0.5) if case.bias else None,
    )
    xs, ids, wts, gys = [], [], [], []
    for T in case.tokens:
        xs.append(randn((T, case.H), dtype, generator=g))
        ids.append(route_ids(case.routing, T, case.E, case.K, case.W, g))
        wts.append((torch.rand(T, case.K, generator=g) + 0.1).to(dtype))
        gys.append(randn((T, case.H), dtype, generator=g))
    return Problem(case, glob, xs, ids, wts, gys)


# ------------------------------------------------------------------------------ runs
def poison_workspace(world):
    """NaN bytes over this rank's symmetric workspace (collective: every rank calls it)."""
    ws = world.workspace(1 << 20)
    ws.local.fill_(0xFF)
    world.barrier()


def local_leaves(prob: Problem, rank: int, grads_of=GRAD_NAMES, transform=None):
    """This rank's inputs as fresh leaf tensors; ``grads_of`` of them require grad."""
    sl = slice(rank * prob.El, (rank + 1) * prob.El)
    leaves = dict(x=prob.x[rank].clone(), topk_weights=prob.wts[rank].clone())
    for k, v in prob.glob.items():
        leaves[k] = None if v is None else v[sl].clone()
    if transform is not None:
        leaves = transform(leaves)
    for k in grads_of:
        if leaves[k] is not None:
            leaves[k].requires_grad_(True)
    return leaves


def call(leaves, ids, world, act, **kw):
    return mo.fused_experts(
        leaves["x"],
        ids,
        leaves["topk_weights"],
        leaves["w1"],
        leaves["w2"],
        world,
        activation=act,
        b1=leaves["b1"],
        b2=leaves["b2"],
        **kw,
    )


def run_fused(
    prob: Problem, backward=True, grads_of=GRAD_NAMES, transform=None, gy_layout=None, **kw
):
    """Per rank: (y, {name: grad}); ``gy_layout`` may restride the upstream gradient."""
    c = prob.case

    def fn(world):
        r = world.rank
        leaves = local_leaves(prob, r, grads_of if backward else (), transform)
        poison_workspace(world)
        y = call(leaves, prob.ids[r], world, c.act, **kw)
        assert y.shape == (c.tokens[r], c.H) and y.dtype == leaves["x"].dtype
        grads = {}
        if backward:
            gy = prob.gy[r] if gy_layout is None else gy_layout(prob.gy[r])
            y.backward(gy)
            grads = {k: leaves[k].grad for k in grads_of if leaves[k] is not None}
        return y.detach(), grads

    return spawn(c.W, fn, timeout=120)


def run_reference(prob: Problem):
    """float64: per-rank outputs, per-rank grads of x and topk_weights, global weight grads."""
    c = prob.case
    glob = {k: None if v is None else v.to(f64).requires_grad_() for k, v in prob.glob.items()}
    ys, per_rank, loss = [], [], torch.zeros((), dtype=f64)
    for r in range(c.W):
        x = prob.x[r].to(f64).requires_grad_()
        w = prob.wts[r].to(f64).requires_grad_()
        y = ref.experts(x, prob.ids[r], w, glob["w1"], glob["w2"], c.act, glob["b1"], glob["b2"])
        ys.append(y.detach())
        per_rank.append((x, w))
        loss = loss + (y * prob.gy[r].to(f64)).sum()
    inputs = [t for xw in per_rank for t in xw] + [v for v in glob.values() if v is not None]
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    else:  # no assignment anywhere
        grads = [None] * len(inputs)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(inputs, grads)]
    it = iter(grads)
    rank_grads = [dict(x=next(it), topk_weights=next(it)) for _ in range(c.W)]
    glob_grads = {k: (None if v is None else next(it)) for k, v in glob.items()}
    return ys, rank_grads, glob_grads


def check_against_reference(prob: Problem, got, grads_of=GRAD_NAMES, dtype=torch.float32):
    c = prob.case
    ys, rank_grads, glob_grads = run_reference(prob)
    for r in range(c.W):
        y_got, g_got = got[r]
        assert_close(y_got, ys[r], dtype=dtype, name=f"{c} rank {r}: y")
        sl = slice(r * prob.El, (r + 1) * prob.El)
        for k in grads_of:
            want = rank_grads[r][k] if k in rank_grads[r] else glob_grads[k]
            if want is None:  # no bias in this case
                continue
            if k not in rank_grads[r]:
                want = want[sl]
            assert k in g_got and g_got[k] is not None, f"{c} rank {r}: no grad for {k}"
            assert_close(g_got[k], want, dtype=dtype, name=f"{c} rank {r}: d{k}")


# ------------------------------------------------------------------------------ forward+backward
EMPTY_RANK = Case(2, (10, 0), 13, 20, 6, 2, "swiglu", False, "hot")  # a rank with no tokens
CASES = [
    Case(1, (9,), 13, 7, 4, 2, "swiglu", True, "uniform"),
    Case(1, (12,), 24, 20, 8, 1, "gelu", False, "zipf"),
    Case(1, (7,), 13, 20, 3, 3, "relu", True, "drop"),  # K = E
    Case(2, (8, 5), 24, 7, 4, 4, "silu", False, "uniform"),  # K = E
    EMPTY_RANK,
    Case(2, (12, 11), 13, 7, 6, 6, "gelu", True, "hot"),  # 72 rows per source: 2 chunks
    Case(3, (5, 0, 9), 24, 20, 6, 2, "relu", False, "sparse"),  # rank 2's experts empty
    Case(3, (4, 7, 6), 13, 7, 9, 1, "silu", True, "zipf"),
    Case(3, (0, 6, 3), 24, 7, 3, 2, "gelu", False, "drop"),  # El = 1
    Case(4, (6, 3, 0, 8), 13, 20, 8, 3, "swiglu", True, "drop"),
    Case(4, (5, 5, 5, 5), 24, 7, 16, 4, "relu", True, "uniform"),  # E = 16
    Case(4, (3, 9, 1, 2), 13, 7, 4, 1, "silu", False, "sparse"),  # El = 1, K = 1
    Case(4, (4, 4, 0, 7), 24, 20, 8, 2, "gelu", True, "dup"),
    Case(2, (0, 0), 13, 7, 4, 2, "swiglu", True, "uniform"),  # nobody has tokens
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_backward_matches_reference(case):
    prob = make_problem(case)
    got = run_fused(prob)
    check_against_reference(prob, got)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, (9,), 24, 20, 4, 2, "swiglu", True, "uniform"),
        Case(2, (10, 0), 24, 20, 6, 2, "swiglu", False, "hot"),  # a rank with no tokens
        Case(3, (5, 0, 9), 24, 20, 6, 2, "relu", False, "sparse"),  # rank 2's experts empty
    ],
    ids=str,
)
@pytest.mark.parametrize("env", ["kernel", "ws"])
def test_backward_with_the_wgrad_kernel(case, env, monkeypatch):
    # MOE_OVERLAP_WGRAD=kernel: both weight gradients of every rank from kernels/moe_wgrad.py
    # (each expert's contraction stopped at its real rows), against the reference; "ws" (the
    # Gluon mode, GPU-only) takes the same kernel here. H and F keep rows 16-byte aligned
    # (fp32), so the kernel's TMA operands apply.
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", env)
    calls = []
    real = fused.moe_wgrad.grouped_wgrad
    monkeypatch.setattr(fused.moe_wgrad, "grouped_wgrad", lambda *a: calls.append(1) or real(*a))
    prob = make_problem(case)
    check_against_reference(prob, run_fused(prob))
    # a rank whose experts receive no rows has nothing to describe by TMA: it takes the torch
    # path (its gradients are zeros, checked above)
    assert len(calls) >= 2 and len(calls) % 2 == 0


@pytest.mark.parametrize("epi", [2, 4, 8])
@pytest.mark.parametrize(
    "case",
    [
        Case(1, (9,), 13, 20, 4, 2, "swiglu", True, "hot"),  # F 20: one ragged 32-wide N tile
        Case(1, (11,), 24, 40, 5, 3, "gelu", False, "zipf"),  # F 40: a full and a ragged tile
        Case(2, (7, 4), 13, 40, 4, 2, "swiglu", False, "uniform"),
    ],
    ids=str,
)
def test_backward_with_a_sliced_epilogue(case, epi, monkeypatch):
    # The backward's dispatch GEMM at BN 32 with its epilogue in 2 or 4 column slices (the
    # GPU's 128x256 configs): slices past F are masked, the rest must match the reference.
    bn = 64 if epi == 8 else 32  # slices of at least 8 columns
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", f"16,{bn},16,4,1,8,{epi}")
    prob = make_problem(case)
    check_against_reference(prob, run_fused(prob))


@pytest.mark.parametrize("epi", [2, 4, 8])  # 8: the forward keeps one piece (2 and 4 only)
@pytest.mark.parametrize(
    "case",
    [
        Case(1, (9,), 13, 20, 4, 2, "swiglu", True, "hot"),  # F 20: one ragged 32-wide N tile
        Case(2, (7, 4), 13, 40, 4, 2, "swiglu", False, "uniform"),
        Case(1, (11,), 24, 40, 5, 3, "gelu", False, "zipf"),  # EPI is ignored off SwiGLU
    ],
    ids=str,
)
def test_forward_with_a_sliced_swiglu_epilogue(case, epi, monkeypatch):
    # Layer 0's forward at BN 32 with its SwiGLU epilogue (saved gate/up and h) in column
    # slices (MOE_OVERLAP_L0_CONFIG's EPI); forward and backward must match the reference.
    bn = 64 if epi == 8 else 32
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", f"16,{bn},16,4,1,8,{epi}")
    prob = make_problem(case)
    check_against_reference(prob, run_fused(prob))


@pytest.mark.parametrize(
    "env", ["256,64,3,8", "200,64,3,8,184", "256,64,1,8,184", "256,64,3,8,180", "a,64,3,8,184"]
)
@pytest.mark.parametrize(
    "var, get",
    [
        ("MOE_OVERLAP_DACT_WS_CONFIG", "dact_ws_config"),
        ("MOE_OVERLAP_L0_WS_CONFIG", "layer0_ws_config"),
        ("MOE_OVERLAP_L1_WS_CONFIG", "layer1_ws_config"),
    ],
)
def test_bad_ws_config_is_rejected(env, var, get, monkeypatch):
    # The warp-specialized kernels' A/B knobs (kernels/moe_ws.py).
    config = getattr(fused, get)
    assert config()["BN"] == 256 and config()["EPI_REGS"] == 184
    monkeypatch.setenv(var, env)
    with pytest.raises(ValueError, match=var):
        config()
    monkeypatch.setenv(var, "128,64,4,16,152")
    cfg = config()
    assert (cfg["BN"], cfg["BK"], cfg["STAGES"], cfg["GM"], cfg["EPI_REGS"]) == (
        128,
        64,
        4,
        16,
        152,
    )


def test_layer0_takes_the_ws_forward_only_for_its_cases(monkeypatch):
    # The host's gate in _launch_layer0, with the device checks passed (mocked): the SwiGLU
    # forward on gathered rows goes to the Gluon path, inference too (its rows staged first,
    # whatever the width: 2F = 16 here); a bias, the backward's dispatch (dact / scaled rows) or
    # inference with staging off (MOE_OVERLAP_L0_STAGE=0) stays with the Triton kernel.
    world = local_world(torch.device("cpu"))
    T, H, F, E = 6, 16, 8, 2
    x = torch.randn(T, H)
    w1 = torch.randn(E, 2 * F, H)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    layout = fused.dispatch_layout(ids, E, world)
    ws = fused._workspace(world, layout, H, x.dtype)
    rows = fused._gather_rows(layout, x, ws.recv)
    calls = []
    monkeypatch.setattr(fused, "_l0_ws_usable", lambda *a: True)
    monkeypatch.setattr(
        fused, "_launch_l0_ws", lambda r, w, lay, wo, save: calls.append(save) or ("h", None)
    )
    assert fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws, True, a_rows=rows) == (
        "h",
        None,
    )
    assert calls == [True]
    monkeypatch.setenv("MOE_OVERLAP_L0_STAGE", "0")  # inference, staging off: Triton
    h, _ = fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws)
    assert isinstance(h, torch.Tensor) and calls == [True]
    monkeypatch.setenv("MOE_OVERLAP_L0_STAGE", "1")
    fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws)
    assert calls == [True, False]
    monkeypatch.delenv("MOE_OVERLAP_L0_STAGE")
    fused._fwd_layer0(x, layout, w1, world, "swiglu", None, ws)
    assert calls == [True, False, False]
    # the backward's dispatch GEMM runs through _launch_layer0 with dact: never this path
    gu = torch.randn(layout.rows_cap, 2 * F)
    w2 = torch.randn(E, H, F)
    d_gu, _ = fused._launch_layer0(x, layout, w2, world, "none", n_out=F, stride_wn=w2.stride(2),
                                   stride_wk=w2.stride(1), stage_ws=ws, dact="swiglu", pre=gu,
                                   a_rows=rows)  # fmt: skip
    assert isinstance(d_gu, torch.Tensor) and calls == [True, False, False]


def test_ws_config_checks_shared_memory_and_forward_width(monkeypatch):
    # a config whose ring and hand-off tile overflow a block's 227 KiB fails before any launch;
    # the forward's epilogue takes each half of a tile in 64-column pieces, so BN >= 128
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS_CONFIG", "256,128,3,8,184")
    with pytest.raises(ValueError, match="shared memory"):
        fused.dact_ws_config()
    monkeypatch.setenv("MOE_OVERLAP_L0_WS_CONFIG", "64,64,4,8,184")
    with pytest.raises(ValueError, match="BN must be 128 or 256"):
        fused.layer0_ws_config()
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS_CONFIG", "64,64,4,8,184")  # fine for the backward
    assert fused.dact_ws_config()["BN"] == 64


def test_ws_config_takes_this_threads_overrides(monkeypatch):
    # tuning._env sets a thread's switches without touching os.environ (emulated ranks are
    # threads): the warp-specialized configs read through it like the other block configs
    from moe_overlap.experts import tuning

    monkeypatch.setenv("MOE_OVERLAP_L0_WS_CONFIG", "256,64,3,4,184")
    with tuning._env(MOE_OVERLAP_L0_WS_CONFIG="256,64,3,16,184", MOE_OVERLAP_WS_SPLIT="1"):
        cfg = fused.layer0_ws_config()
        assert cfg["GM"] == 16 and cfg["SPLIT"] is True
        seen = []
        t = threading.Thread(target=lambda: seen.append(fused.layer0_ws_config()))
        t.start()
        t.join()
        assert seen[0]["GM"] == 4 and "SPLIT" not in seen[0], "another thread keeps os.environ"
    assert fused.layer0_ws_config()["GM"] == 4


def test_ws_kernels_are_not_taken_off_hopper(monkeypatch):
    # The Gluon kernels are GPU-only: on CPU tensors, in the interpreter, at W > 1, for other
    # activations, without gathered rows, with a bias or a trace, or with the switch off, the
    # Triton kernels run.
    monkeypatch.setattr(fused, "interpreted", lambda: False)
    world = local_world(torch.device("cpu"))
    R, H, F = 256, 64, 32
    a = torch.zeros(R, H, dtype=torch.bfloat16)
    w1 = torch.zeros(2, 2 * F, H, dtype=torch.bfloat16)
    w2 = torch.zeros(2, H, F, dtype=torch.bfloat16)
    gu = torch.zeros(R, 2 * F, dtype=torch.bfloat16)
    lay = type("L", (), {"block_m": 128, "rows_cap": R})()
    assert not fused._dact_ws_usable(a, w2, gu, lay, world, "swiglu")  # CPU tensors
    assert not fused._dact_ws_usable(None, w2, gu, lay, world, "swiglu")
    assert not fused._dact_ws_usable(a, w2, gu, lay, world, "gelu")
    assert not fused._l0_ws_usable(a, w1, lay, world, "swiglu", None, None)  # CPU tensors
    # past the device check, the host's own refusals
    monkeypatch.setattr(fused, "_ws_common_ok", lambda *a: True)
    assert fused._l0_ws_usable(a, w1, lay, world, "swiglu", None, None)
    assert not fused._l0_ws_usable(a, w1, lay, world, "swiglu", torch.zeros(2, 2 * F), None)
    assert not fused._l0_ws_usable(a, w1, lay, world, "swiglu", None, torch.zeros(4, 6))
    assert not fused._l0_ws_usable(a, w1[:, :, : H // 2], lay, world, "swiglu", None, None)
    # F = 1: N and h's row stride would be 1, which Triton specializes into constants the
    # Gluon kernel declares as tensors (it does not compile); F = 2 is fine
    assert not fused._l0_ws_usable(a, w1[:, :2], lay, world, "swiglu", None, None)
    assert fused._l0_ws_usable(a, w1[:, :4], lay, world, "swiglu", None, None)
    monkeypatch.setenv("MOE_OVERLAP_L0_WS", "0")
    assert not fused._l0_ws_usable(a, w1, lay, world, "swiglu", None, None)
    monkeypatch.undo()
    monkeypatch.setattr(fused, "interpreted", lambda: True)
    assert not fused._dact_ws_usable(a, w2, gu, lay, world, "swiglu")
    assert not fused._ws_common_ok(a, w1, lay, world)


@pytest.mark.parametrize(
    "var, key", [("MOE_OVERLAP_WS_CARRY", "CARRY"), ("MOE_OVERLAP_WS_SPLIT", "SPLIT")]
)
def test_ws_switches(var, key, monkeypatch):
    # A/B switches of every warp-specialized kernel: CARRY pins the load-position path, SPLIT
    # runs the row GEMMs' two MMA warp groups as two partitions (off by default: measured slower);
    # unset, each mode keeps its default (the config has no such key)
    assert key not in fused.layer1_ws_config()
    monkeypatch.setenv(var, "1")
    assert fused.dact_ws_config()[key] is True
    monkeypatch.setenv(var, "0")
    assert fused.layer0_ws_config()[key] is False
    monkeypatch.setenv(var, "yes")
    with pytest.raises(ValueError, match=var):
        fused.layer1_ws_config()


def test_ws_split_launch(monkeypatch):
    # with SPLIT the launch takes one warp group as its default partition (the other MMA warp
    # group and the epilogue are workers): 12 warps in all either way
    from moe_overlap.kernels import moe_ws

    if not moe_ws.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    seen = {}

    class Kernel:  # what the launcher sees of the Gluon kernel: grid, then the call
        def __getitem__(self, grid):
            return lambda *a, **k: seen.update(k, grid=grid)

    monkeypatch.setattr(moe_ws, "_moe_ws_kernel", Kernel())
    i32 = torch.zeros(8, dtype=torch.int32)
    lay = type("L", (), {"row_local_expert": i32, "expert_end": i32, "n_tiles": i32})()
    buf = torch.zeros(8, 8)
    for split, warps in ((True, 4), (False, 8), (None, 8)):
        cfg = fused.layer1_ws_config()
        if split is not None:
            cfg["SPLIT"] = split
        moe_ws._launch(None, None, buf, buf, lay, None, i32, 64, 64, cfg, 3, "rows_t")
        assert seen["num_warps"] == warps and seen["SPLIT"] is bool(split), seen
        assert seen["EPI_WARPS"] == 4 and seen["MMA_REGS"] == 160 and seen["grid"] == (3,)


def test_layer1_ws_gate(monkeypatch):
    # Which layer-1 GEMMs the warp-specialized kernel takes (device checks mocked): the forward
    # with w2 [El, H, F] (K-major), the backward's combine with w1 [El, 2F, H]; not with a bias,
    # a trace, a mis-shaped h, unaligned widths, or the switch off. Off Hopper: never.
    world = local_world(torch.device("cpu"))
    R, H, F, El = 256, 64, 48, 2
    lay = type("L", (), {"block_m": 128, "rows_cap": R})()
    h = torch.zeros(R, F, dtype=torch.bfloat16)
    d_gu = torch.zeros(R, 2 * F, dtype=torch.bfloat16)
    w1 = torch.zeros(El, 2 * F, H, dtype=torch.bfloat16)
    w2 = torch.zeros(El, H, F, dtype=torch.bfloat16)
    assert fused._l1_ws_usable(h, w2, lay, world, None, None, F, H, w2.stride(2)) is None
    monkeypatch.setattr(fused, "_ws_common_ok", lambda *a: True)
    assert fused._l1_ws_usable(h, w2, lay, world, None, None, F, H, w2.stride(2)) is True
    assert fused._l1_ws_usable(d_gu, w1, lay, world, None, None, 2 * F, H, w1.stride(1)) is False
    refused = [
        (h, w2, torch.zeros(El, H), None, F, H, w2.stride(2)),  # bias
        (h, w2, None, torch.zeros(4, 6), F, H, w2.stride(2)),  # trace
        (h[:128], w2, None, None, F, H, w2.stride(2)),  # h not [rows_cap, F]
        (d_gu, w1, None, None, 2 * F, H, w1.stride(2)),  # strides against the shape
        (h[:, :44], w2[:, :, :44], None, None, 44, H, 1),  # F % 8
        (h, w2[:, :60], None, None, F, 60, w2.stride(2)),  # H % 8
    ]
    for a, w, bias, trace, k, n, swk in refused:
        assert fused._l1_ws_usable(a, w, lay, world, bias, trace, k, n, swk) is None
    monkeypatch.setenv("MOE_OVERLAP_L1_WS", "0")
    assert fused._l1_ws_usable(h, w2, lay, world, None, None, F, H, w2.stride(2)) is None


def test_layer1_takes_the_ws_gemm_at_one_rank(monkeypatch):
    # _launch_layer1's gate at one rank (the kernel mocked: it writes what the Triton GEMM
    # would, so the reduction after it must give the reference): the forward's GEMM and the
    # backward's combine both go through _launch_l1_ws with the right orientation.
    world = local_world(torch.device("cpu"))
    T, H, F, E, K = 7, 16, 8, 3, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, 2 * F, H, generator=g) / 4
    w2 = torch.randn(E, H, F, generator=g) / 4
    calls = []

    def fake(h, w, comb, row_slot, lay, wo, kmajor):
        calls.append(kmajor)
        le = lay.row_local_expert.long()
        wl = w[le].transpose(1, 2) if kmajor else w[le]
        out = torch.bmm(h.unsqueeze(1).double(), wl.double()).squeeze(1)
        ok = (lay.row_tok >= 0) & (row_slot >= 0)
        comb[row_slot[ok].long()] = out[ok].to(comb.dtype)

    monkeypatch.setattr(fused, "_l1_ws_usable", lambda h, w, *a: a[-1] == 1)
    monkeypatch.setattr(fused, "_launch_l1_ws", fake)
    leaves = [t.clone().requires_grad_() for t in (x, wts, w1, w2)]
    y = mo.fused_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], world=world)
    dy = torch.randn(T, H, generator=g)
    y.backward(dy)
    assert calls == [True, False]  # forward (w2, K-major), then the backward's combine (w1)
    want = [t.double().requires_grad_() for t in (x, wts, w1, w2)]
    y_ref = ref.experts(want[0], ids, want[1], want[2], want[3], "swiglu", None, None)
    y_ref.backward(dy.double())
    assert_close(y, y_ref, dtype=torch.float32, name="y")
    for name, got, w in zip(("dx", "d topk_weights", "d w1", "d w2"), leaves, want):
        assert_close(got.grad, w.grad, dtype=torch.float32, name=name)


@pytest.mark.parametrize(
    "var",
    [
        "MOE_OVERLAP_L0_CONFIG",
        "MOE_OVERLAP_L0B_CONFIG",
        "MOE_OVERLAP_L1_CONFIG",
        "MOE_OVERLAP_WGRAD_CONFIG",
    ],
)
@pytest.mark.parametrize("env,what", [
    ("16,16,16,4,1,0", "GROUP_M"),  # divided by zero in the tile order: garbage, no error
    ("24,16,16,4,1", "BM"), ("0,16,16,4,1", "BM"), ("16,16,8,4,1", "BK"),
    ("16,16,16,3,1", "warps"), ("16,16,16,4,0", "stages"),
    ("16,16,16,4,1,", "integers"), ("16,16,16", "expected"),
])  # fmt: skip
def test_bad_block_config_is_rejected(var, env, what, monkeypatch):
    monkeypatch.setenv(var, env)
    with pytest.raises(ValueError, match=f"{var}.*{what}"):
        fused._env_cfg(var)
    monkeypatch.setenv(var, "16,16,16,4,1,1")
    assert fused._env_cfg(var)["GM"] == 1


@pytest.mark.parametrize("env", ["32,128", "32,100,4", "a,b,c", "0,128,4"])
def test_bad_combine_config_is_rejected(env, monkeypatch):
    monkeypatch.setattr(fused, "interpreted", lambda: False)  # the knob is for the GPU
    monkeypatch.setenv("MOE_OVERLAP_COMBINE_CONFIG", env)
    with pytest.raises(ValueError, match="MOE_OVERLAP_COMBINE_CONFIG"):
        fused._combine_config(1, 256)
    assert fused._combine_config(2, 256) == (32, 256, 4)  # W > 1 tiles like the GEMM
    monkeypatch.setenv("MOE_OVERLAP_COMBINE_CONFIG", "16,256,8")
    assert fused._combine_config(1, 256) == (16, 256, 8)
    monkeypatch.delenv("MOE_OVERLAP_COMBINE_CONFIG")
    assert fused._combine_config(1, 256) == (16, 128, 4)


@pytest.mark.parametrize("epi", [1, 4, 8])
@pytest.mark.parametrize(
    "case",
    [
        Case(1, (13,), 13, 40, 5, 3, "swiglu", False, "zipf"),
        Case(1, (9,), 24, 20, 4, 2, "silu", False, "drop"),
        Case(1, (10,), 24, 7, 3, 2, "relu", False, "uniform"),
    ],
    ids=str,
)
def test_weights_grad_from_epilogue_partials_with_zero_and_tiny_weights(case, epi, monkeypatch):
    # One rank without b2: d topk_weights comes from the dispatch GEMM's per-(slot, N tile)
    # partials divided by the weight; zero and tiny weights must take the o-row path instead.
    from moe_overlap.kernels import row_dot as rd

    bn = 64 if epi == 8 else 32
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", f"16,{bn},16,4,1,8,{epi}")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", "1")  # F >= H here would choose row_dot
    prob = make_problem(case)
    w = prob.wts[0]
    w.view(-1)[::3] = 0.0
    w.view(-1)[1::5] = rd.DW_MIN_WEIGHT / 4
    w.view(-1)[2::7] = rd.DW_MIN_WEIGHT * 4  # still divided: must be as right
    calls = []
    real = rd.weights_grad_from_partials
    monkeypatch.setattr(fused, "weights_grad_from_partials", lambda *a: calls.append(1) or real(*a))
    check_against_reference(prob, run_fused(prob))
    assert calls, "the one-rank backward did not take the fused weights' gradient"


@pytest.mark.parametrize("force", ["1", None])
def test_fp16_small_weights_keep_their_gradient(force, monkeypatch):
    # fp16 A rows w * dy underflow for small weights, so fp16 never takes the epilogue
    # partials, even when forced: d topk_weights must match the float64 reference.
    if force:
        monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", force)
    g = torch.Generator().manual_seed(5)
    T, H, F, E, K = 8, 32, 16, 2, 2
    x = torch.randn(T, H, generator=g).half()
    ids = torch.randint(0, E, (T, K), generator=g)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.2).half()
    w2 = (torch.randn(E, H, F, generator=g) * 0.2).half()
    wts = torch.full((T, K), 1e-6).requires_grad_()
    gy = (torch.randn(T, H, generator=g) * 1e-2).half()
    fused.fused_experts(x, ids, wts, w1, w2, world=local_world()).backward(gy)
    d = torch.float64
    wr = wts.detach().to(d).requires_grad_()
    y = ref.experts(x.to(d), ids, wr, w1.to(d), w2.to(d), "swiglu", None, None)
    (y * gy.to(d)).sum().backward()
    assert_close(wts.grad, wr.grad, dtype=torch.float16, name="fp16 d topk_weights")


@pytest.mark.parametrize(
    "case",
    [
        Case(1, (9,), 13, 20, 4, 2, "swiglu", True, "zipf"),
        Case(2, (6, 5), 13, 7, 4, 2, "gelu", False, "uniform"),
    ],
    ids=str,
)
def test_cached_dummy_arguments_are_never_read_or_written(case, monkeypatch):
    # The launchers pass cached one-element tensors for pointers their constexpr flags never
    # touch: poisoned, they must neither change a result nor be written.
    poison = {
        torch.int32: 123456789,
        torch.int64: -987654321,
        torch.float32: float("nan"),
        torch.float16: float("nan"),
    }
    cache = {(torch.device("cpu"), dt): torch.full((1,), v, dtype=dt) for dt, v in poison.items()}
    monkeypatch.setattr(fused, "_DUMMIES", cache)
    prob = make_problem(case)
    keys = set(cache)
    check_against_reference(prob, run_fused(prob))
    assert set(cache) == keys, f"the launchers made dummies of their own: {set(cache) - keys}"
    for (_, dt), t in cache.items():
        assert t.numel() == 1 and t.dtype == dt
        v = t.item()
        assert v == poison[dt] or (v != v and poison[dt] != poison[dt]), f"{dt} dummy written"


@pytest.mark.parametrize("expert", [2, 5])  # local to rank 1, or on rank 2
def test_one_assignment_in_the_whole_world(expert):
    # Every id -1 but one: most experts and ranks empty, dropped tokens give exactly 0.
    case = Case(3, (4, 5, 2), 13, 7, 6, 2, "swiglu", True, "uniform")
    prob = make_problem(case)
    for r in range(case.W):
        prob.ids[r].fill_(-1)
    prob.ids[1][2, 1] = expert
    got = run_fused(prob)
    check_against_reference(prob, got)
    for r in range(case.W):
        y, grads = got[r][0], got[r][1]
        rows = [t for t in range(case.tokens[r]) if not (r == 1 and t == 2)]
        assert torch.equal(y[rows], torch.zeros_like(y[rows])), "dropped tokens must give 0"
        if r != 1:
            assert torch.equal(grads["x"], torch.zeros_like(grads["x"]))
            assert torch.equal(grads["topk_weights"], torch.zeros(case.tokens[r], case.K))


@pytest.mark.parametrize(
    "case",
    [Case(1, (0,), 13, 20, 4, 2, "swiglu", True, "uniform"), EMPTY_RANK],
    ids=["W1", "W2"],
)
def test_empty_rank_backward_with_the_gradient_of_a_sum(case):
    """``y.sum().backward()`` on a rank with no tokens hands the backward a [0, H] gradient
    with strides (0, 0); an empty tensor counts as contiguous, so it reached the row kernels
    as is and they refused it (and at W > 1 the peers then timed out)."""

    def zero_strided(g):
        return g if g.numel() else g.new_ones(()).expand(g.shape)

    prob = make_problem(case)
    got = run_fused(prob, gy_layout=zero_strided)
    check_against_reference(prob, got)


# ------------------------------------------------------------------------------ repeated calls
def test_repeated_calls_are_bitwise_identical_and_layouts_change():
    # Several ops on one world: flags and epochs reset, the workspace is reused and regrown,
    # the combine is deterministic. Between the repeats, a different routing and token count.
    case = Case(3, (6, 0, 4), 13, 20, 6, 2, "gelu", True, "uniform")
    prob = make_problem(case)
    other = make_problem(Case(3, (11, 9, 1), 13, 20, 6, 3, "gelu", True, "zipf", seed=1))

    def fn(world):
        r = world.rank
        leaves = local_leaves(prob, r, ())
        leaves_o = local_leaves(other, r, ())
        poison_workspace(world)
        first = call(leaves, prob.ids[r], world, case.act)
        second = call(leaves, prob.ids[r], world, case.act)
        mid = call(leaves_o, other.ids[r], world, case.act)
        with torch.no_grad():
            third = call(leaves, prob.ids[r], world, case.act)
        grad_leaves = local_leaves(prob, r)
        fourth = call(grad_leaves, prob.ids[r], world, case.act)  # saves tensors for backward
        return first, second, third, fourth.detach(), mid

    out = spawn(case.W, fn, timeout=120)
    ys, _, _ = run_reference(prob)
    ys_o, _, _ = run_reference(other)
    for r, (first, second, third, fourth, mid) in enumerate(out):
        assert_close(first, ys[r], name=f"rank {r}: y")
        assert_close(mid, ys_o[r], name=f"rank {r}: y of the other routing")
        for name, y in (("second", second), ("no_grad", third), ("requires_grad", fourth)):
            assert torch.equal(y, first), f"rank {r}: {name} call differs bitwise from the first"


@pytest.mark.parametrize("W,tokens", [(1, (7,)), (3, (5, 0, 9))])
def test_static_sizing_equals_exact_sizing(W, tokens):
    case = Case(W, tokens, 24, 7, 3 * W, 2, "swiglu", True, "zipf", seed=3)
    prob = make_problem(case)
    exact = run_fused(prob)
    static = run_fused(prob, max_tokens_per_rank=12)
    check_against_reference(prob, static)
    for r in range(W):
        assert torch.equal(static[r][0], exact[r][0]), f"rank {r}: y static != exact"
        for k, g in exact[r][1].items():
            assert_close(static[r][1][k], g, rtol=1e-5, atol=1e-5, name=f"rank {r}: d{k}")


def test_max_tokens_per_rank_equal_to_tokens_is_fine():
    case = Case(2, (6, 3), 13, 7, 4, 2, "silu", False, "uniform")
    prob = make_problem(case)
    got = run_fused(prob, max_tokens_per_rank=6)
    check_against_reference(prob, got)


DUP_CASES = [(1, 1, 3), (2, 2, 2)]  # (W, E, K) with K > El


def _dup_problem(W, E, K):
    return make_problem(Case(W, (12,) * W, 13, 7, E, K, "swiglu", False, "hot"))


def static_layout_probe():
    """Build static layouts for :data:`DUP_CASES` and check their capacity on the host."""
    for W, E, K in DUP_CASES:
        prob = _dup_problem(W, E, K)

        def fn(world, prob=prob, E=E):
            lay = fused.dispatch_layout(prob.ids[world.rank], E, world, max_tokens_per_rank=12)
            return int(lay.n_tiles[0]) * lay.block_m, lay.rows_cap

        for r, (need, cap) in enumerate(spawn(W, fn, timeout=60)):
            assert need <= cap, f"W={W} E={E} K={K} rank {r}: {need} rows > rows_cap {cap}"
    print("probe ok")


def test_static_sizing_holds_duplicate_ids():
    # Duplicate ids in a token send K rows of one token to one expert: with K > El a rank can
    # receive W * T * K rows. An undersized static layout is written out of bounds (measured:
    # it aborts the process inside build_layout), so the layouts are first built in a child.
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_fused_experts as t; t.static_layout_probe()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "probe ok" in res.stdout, (
        f"static layout with duplicate ids failed (rc {res.returncode}; an abort means "
        "build_layout laid out more rows than its static rows_cap):\n"
        f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    for W, E, K in DUP_CASES:
        prob = _dup_problem(W, E, K)
        check_against_reference(prob, run_fused(prob, max_tokens_per_rank=12))


def test_workspace_growth_between_calls():
    # No pre-grown workspace: the first call allocates it; then another op of the same world
    # grows it (the world's workspace is shared by every op), the old one is gone, and the
    # next call must use the new one (poisoned) and reproduce the first bitwise.
    case = Case(2, (6, 5), 24, 20, 4, 2, "relu", True, "uniform")
    prob = make_problem(case)

    def fn(world):
        r = world.rank
        lv = local_leaves(prob, r, ())
        y1 = call(lv, prob.ids[r], world, "relu")
        old = world.workspace(0)
        grown = world.workspace(2 * old.local.numel())  # collective: every rank asks the same
        assert grown.local.data_ptr() != old.local.data_ptr()
        old.local.fill_(0)
        grown.local.fill_(0xFF)
        world.barrier()
        y2 = call(lv, prob.ids[r], world, "relu")
        return y1, y2

    ys = run_reference(prob)[0]
    for r, (y1, y2) in enumerate(spawn(2, fn, timeout=60)):
        assert_close(y1, ys[r], name=f"rank {r}: y")
        assert torch.equal(y2, y1), f"rank {r}: the call after growth differs"


def test_two_layers_backward_in_reverse_order_and_twice():
    # A model's pattern: forward layer A, forward layer B (other routing, other H), backward B,
    # backward A, on one world; then A's backward again (retain_graph): bitwise the same.
    a = make_problem(Case(3, (5, 0, 7), 13, 20, 6, 2, "swiglu", True, "drop"))
    b = make_problem(Case(3, (9, 4, 2), 24, 7, 6, 3, "silu", False, "zipf", seed=2))

    def fn(world):
        r = world.rank
        lv_a, lv_b = local_leaves(a, r), local_leaves(b, r)
        y_a = call(lv_a, a.ids[r], world, "swiglu")
        y_b = call(lv_b, b.ids[r], world, "silu")
        y_b.backward(b.gy[r])
        names = [k for k in GRAD_NAMES if lv_a[k] is not None]
        g1 = torch.autograd.grad(y_a, [lv_a[k] for k in names], a.gy[r], retain_graph=True)
        g2 = torch.autograd.grad(y_a, [lv_a[k] for k in names], a.gy[r])
        for k, u, v in zip(names, g1, g2):
            assert torch.equal(u, v), f"rank {r}: d{k} differs between two backward passes"
        grads_b = {k: v.grad for k, v in lv_b.items() if v is not None}
        return (y_a.detach(), dict(zip(names, g1))), (y_b.detach(), grads_b)

    out = spawn(3, fn, timeout=120)
    check_against_reference(a, [o[0] for o in out])
    check_against_reference(b, [o[1] for o in out])


@pytest.mark.parametrize("wdtype", [torch.float64, torch.bfloat16])
def test_topk_weights_of_another_float_dtype(wdtype):
    case = Case(2, (6, 5), 13, 7, 4, 2, "gelu", True, "uniform", seed=8)
    prob = make_problem(case)
    prob.wts = [w.to(wdtype) for w in prob.wts]
    got = run_fused(prob)
    check_against_reference(prob, got)
    for r in range(case.W):
        assert got[r][1]["topk_weights"].dtype == wdtype


# ------------------------------------------------------------------------------ grads subsets
@pytest.mark.parametrize(
    "W,grads_of",
    [
        (2, ("x", "topk_weights")),  # frozen experts: the router still learns
        (1, ("w1", "b2")),  # x needs no grad
        (3, ("topk_weights",)),
    ],
)
def test_partial_requires_grad(W, grads_of):
    case = Case(W, (5, 8, 0)[:W], 13, 20, 2 * W, 2, "swiglu", True, "uniform", seed=4)
    prob = make_problem(case)
    got = run_fused(prob, grads_of=grads_of)
    check_against_reference(prob, got, grads_of=grads_of)
    for r in range(W):
        assert set(got[r][1]) == set(grads_of)


# ------------------------------------------------------------------------------ layouts of inputs
def _noncontiguous(leaves):
    """Same values, strided storage: x a column slice, weights transposed views."""
    out = dict(leaves)
    x = leaves["x"]
    out["x"] = torch.cat([x, torch.randn_like(x)], 1)[:, : x.shape[1]]
    out["w1"] = leaves["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    out["w2"] = leaves["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    w = leaves["topk_weights"]
    out["topk_weights"] = w.t().contiguous().t()
    for b in ("b1", "b2"):  # column-major: the kernels read bias rows densely
        if leaves.get(b) is not None:
            out[b] = leaves[b].t().contiguous().t()
    for k in ("x", "w1", "w2"):
        assert not out[k].is_contiguous()
    return {k: (None if v is None else v.detach()) for k, v in out.items()}


def test_noncontiguous_inputs_and_int32_ids():
    case = Case(2, (7, 4), 13, 20, 4, 2, "relu", True, "zipf", seed=5)
    prob = make_problem(case)
    prob.ids = [i.to(torch.int32) for i in prob.ids]
    got = run_fused(prob, transform=_noncontiguous, gy_layout=lambda g: g.t().contiguous().t())
    check_against_reference(prob, got)


@pytest.mark.parametrize("dtype,case", [
    (torch.float16, Case(2, (9, 5), 24, 20, 4, 2, "swiglu", True, "uniform", seed=6)),
    # bf16 in the interpreter: its bf16 tl.dot is fixed in kernels/launch.py
    (torch.bfloat16, Case(1, (9,), 24, 20, 4, 3, "swiglu", True, "zipf", seed=11)),
    (torch.bfloat16, Case(2, (9, 5), 24, 20, 4, 3, "swiglu", True, "zipf", seed=11)),
], ids=["fp16", "bf16-W1", "bf16-W2"])  # fmt: skip
def test_low_precision(dtype, case):
    """Every kernel of the forward and backward against float64 on the same rounded inputs;
    outputs and gradients keep the input dtype."""
    prob = make_problem(case, dtype=dtype)
    got = run_fused(prob)
    check_against_reference(prob, got, dtype=dtype)
    for r in range(case.W):
        assert got[r][0].dtype == dtype
        assert got[r][1]["w1"].dtype == dtype and got[r][1]["w2"].dtype == dtype


@pytest.mark.parametrize("W", [1, 2])
def test_tma_descriptor_path_and_pointer_path(W, monkeypatch):
    # 16-byte rows (H = 24, F = 20 in fp32) take the TMA descriptors: the weights k-contiguous
    # in the forward (layer 0's gate and up tiles in one 3-d box, mode 3; layer 1 mode 1),
    # n-contiguous in the backward (mode 2), layer 1's A rows too, and
    # the flattened tile loops at W = 1, where layer 0's A rows are staged contiguously and
    # loaded by TMA too (forward and the backward's dispatch GEMM; H = 24 is not a multiple of
    # BK = 16, so the last K tile reads past the rows: TMA's zero fill). MOE_OVERLAP_TMA=0
    # takes pointer loads on the same problem. Both match the reference; tiles cross expert
    # boundaries (F = 20 > BN = 16); zipf routing leaves experts empty.
    case = Case(W, (9, 6)[:W], 24, 20, 4, 2, "swiglu", True, "zipf", seed=11)
    prob = make_problem(case)
    modes, staged = [], []
    real, real_staged = fused._weight_operand, fused._staged_rows_desc

    def spy(*a, **k):
        out = real(*a, **k)
        modes.append(out[0])
        return out

    def spy_staged(*a, **k):
        out = real_staged(*a, **k)
        staged.append(out is not None)
        return out

    stores, real_out = [], fused._out_descs

    def spy_out(*a, **k):
        out = real_out(*a, **k)
        if a[3] is None:  # forward calls only (the backward's dact never stores by TMA)
            stores.append(out[0] is not None)
        return out

    monkeypatch.setattr(fused, "_weight_operand", spy)
    monkeypatch.setattr(fused, "_staged_rows_desc", spy_staged)
    monkeypatch.setattr(fused, "_out_descs", spy_out)
    got = run_fused(prob)
    check_against_reference(prob, got)
    assert sorted(set(modes)) == [1, 2, 3], modes
    # W = 1: forward and backward layer 0 both staged; W = 2: never asked
    assert staged == ([True, True] if W == 1 else []), staged
    # layer 0's forward stored h (and its saved gate/up halves) by TMA
    assert stores == [True] * W, stores
    # gate and up tiles loaded apart (MOE_OVERLAP_L0_PAIR=0), h stored by pointers
    # (MOE_OVERLAP_L0_TMA_STORE=0): the reference's numbers too
    modes.clear()
    staged.clear()
    stores.clear()
    monkeypatch.setenv("MOE_OVERLAP_L0_PAIR", "0")
    monkeypatch.setenv("MOE_OVERLAP_L0_TMA_STORE", "0")
    got_apart = run_fused(prob)
    check_against_reference(prob, got_apart)
    assert sorted(set(modes)) == [1, 2], modes
    assert stores == [False] * W, stores
    monkeypatch.delenv("MOE_OVERLAP_L0_PAIR")
    monkeypatch.delenv("MOE_OVERLAP_L0_TMA_STORE")
    modes.clear()
    staged.clear()
    stores.clear()
    monkeypatch.setenv("MOE_OVERLAP_TMA", "0")
    got_ptr = run_fused(prob)
    check_against_reference(prob, got_ptr)
    assert set(modes) == {0}, modes
    assert staged == [], staged
    assert stores == [False] * W, stores
    # 13 * 4 bytes per row: no descriptor even with TMA on
    monkeypatch.delenv("MOE_OVERLAP_TMA")
    assert fused._weight_operand(torch.zeros(2, 8, 13), 8, 13, 8, 13, 1, 16, 16) == (0, None)


def test_default_world_is_a_local_world():
    case = Case(1, (6,), 13, 7, 3, 2, "swiglu", False, "uniform")
    prob = make_problem(case)
    leaves = local_leaves(prob, 0, ())
    y_default = mo.fused_experts(
        leaves["x"], prob.ids[0], leaves["topk_weights"], leaves["w1"], leaves["w2"]
    )
    y_local = call(leaves, prob.ids[0], local_world("cpu"), case.act)
    assert torch.equal(y_default, y_local)
    assert_close(y_default, run_reference(prob)[0][0])


def test_no_grad_runs_the_inference_forward(monkeypatch):
    """Under ``torch.no_grad`` with trainable weights: no saved pre-activations or gathered
    rows (the autograd Function saw ``needs_input_grad`` and ran the training forward), and
    the same output as with grad."""
    seen = []
    real = fused._forward_body

    def spy(*a):
        seen.append(a[-1])
        return real(*a)

    monkeypatch.setattr(fused, "_forward_body", spy)
    g = torch.Generator().manual_seed(4)
    T, H, F, E, K = 6, 16, 8, 4, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.25).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) * 0.3).requires_grad_()
    world = local_world("cpu")
    with torch.no_grad():
        y0 = mo.fused_experts(x, ids, w, w1, w2, world)
    assert seen == [False] and not y0.requires_grad
    y1 = mo.fused_experts(x, ids, w, w1, w2, world)
    assert seen == [False, True] and y1.requires_grad
    assert torch.equal(y0, y1.detach())


def test_double_backward_raises():
    """The kernels' gradients carry no graph: a second-order gradient must raise, not come
    back without the experts' terms."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    ids = torch.randint(4, (6, 2), generator=g)
    w1 = (torch.randn(4, 16, 16, generator=g) * 0.25).requires_grad_()
    w2 = torch.randn(4, 16, 8, generator=g) * 0.3
    y = mo.fused_experts(x, ids, torch.rand(6, 2, generator=g), w1, w2, local_world("cpu"))
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.square().sum().backward()  # a gradient penalty


@pytest.mark.parametrize(
    "case",
    [
        Case(3, (6, 2, 5), 24, 20, 6, 2, "swiglu", True, "drop", seed=7),
        Case(2, (9, 0), 13, 7, 4, 1, "swiglu", True, "hot"),  # K = 1, a rank without tokens
        Case(2, (5, 7), 13, 20, 4, 3, "gelu", True, "zipf"),
    ],
    ids=str,
)
def test_layer0_layer1_api_equals_fused_experts(case):
    # The benchmark entry points, also used by the GPU test that delays producers per layer.
    prob = make_problem(case)

    def fn(world):
        r = world.rank
        lv = local_leaves(prob, r, ())
        poison_workspace(world)
        layout = fused.dispatch_layout(prob.ids[r], case.E, world)
        # column-major biases (same values): the kernels read bias rows densely
        b1, b2 = (b.t().contiguous().t() for b in (lv["b1"], lv["b2"]))
        h = fused.layer0(lv["x"], layout, lv["w1"], world, case.act, b1=b1)
        y = fused.layer1(h, layout, lv["topk_weights"], lv["w2"], world, b2=b2)
        return y, call(lv, prob.ids[r], world, case.act)

    ys, _, _ = run_reference(prob)
    for r, (y, y_fused) in enumerate(spawn(case.W, fn, timeout=120)):
        assert_close(y, ys[r], name=f"rank {r}: layer1(layer0(x))")
        assert torch.equal(y, y_fused)


def _layer_bad_inputs():
    g = torch.Generator().manual_seed(5)
    T, H, F, El, K = 4, 16, 8, 2, 2
    x = randn((T, H), generator=g)
    w1, w2 = randn((El, 2 * F, H), generator=g), randn((El, H, F), generator=g)
    tw = torch.rand(T, K, generator=g)
    l0 = [
        ("x rows", dict(x=randn((T + 1, H), generator=g)), ValueError, "layout was built"),
        ("x int", dict(x=torch.ones(T, H, dtype=torch.int32)), TypeError, "x"),
        ("w1 H", dict(w1=randn((El, 2 * F, H + 1), generator=g)), ValueError, "w1"),
        ("w1 El", dict(w1=randn((El + 1, 2 * F, H), generator=g)), ValueError, "w1"),
        ("w1 odd swiglu", dict(w1=randn((El, 2 * F - 1, H), generator=g)), ValueError, "w1"),
        ("w1 dtype", dict(w1=w1.half()), TypeError, "w1 dtype"),
        ("b1 shape", dict(b1=randn((El, F), generator=g)), ValueError, "b1"),
        ("activation", dict(activation="tanh"), ValueError, "activation"),
        ("w1 device", dict(w1=w1.to("meta")), ValueError, "w1"),
    ]
    l1 = [
        ("weights shape", dict(topk_weights=torch.rand(T, K + 1, generator=g)), ValueError, "tw"),
        ("weights rows", dict(topk_weights=torch.rand(T - 1, K, generator=g)), ValueError, "tw"),
        ("weights int", dict(topk_weights=torch.ones(T, K, dtype=torch.int32)), TypeError, "tw"),
        ("w2 F", dict(w2=randn((El, H, F + 3), generator=g)), ValueError, "w2"),
        ("h rows", dict(h=None), ValueError, "rows"),
        ("b2 shape", dict(b2=randn((El, H + 1), generator=g)), ValueError, "b2"),
        ("w2 dtype", dict(w2=w2.half()), TypeError, "w2 dtype"),
    ]
    base = dict(x=x, w1=w1, w2=w2, topk_weights=tw, b1=None, b2=None, activation="swiglu")
    return base, [("layer0", *c) for c in l0] + [("layer1", *c) for c in l1]


_LAYER_BASE, _LAYER_BAD = _layer_bad_inputs()


@pytest.mark.parametrize("which,what,change,err,match", _LAYER_BAD, ids=lambda v: str(v))
def test_layer_api_bad_input_raises_before_launch(which, what, change, err, match, monkeypatch):
    """The benchmark entry points check their arguments against the layout as fused_experts
    does: a wrong weights shape read out of bounds, an int one was taken as floats."""
    kw = dict(_LAYER_BASE, **change)
    world = local_world("cpu")
    layout = fused.dispatch_layout(torch.tensor([[0, 1], [1, -1], [0, 0], [-1, 1]]), 2, world)
    h = fused.layer0(_LAYER_BASE["x"], layout, _LAYER_BASE["w1"], world)  # a good h
    if kw.get("h", h) is None:
        h = h[:-1]

    def boom(*a, **k):
        raise AssertionError("launched despite bad input")

    for name in ("_launch_layer0", "_launch_layer1"):
        monkeypatch.setattr(fused, name, boom)
    match = "topk_weights" if match == "tw" else match
    with pytest.raises(err, match=match):
        if which == "layer0":
            fused.layer0(kw["x"], layout, kw["w1"], world, kw["activation"], b1=kw["b1"])
        else:
            fused.layer1(h, layout, kw["topk_weights"], kw["w2"], world, b2=kw["b2"])


# ------------------------------------------------------------------------------ timeouts
class _SkipProducers:
    """Stands in for ``_layer0_kernel``: drops the producer launches of one rank."""

    def __init__(self, kernel, rank):
        self.kernel, self.rank = kernel, rank

    def __getitem__(self, grid):
        def launch(**kw):
            if kw["ROLE"] == 1 and kw["rank"] == self.rank:
                return None
            return self.kernel[grid](**kw)

        return launch


@pytest.mark.filterwarnings("ignore:overflow encountered")  # tiles that gave up read garbage
def test_missing_dispatch_producer_raises_comm_timeout(monkeypatch):
    # Rank 1 keeps the protocol's barriers but its dispatch producers never run: rank 0's GEMM
    # tiles wait for rank 1's rows of expert 0, give up, and end_op raises at once on the CPU.
    monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", "20")
    monkeypatch.setattr(fused, "_layer0_kernel", _SkipProducers(fused._layer0_kernel, 1))
    case = Case(2, (3, 4), 13, 7, 4, 2, "swiglu", False, "uniform")
    prob = make_problem(case)
    prob.ids[1] = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0]])  # 5 rows for rank 0's experts

    def fn(world):
        assert world.wait_budget == 20
        leaves = local_leaves(prob, world.rank, ())
        return call(leaves, prob.ids[world.rank], world, case.act)

    with pytest.raises(CommTimeoutError) as ei:
        spawn(case.W, fn, timeout=60)
    e = ei.value
    El = case.E // case.W
    assert (e.rank, e.stage, e.seen) == (0, STAGE_DISPATCH, 0)
    # Flag src * El + l: rank 1's slice of local expert 0 (4 rows) or 1 (1 row).
    assert (e.index, e.expected) in ((1 * El + 0, 4), (1 * El + 1, 1))
    assert "dispatch" in str(e)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_a_dead_peer_costs_one_wait_budget_not_one_per_tile(monkeypatch):
    """After a rank's first timeout its later waits look once: the GEMM tiles of a dead peer's
    rows (16 here) must not each spin a full budget (20 s a wait on a GPU: minutes)."""
    from triton.runtime import interpreter

    budget = 30
    monkeypatch.setenv("MOE_OVERLAP_WAIT_ITERS", str(budget))
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", "16,16,16,4,1")
    polls = {"n": 0}
    rmw = interpreter.InterpreterBuilder.create_atomic_rmw

    def counting(self, *a, **k):  # the acquire polls are atomic adds of 0
        polls["n"] += 1
        return rmw(self, *a, **k)

    class ConsumerPolls(_SkipProducers):
        def __getitem__(self, grid):
            def launch(**kw):
                if kw["ROLE"] == 1 and kw["rank"] == self.rank:
                    return None
                if kw["ROLE"] == 2 and kw["rank"] == 0:
                    polls["n"] = 0
                    self.kernel[grid](**kw)
                    polls["consumer"] = polls["n"]
                    return None
                return self.kernel[grid](**kw)

            return launch

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", counting)
    monkeypatch.setattr(fused, "_layer0_kernel", ConsumerPolls(fused._layer0_kernel, 1))
    H, F = 16, 64  # rank 1's 64 rows for rank 0's expert: 4 row tiles x 4 column tiles

    def fn(world):
        T = 1 if world.rank == 0 else 64
        g = torch.Generator().manual_seed(world.rank)
        ids = torch.full((T, 1), 1 if world.rank == 0 else 0, dtype=torch.long)
        w1 = torch.randn(1, 2 * F, H, generator=g) * 0.1
        w2 = torch.randn(1, H, F, generator=g) * 0.1
        with torch.no_grad():
            mo.fused_experts(torch.randn(T, H, generator=g), ids, torch.ones(T, 1), w1, w2, world)

    with pytest.raises(CommTimeoutError, match="dispatch"):
        spawn(2, fn, timeout=120)
    assert budget < polls["consumer"] < 2 * budget + 32, polls  # was ~16 budgets


def test_a_dropped_assignment_never_reads_its_weight():
    """Dropped slots contribute nothing, whatever their weight: a router that renormalizes an
    all-dropped token gives 0 / 0 = NaN weights (0 * NaN made the token's output NaN)."""
    case = Case(2, (5, 4), 16, 12, 4, 2, "swiglu", False, "drop", seed=9)
    prob = make_problem(case)
    for r in range(case.W):
        prob.ids[r][0] = -1  # token 0: every assignment dropped
        dropped = prob.ids[r] < 0
        prob.wts[r][dropped] = float("inf") if r else float("nan")
    got = run_fused(prob, backward=False)
    ys, _, _ = run_reference(prob)
    for r in range(case.W):
        assert torch.isfinite(got[r][0]).all()
        assert_close(got[r][0], ys[r], name=f"rank {r}")


# ------------------------------------------------------------------------------ bad input
T0, H0, F0, El0, K0 = 4, 8, 6, 2, 2


def _valid(act="swiglu"):
    g = torch.Generator().manual_seed(11)
    rows = w1_rows(act, F0)
    return dict(
        x=randn((T0, H0), generator=g),
        topk_ids=torch.tensor([[0, 1], [1, -1], [0, 0], [-1, -1]]),
        topk_weights=torch.rand(T0, K0, generator=g),
        w1=randn((El0, rows, H0), generator=g),
        w2=randn((El0, H0, F0), generator=g),
        activation=act,
        b1=None,
        b2=None,
    )


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


BAD = [
    ("x 1-D", dict(x=torch.randn(T0 * H0)), ValueError, "x"),
    ("x int", dict(x=torch.ones(T0, H0, dtype=torch.int32)), TypeError, "x"),
    ("x not a tensor", dict(x=[[0.0] * H0] * T0), TypeError, "x"),
    ("hidden size", dict(w2=torch.randn(El0, H0 + 1, F0)), ValueError, "hidden size"),
    ("w1 rows", dict(w1=torch.randn(El0, F0, H0)), ValueError, "w1"),
    ("w1 hidden", dict(w1=torch.randn(El0, 2 * F0, H0 - 1)), ValueError, "w1"),
    ("w1 experts", dict(w1=torch.randn(El0 + 1, 2 * F0, H0)), ValueError, "w1"),
    ("w1 2-D", dict(w1=torch.randn(2 * F0, H0)), ValueError, "w1"),
    ("w1 dtype", dict(w1=torch.randn(El0, 2 * F0, H0, dtype=torch.float16)), TypeError, "w1"),
    ("w2 int", dict(w2=torch.ones(El0, H0, F0, dtype=torch.int64)), TypeError, "w2"),
    ("ids float", dict(topk_ids=torch.zeros(T0, K0)), TypeError, "topk_ids"),
    # unsigned ids cannot say -1, and their range check wraps (valid uint8 ids were refused)
    ("ids uint8", dict(topk_ids=torch.zeros(T0, K0, dtype=torch.uint8)), TypeError, "signed"),
    ("ids rows", dict(topk_ids=torch.zeros(T0 + 1, K0, dtype=torch.long)), ValueError, "topk_ids"),
    (
        "ids no columns",
        dict(topk_ids=torch.zeros(T0, 0, dtype=torch.long), topk_weights=torch.zeros(T0, 0)),
        ValueError,
        "topk_ids",
    ),
    (
        "ids >= E",
        dict(topk_ids=torch.tensor([[0, 1], [2, 0], [0, 0], [1, 1]])),
        ValueError,
        "topk_ids",
    ),
    (
        "ids < -1",
        dict(topk_ids=torch.tensor([[0, 1], [-2, 0], [0, 0], [1, 1]])),
        ValueError,
        "topk_ids",
    ),
    ("weights shape", dict(topk_weights=torch.rand(T0, K0 + 1)), ValueError, "topk_weights"),
    (
        "weights int",
        dict(topk_weights=torch.ones(T0, K0, dtype=torch.int32)),
        TypeError,
        "topk_weights",
    ),
    ("b1 shape", dict(b1=torch.randn(El0, F0)), ValueError, "b1"),
    ("b2 shape", dict(b2=torch.randn(El0, H0 + 1)), ValueError, "b2"),
    ("b1 not a tensor", dict(b1=1.0), ValueError, "b1"),
    (
        "no experts",
        dict(w1=randn((0, 2 * F0, H0)), w2=randn((0, H0, F0))),
        ValueError,
        "no experts",
    ),
    ("activation", dict(activation="tanh"), ValueError, "activation"),
    ("activation none", dict(activation="none"), ValueError, "activation"),
    ("w1 device", dict(w1=_meta(torch.empty(El0, 2 * F0, H0))), ValueError, "w1"),
    ("b2 device", dict(b2=_meta(torch.empty(El0, H0))), ValueError, "b2"),
    (
        "ids device",
        dict(topk_ids=_meta(torch.zeros(T0, K0, dtype=torch.long))),
        ValueError,
        "topk_ids",
    ),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything past input validation runs."""

    def boom(*a, **k):
        raise AssertionError("launched despite bad input")

    for name in ("build_layout", "_launch_layer0", "_launch_layer1"):
        monkeypatch.setattr(fused, name, boom)


@pytest.mark.parametrize("what,change,err,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_launch(what, change, err, match, no_launch):
    kw = _valid()
    kw.update(change)
    with pytest.raises(err, match=match):
        mo.fused_experts(world=local_world("cpu"), **kw)


def test_tokens_above_max_tokens_per_rank(no_launch):
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        mo.fused_experts(world=local_world("cpu"), max_tokens_per_rank=T0 - 1, **_valid())


def test_ids_out_of_range_on_a_multi_rank_world(no_launch):
    # E = El * W = 4: id 3 would be fine, id 4 is out of range on every rank.
    def fn(world):
        kw = _valid()
        kw["topk_ids"] = torch.tensor([[0, 3], [1, -1], [4, 0], [-1, -1]])
        mo.fused_experts(world=world, **kw)

    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 4\)"):
        spawn(2, fn, timeout=30)


@pytest.mark.parametrize("what", ["H", "local experts", "max_tokens_per_rank", "dtype"])
def test_ranks_that_disagree_raise_on_every_rank(what, no_launch):
    """A rank whose rows are wider, or that owns more experts, would push rows past its peers'
    buffers or route ids to the wrong ranks: every rank raises instead, before any launch."""

    def fn(world):
        r = world.rank
        H = 16 + 8 * r if what == "H" else 16
        El = 2 + r if what == "local experts" else 2
        dt = torch.float16 if what == "dtype" and r else torch.float32
        kw = dict(max_tokens_per_rank=8 + r) if what == "max_tokens_per_rank" else {}
        x = torch.randn(4, H).to(dt)
        ids = torch.tensor([[0, 1], [1, -1], [2, 0], [-1, 3]])
        w1, w2 = torch.randn(El, 16, H).to(dt), torch.randn(El, H, 8).to(dt)
        with pytest.raises(ValueError, match="ranks disagree") as ei:
            mo.fused_experts(x, ids, torch.rand(4, 2), w1, w2, world, **kw)
        return str(ei.value)

    msgs = spawn(2, fn, timeout=30)
    assert all("rank 0:" in m and "rank 1:" in m for m in msgs), msgs


@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
def test_sizes_travel_with_the_count_exchange(static, monkeypatch):
    """Real worlds skip World.agree by default (a host all-gather per op); the sizes ride on
    the count exchange instead, which every rank reads (exact sizing: ValueError on every
    rank) or asserts on the device (static sizing). Shown on an emulated world with its own
    check switched off."""
    monkeypatch.setenv("MOE_OVERLAP_CHECK_SIZES", "0")

    def fn(world):
        assert not world.checks_sizes
        H = 16 + 8 * world.rank
        x = torch.randn(4, H)
        ids = torch.tensor([[0, 1], [1, -1], [2, 0], [-1, 3]])
        w1, w2 = torch.randn(2, 16, H), torch.randn(2, H, 8)
        kw = dict(max_tokens_per_rank=4) if static else {}
        err = RuntimeError if static else ValueError
        with pytest.raises(err, match="disagree on") as ei:
            mo.fused_experts(x, ids, torch.rand(4, 2), w1, w2, world, **kw)
        return str(ei.value)

    msgs = spawn(2, fn, timeout=60)
    if not static:
        assert all("disagree on H (rank 0: H 16; rank 1: H 24)" in m for m in msgs), msgs


def test_num_experts_not_divisible_by_world_size(no_launch):
    def fn(world):
        fused.dispatch_layout(torch.zeros(3, 1, dtype=torch.long), 5, world)

    with pytest.raises(ValueError, match="divisible"):
        spawn(2, fn, timeout=30)


@pytest.fixture
def nan_filled_empty():
    """``torch.empty`` returns NaN-filled floats (and max ints): a kernel that leaves a row the
    backward reads unwritten shows up as a NaN gradient rather than as lucky zeros."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, (7,), 13, 7, 4, 2, "swiglu", True, "zipf"),
        Case(3, (5, 0, 9), 24, 20, 6, 2, "gelu", True, "hot"),
        Case(2, (6, 4), 13, 7, 4, 3, "relu", True, "drop"),
    ],
    ids=str,
)
def test_backward_never_reads_unwritten_rows(case, nan_filled_empty):
    # Static sizing leaves receive rows past the last tile that no kernel writes; padding rows
    # inside tiles are written as zeros by the epilogues (the wgrads read whole padded ranges).
    prob = make_problem(case)
    got = run_fused(prob, max_tokens_per_rank=16)
    check_against_reference(prob, got)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, (64,), 24, 20, 2, 2, "swiglu", True, "drop"),
        Case(1, (60,), 13, 7, 3, 3, "gelu", True, "uniform"),
        Case(1, (64,), 33, 7, 4, 4, "relu", False, "hot"),
    ],
    ids=str,
)
def test_one_rank_sync_free_sizing_never_reads_unwritten_rows(case, nan_filled_empty):
    # Enough assignments that one rank sizes its layout from the padding bound without a host
    # sync (4 E (BLOCK_M - 1) <= T K): tail rows past the last tile, never written.
    prob = make_problem(case)
    T, K, E = case.tokens[0], case.K, case.E
    assert 4 * E * 15 <= T * K  # BLOCK_M 16 in the interpreter
    check_against_reference(prob, run_fused(prob))
