"""GPU tests of ``fused_experts`` (compiled Triton, bf16, one GPU): emulated ranks and a local
world, against the float64 reference computed from the same bf16 values.

* sequential mode (every rank on one stream, producers before consumers): forward, W in
  {1, 2, 4}, larger sizes (T up to 2048, H up to 1024, F odd-ish like 1000 and 1408).
* backward: W = 1 on a local world, and W in {2, 4} in the concurrent mode. Emulated W > 1
  backward cannot run in the sequential mode: autograd runs every CUDA backward node of every
  rank's thread on one device worker thread, so the host barrier of the sequential protocol
  inside rank 0's backward node waits for rank 1's node queued behind it (measured on the H200,
  see DESIGN.md). The concurrent mode puts no host barrier in backward.
* concurrent mode with one rank's stream delayed by ``torch.cuda._sleep`` right before the op,
  before layer 0 (so the others' GEMM tiles wait for its dispatched rows) or before layer 1 (so
  the others' reductions wait for its combine stores). The data of every rank is checked, not
  only the flags: a missing ``debug_barrier`` before a publish or after a poll shows up here as
  wrong rows.
* CUDA-graph capture at W = 1 with ``max_tokens_per_rank`` set, replayed with new inputs copied
  into the static tensors, equal to eager.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import moe_overlap as mo
from moe_overlap import reference as ref
from moe_overlap.config import w1_rows
from moe_overlap.experts import fused
from moe_overlap.testing import assert_close, spawn
from moe_overlap.world import interpreted, local_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(interpreted(), reason="GPU tests run compiled (without TRITON_INTERPRET)"),
]

BF16 = torch.bfloat16
f64 = torch.float64
SLEEP_CYCLES = 20_000_000  # ~10 ms at H200 clocks: far longer than the op itself
GRAD_NAMES = ("x", "topk_weights", "w1", "w2", "b1", "b2")


# ------------------------------------------------------------------------------ problems
def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _ids(routing, T, E, K, g):
    """``[T, K]`` int64 ids: uniform (distinct), zipf (skewed, distinct), hot (first choice one
    expert, the rest distinct), drop (uniform, a quarter -1)."""
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if routing == "zipf":
        order = torch.randperm(E, generator=g)
        p = torch.empty(E)
        p[order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** 1.2
        return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    scores = torch.rand(T, E, generator=g)
    if routing == "hot":
        scores[:, E - 1] = 2.0  # the last expert (last rank) is everyone's first choice
    ids = scores.topk(K, dim=1).indices
    if routing == "drop":
        ids[torch.rand(T, K, generator=g) < 0.25] = -1
    return ids


def make_problem(W, tokens, H, F, E, K, act, bias, routing, seed=0):
    """Inputs generated in fp32 on the CPU, rounded to bf16; the reference upcasts these."""
    g = _gen(W, tokens, H, F, E, K, act, bias, routing, seed)
    rows = w1_rows(act, F)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(BF16)

    glob = dict(
        w1=rnd(E, rows, H, scale=H**-0.5),
        w2=rnd(E, H, F, scale=F**-0.5),
        b1=rnd(E, rows, scale=0.5) if bias else None,
        b2=rnd(E, H, scale=0.5) if bias else None,
    )
    per_rank = []
    for T in tokens:
        per_rank.append(
            dict(
                x=rnd(T, H),
                ids=_ids(routing, T, E, K, g),
                wts=(torch.rand(T, K, generator=g) + 0.1).to(BF16),
                gy=rnd(T, H),
            )
        )
    return dict(W=W, E=E, El=E // W, act=act, glob=glob, ranks=per_rank)


def leaves_of(prob, rank, device, requires_grad=False):
    sl = slice(rank * prob["El"], (rank + 1) * prob["El"])
    d = prob["ranks"][rank]
    out = dict(x=d["x"], topk_weights=d["wts"])
    for k, v in prob["glob"].items():
        out[k] = None if v is None else v[sl]
    out = {k: (None if v is None else v.to(device).clone()) for k, v in out.items()}
    if requires_grad:
        for v in out.values():
            if v is not None:
                v.requires_grad_(True)
    return out


def call(lv, ids, world, act, **kw):
    return mo.fused_experts(
        lv["x"],
        ids,
        lv["topk_weights"],
        lv["w1"],
        lv["w2"],
        world,
        activation=act,
        b1=lv["b1"],
        b2=lv["b2"],
        **kw,
    )


def reference(prob, device, backward=False, dtype=f64):
    """On ``device`` in ``dtype`` (float64, or bf16 for the plain-torch baseline): per-rank y,
    and grads (per-rank x / weights, global weights)."""
    glob = {
        k: None if v is None else v.to(device, dtype).requires_grad_(backward)
        for k, v in prob["glob"].items()
    }
    ys, xw, loss = [], [], torch.zeros((), dtype=f64, device=device)
    for d in prob["ranks"]:
        x = d["x"].to(device, dtype).requires_grad_(backward)
        w = d["wts"].to(device, dtype).requires_grad_(backward)
        y = ref.experts(
            x, d["ids"].to(device), w, glob["w1"], glob["w2"], prob["act"], glob["b1"], glob["b2"]
        )
        ys.append(y.detach())
        xw.append((x, w))
        if backward:
            loss = loss + (y * d["gy"].to(device, dtype)).sum()
    if not backward:
        return ys, None, None
    inputs = [t for p in xw for t in p] + [v for v in glob.values() if v is not None]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    it = iter(grads)
    rank_grads = [dict(x=next(it), topk_weights=next(it)) for _ in prob["ranks"]]
    glob_grads = {k: (None if v is None else next(it)) for k, v in glob.items()}
    return ys, rank_grads, glob_grads


def _pick(rank_grads, glob_grads, r, k, sl):
    if k in rank_grads[r]:
        return rank_grads[r][k]
    return None if glob_grads[k] is None else glob_grads[k][sl]


def check(prob, got, device, backward=False, tag=""):
    """Grads: bf16 values summed over many tokens carry rounding noise (and a relu kink can flip
    on a rounded pre-activation), so an element outside the bf16 tolerance passes only when the
    tensor is as accurate as bf16 torch autograd on the same problem (see ``assert_close``)."""
    ys, rank_grads, glob_grads = reference(prob, device, backward)
    if backward:
        _, base_rank, base_glob = reference(prob, device, backward, dtype=BF16)
    for r, res in enumerate(got):
        y, grads = res if backward else (res, None)
        assert y.dtype == BF16 and y.device.type == "cuda"
        assert_close(y, ys[r], dtype=BF16, name=f"{tag} rank {r}: y")
        if not backward:
            continue
        sl = slice(r * prob["El"], (r + 1) * prob["El"])
        for k in GRAD_NAMES:
            want = _pick(rank_grads, glob_grads, r, k, sl)
            if want is None:
                continue
            assert grads[k] is not None, f"{tag} rank {r}: no grad for {k}"
            base = _pick(base_rank, base_glob, r, k, sl)
            assert_close(grads[k], want, dtype=BF16, name=f"{tag} rank {r}: d{k}", baseline=base)


# ------------------------------------------------------------------------------ forward
FORWARD = [
    # W, tokens, H, F, E, K, act, bias, routing
    (1, (2048,), 1024, 1408, 8, 2, "swiglu", False, "uniform"),
    (1, (777,), 512, 1000, 16, 4, "gelu", True, "zipf"),
    (2, (1024, 300), 512, 1000, 16, 4, "swiglu", True, "drop"),
    (2, (0, 1536), 768, 256, 8, 1, "relu", False, "hot"),
    (4, (512, 0, 777, 256), 768, 256, 8, 2, "silu", True, "zipf"),
    (4, (640, 640, 640, 640), 1024, 1408, 16, 3, "gelu", False, "hot"),
]


@pytest.mark.parametrize("spec", FORWARD, ids=lambda s: f"W{s[0]}-{s[6]}-{s[8]}")
def test_forward_sequential(spec):
    prob = make_problem(*spec)
    device = torch.device("cuda", torch.cuda.current_device())

    def fn(world):
        r = world.rank
        lv = leaves_of(prob, r, world.device)
        ids = prob["ranks"][r]["ids"].to(world.device)
        y = call(lv, ids, world, prob["act"])
        y2 = call(lv, ids, world, prob["act"])
        world.check()
        assert torch.equal(y, y2), f"rank {r}: a repeated call differs bitwise"
        return y

    got = spawn(prob["W"], fn, device="cuda", timeout=300)
    check(prob, got, device, tag=str(spec))


def test_static_sizing_equals_exact_sizing():
    prob = make_problem(2, (900, 333), 512, 1000, 8, 2, "swiglu", True, "zipf")

    def fn(world):
        r = world.rank
        lv = leaves_of(prob, r, world.device)
        ids = prob["ranks"][r]["ids"].to(world.device)
        exact = call(lv, ids, world, prob["act"])
        static = call(lv, ids, world, prob["act"], max_tokens_per_rank=1024)
        world.check()
        return exact, static

    got = spawn(2, fn, device="cuda", timeout=300)
    for r, (exact, static) in enumerate(got):
        assert torch.equal(exact, static), f"rank {r}: static sizing differs from exact"
    check(prob, [s for _, s in got], torch.device("cuda", torch.cuda.current_device()))


# ------------------------------------------------------------------------------ backward
BACKWARD = [
    (1, (1024,), 512, 1000, 8, 2, "swiglu", True, "zipf"),
    (1, (333,), 768, 256, 4, 1, "gelu", False, "drop"),
    (2, (700, 0), 512, 1000, 8, 2, "swiglu", True, "hot"),
    (2, (256, 512), 1024, 1408, 16, 4, "relu", False, "uniform"),
    (4, (300, 128, 0, 512), 512, 256, 8, 2, "silu", True, "drop"),
]


@pytest.mark.parametrize(
    "spec",
    [pytest.param(s, marks=pytest.mark.concurrent) if s[0] > 1 else s for s in BACKWARD],
    ids=lambda s: f"W{s[0]}-{s[6]}-{s[8]}",
)
def test_forward_backward(spec):
    prob = make_problem(*spec)
    W = prob["W"]
    device = torch.device("cuda", torch.cuda.current_device())

    def fn(world):
        r = world.rank
        lv = leaves_of(prob, r, world.device, requires_grad=True)
        d = prob["ranks"][r]
        y = call(lv, d["ids"].to(world.device), world, prob["act"])
        (y * d["gy"].to(world.device)).sum().backward()
        world.check()
        return y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()}

    if W == 1:
        got = [fn(local_world(device))]
    else:
        got = spawn(W, fn, device="cuda", mode="concurrent", timeout=300)
    check(prob, got, device, backward=True, tag=str(spec))


@pytest.mark.parametrize("cfg", ["128,256,64,8,3,8,2", "128,256,64,8,3,8,4", "128,256,64,8,3,8,8"])
@pytest.mark.parametrize("spec", [BACKWARD[0], BACKWARD[2]], ids=lambda s: f"W{s[0]}-{s[6]}")
def test_forward_backward_sliced_epilogue(spec, cfg, monkeypatch):
    # The backward's dispatch GEMM at 128x256 with its epilogue in column slices, in bf16 (F
    # 1000: the last 256-wide tile is ragged, its last slices fully masked). The Triton kernel:
    # the warp-specialized one would take the one-rank case.
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", cfg)
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", "0")
    test_forward_backward(spec)


@pytest.mark.parametrize(
    "cfg", ["128,256,64,8,3,8,4", "128,256,64,8,3,8,2", "128,256,64,8,3,8,8", "128,128,64,8,4,8"]
)
@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_forward_backward_weights_grad_from_epilogue(act, cfg, monkeypatch):
    # One rank, no bias: d topk_weights from the dispatch GEMM's epilogue partials (forced on:
    # F 1000 > H 512 here), every epilogue slicing, with a few zero weights (the o-row path).
    # The Triton kernel's slicings: the warp-specialized one has tests of its own below.
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", cfg)
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", "0")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", "1")
    spec = (1, (1024,), 512, 1000, 8, 2, act, False, "zipf")
    prob = make_problem(*spec)
    prob["ranks"][0]["wts"].view(-1)[::17] = 0.0
    device = torch.device("cuda", torch.cuda.current_device())

    def fn(world):
        lv = leaves_of(prob, 0, world.device, requires_grad=True)
        d = prob["ranks"][0]
        y = call(lv, d["ids"].to(world.device), world, prob["act"])
        (y * d["gy"].to(world.device)).sum().backward()
        return y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()}

    check(prob, [fn(local_world(device))], device, backward=True, tag=f"{act} {cfg}")


# The backward's dispatch GEMM in the warp-specialized Gluon kernel (kernels/moe_ws.py):
# one rank, SwiGLU, Hopper. Ragged column tiles (F 1000 / 1408 / 200 at BN 256), K not a multiple
# of BK (H 200), an expert with no tokens, every token on one expert, top-k 1 and 8, dropped
# assignments, the weights' gradient from its epilogue partials and without them.
DACT_WS = [
    # tokens, H, F, E, K, routing, DW epilogue
    (1024, 512, 1000, 8, 2, "zipf", "1"),
    (2048, 1024, 1408, 8, 2, "uniform", "0"),
    (777, 200, 200, 16, 8, "drop", "1"),
    (300, 256, 512, 4, 1, "hot", "1"),
    (513, 384, 256, 8, 4, "one", "1"),
    (640, 512, 768, 8, 3, "empty", "0"),
    (200, 64, 96, 4, 2, "uniform", "1"),  # one K step (H = BK): every step starts a tile
]
DACT_WS_CONFIGS = [None, "128,64,4,8,152", "256,64,2,16,128"]


def _spy(monkeypatch, name):
    calls = []
    real = getattr(fused, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(fused, name, spy)
    return calls


def _ws_problem(spec):
    T, H, F, E, K, routing, _ = spec
    prob = make_problem(1, (T,), H, F, E, K, "swiglu", False,
                        "uniform" if routing in ("one", "empty") else routing)  # fmt: skip
    ids = prob["ranks"][0]["ids"]
    if routing == "one":  # every assignment on expert 2 (top-1 duplicates are fine: K slots)
        ids[:, 0] = 2
    elif routing == "empty":  # experts 0 and 5 get nothing
        ids[ids == 0] = 1
        ids[ids == 5] = 6
    prob["ranks"][0]["wts"].view(-1)[::13] = 0.0
    return prob


def _check_ws_fwd_bwd(spec, launcher, tag, monkeypatch, n_calls=None):
    """Forward+backward of ``_ws_problem(spec)`` at one rank against the float64 reference;
    ``launcher`` (a ``fused`` function) must have run (``n_calls`` times, where given)."""
    prob = _ws_problem(spec)
    device = torch.device("cuda", torch.cuda.current_device())
    calls = _spy(monkeypatch, launcher)
    lv = leaves_of(prob, 0, device, requires_grad=True)
    d = prob["ranks"][0]
    y = call(lv, d["ids"].to(device), local_world(device), "swiglu")
    (y * d["gy"].to(device)).sum().backward()
    assert calls, f"{launcher} did not run"
    assert n_calls is None or len(calls) == n_calls, (launcher, len(calls))
    got = [(y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()})]
    check(prob, got, device, backward=True, tag=tag)


@pytest.mark.parametrize("cfg", DACT_WS_CONFIGS, ids=lambda c: c or "default")
@pytest.mark.parametrize("spec", DACT_WS, ids=lambda s: f"T{s[0]}-F{s[2]}-K{s[4]}-{s[5]}")
def test_forward_backward_dact_warp_specialized(spec, cfg, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", spec[6])
    if cfg:
        monkeypatch.setenv("MOE_OVERLAP_DACT_WS_CONFIG", cfg)
    _check_ws_fwd_bwd(spec, "_launch_dact_ws", f"dact ws {spec} {cfg}", monkeypatch)


# Layer 0's SwiGLU forward in the same Gluon kernel (its forward mode): the same problems, in
# training (rows gathered for the wgrad, gate/up saved; the backward's Gluon kernel too, or the
# Triton one) and in inference (rows staged into the workspace).
L0_WS_CONFIGS = [None, "128,64,4,8,152", "256,64,2,16,128"]


@pytest.mark.parametrize(
    "cfg, dact_ws",
    [(c, "1") for c in L0_WS_CONFIGS] + [(None, "0")],  # the Triton backward: one config
    ids=lambda v: v or "default",
)
@pytest.mark.parametrize("spec", DACT_WS, ids=lambda s: f"T{s[0]}-F{s[2]}-K{s[4]}-{s[5]}")
def test_forward_backward_layer0_warp_specialized(spec, cfg, dact_ws, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", spec[6])
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", dact_ws)
    if cfg:
        monkeypatch.setenv("MOE_OVERLAP_L0_WS_CONFIG", cfg)
    _check_ws_fwd_bwd(spec, "_launch_l0_ws", f"l0 ws {spec} {cfg} dact ws {dact_ws}", monkeypatch)


@pytest.mark.parametrize("spec", DACT_WS, ids=lambda s: f"T{s[0]}-F{s[2]}-K{s[4]}-{s[5]}")
def test_inference_layer0_warp_specialized(spec, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.delenv("MOE_OVERLAP_L0_STAGE", raising=False)  # the default: rows staged
    prob = _ws_problem(spec)
    device = torch.device("cuda", torch.cuda.current_device())
    calls = _spy(monkeypatch, "_launch_l0_ws")
    lv = leaves_of(prob, 0, device)
    with torch.no_grad():
        y = call(lv, prob["ranks"][0]["ids"].to(device), local_world(device), "swiglu")
    assert calls, "the warp-specialized forward did not run"
    check(prob, [y], device, tag=f"l0 ws inference {spec}")


# The weight gradients from kernels/moe_wgrad.py (MOE_OVERLAP_WGRAD=kernel: each expert's
# contraction stopped at its real rows), one program an SM and one a tile with a config that
# fits twice; and from the Gluon kernel's WGRAD mode (ws) at two configs. Not yet the default.
WGRAD_CONFIGS = [
    ("kernel", None, "persistent"),
    ("kernel", "128,128,64,8,2", "tiles"),
    ("ws", None, "persistent"),
    ("ws", "128,64,4,8,152", "persistent"),
]


@pytest.mark.parametrize("env, cfg, grid", WGRAD_CONFIGS, ids=lambda v: v or "default")
@pytest.mark.parametrize("spec", DACT_WS, ids=lambda s: f"T{s[0]}-F{s[2]}-K{s[4]}-{s[5]}")
def test_forward_backward_wgrad_kernel(spec, env, cfg, grid, monkeypatch):
    if env == "ws" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", env)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD_GRID", grid)
    if cfg:
        var = "MOE_OVERLAP_WGRAD_WS_CONFIG" if env == "ws" else "MOE_OVERLAP_WGRAD_CONFIG"
        monkeypatch.setenv(var, cfg)
    calls = []
    if env == "ws":
        calls = _spy(monkeypatch, "_launch_wgrad_ws")
    else:
        real = fused.moe_wgrad.grouped_wgrad
        monkeypatch.setattr(
            fused.moe_wgrad, "grouped_wgrad", lambda *a: calls.append(1) or real(*a)
        )
    _check_ws_fwd_bwd(spec, "_grouped_wgrad", f"wgrad {env} {spec} {cfg} {grid}", monkeypatch)
    assert len(calls) == 2, "the wgrad kernel did not take both weight gradients"


@pytest.mark.parametrize(
    "env, cfg",
    [("kernel", None), ("kernel", "128,128,64,8,2"), ("ws", None)],
    ids=lambda v: v or "default",
)
def test_wgrad_kernel_equals_grouped_mm(env, cfg, monkeypatch):
    # Same padded rows through grouped_mm (whole padded ranges) and the kernel (real rows):
    # equal to bf16 rounding; the output starts as NaN (poisoned allocator block). (Experts
    # without rows: test_forward_backward_wgrad_kernel's "empty" problem.)
    from sweep_bwd import problem  # tests/gpu is on sys.path (pytest prepends it)

    if env == "ws" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    if cfg:
        monkeypatch.setenv("MOE_OVERLAP_WGRAD_CONFIG", cfg)
    p = problem("deepseek-v3", shape=(1024, 1024, 512, 32, 8))
    a, b = p.g_rows, p.gu
    want = fused._grouped_wgrad(a, b, p.layout, BF16, p.world)
    monkeypatch.setenv("MOE_OVERLAP_WGRAD", env)
    assert fused._wgrad_kernel_usable(a, b, p.layout, BF16, fused.wgrad_config())
    assert fused._wgrad_ws_usable(a, b, p.layout, p.world) == (env == "ws")
    poison = torch.full_like(want, float("nan"))
    del poison
    got = fused._grouped_wgrad(a, b, p.layout, BF16, p.world)
    assert not torch.isnan(got).any()
    assert_close(got, want, dtype=BF16, name="wgrad")


# Layer 1's GEMMs in the same Gluon kernel (its rows mode): the forward (h @ w2^T, K-major
# weight tiles) and the backward's combine (d gu @ w1), rows stored at their slots; with the
# other Gluon kernels on (the default) and off.
L1_WS_CONFIGS = [None, "128,64,4,8,152", "64,64,4,8,128"]
# + one K step in both of layer 1's GEMMs (F 32, 2F 64): the carried position wraps every step
L1_WS = DACT_WS + [(200, 64, 32, 4, 2, "uniform", "1")]


@pytest.mark.parametrize(
    "cfg, others",
    [(c, "1") for c in L1_WS_CONFIGS] + [(None, "0")],
    ids=lambda v: v or "default",
)
@pytest.mark.parametrize("spec", L1_WS, ids=lambda s: f"T{s[0]}-F{s[2]}-K{s[4]}-{s[5]}")
def test_forward_backward_layer1_warp_specialized(spec, cfg, others, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", spec[6])
    monkeypatch.setenv("MOE_OVERLAP_L0_WS", others)
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", others)
    if cfg:
        monkeypatch.setenv("MOE_OVERLAP_L1_WS_CONFIG", cfg)
    tag = f"l1 ws {spec} {cfg} others {others}"
    _check_ws_fwd_bwd(spec, "_launch_l1_ws", tag, monkeypatch, n_calls=2)


@pytest.mark.parametrize("carry", ["0", "1"])
def test_ws_kernels_either_load_path(carry, monkeypatch):
    # MOE_OVERLAP_WS_CARRY switches every Gluon kernel's load-position path (A/B knob): both
    # paths give the reference, through all three kernels in one step
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_WS_CARRY", carry)
    for spec in (DACT_WS[2], L1_WS[-1]):
        _check_ws_fwd_bwd(spec, "_launch_l1_ws", f"carry {carry} {spec}", monkeypatch, 2)


# MOE_OVERLAP_WS_SPLIT=1: the row GEMMs' two MMA warp groups as two partitions, the second
# skipping a tile whose last 64 rows are all padding. The same wgmmas on the same tiles, so
# bitwise equal to the unsplit kernels, through all three row kernels of a forward+backward, and
# the reference; at 256 rows an expert (deepseek-v3's, where about half the experts end in their
# last tile's first 64 rows), one hot expert, empty experts, one K step.
SPLIT_WS = [
    (2048, 512, 384, 64, 8, "uniform", "1"),
    (513, 384, 256, 8, 4, "one", "1"),
    (640, 512, 768, 8, 3, "empty", "0"),
    (200, 64, 96, 4, 2, "uniform", "1"),
]


@pytest.mark.parametrize("spec", SPLIT_WS, ids=lambda s: f"T{s[0]}-E{s[3]}-K{s[4]}-{s[5]}")
def test_ws_split_equals_unsplit(spec, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    monkeypatch.setenv("MOE_OVERLAP_DW_EPILOGUE", spec[6])
    prob = _ws_problem(spec)
    device = torch.device("cuda", torch.cuda.current_device())
    d = prob["ranks"][0]
    ids = d["ids"].to(device)
    counts = torch.bincount(ids.flatten().clamp_min(0), minlength=spec[3])
    if spec[0] == 2048:  # the case this switch exists for: last tiles half empty
        tail = counts % 128
        assert ((tail > 0) & (tail <= 64)).sum() >= 8, counts.tolist()
    names = ("_launch_l0_ws", "_launch_dact_ws", "_launch_l1_ws")
    calls = {n: _spy(monkeypatch, n) for n in names}
    got = {}
    for split in ("0", "1"):
        monkeypatch.setenv("MOE_OVERLAP_WS_SPLIT", split)
        for c in calls.values():
            c.clear()
        lv = leaves_of(prob, 0, device, requires_grad=True)
        y = call(lv, ids, local_world(device), "swiglu")
        (y * d["gy"].to(device)).sum().backward()
        assert all(calls.values()), {n: len(c) for n, c in calls.items()}
        got[split] = (y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()})
    (y0, g0), (y1, g1) = got["0"], got["1"]
    assert torch.equal(y0, y1), (y0 - y1).abs().max()
    for k, v in g0.items():
        assert (v is None) == (g1[k] is None), k
        assert v is None or torch.equal(v, g1[k]), (k, (v - g1[k]).abs().max())
    check(prob, [got["1"]], device, backward=True, tag=f"ws split {spec}")


@pytest.mark.parametrize("which", ["forward", "combine"])
def test_layer1_warp_specialized_equals_triton_kernel(which, monkeypatch):
    # Same inputs through both layer-1 GEMMs (then the same reduction): the rows stored at their
    # slots equal to bf16 rounding, slots no row names left untouched, y likewise.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    from sweep_bwd import problem  # tests/gpu is on sys.path (pytest prepends it)

    p = problem("olmoe", shape=(2048, 1024, 768, 16, 8))
    row_slot = fused._row_slots(p.layout, p.ws.slot)
    if which == "forward":
        h, _ = fused._fwd_layer0(p.x, p.layout, p.w1, p.world, "swiglu", None, p.ws)
        a, w, k_dim, swn, swk = h, p.w2, p.F, p.w2.stride(1), p.w2.stride(2)
        wflat = p.wflat
    else:
        a, w, k_dim, swn, swk = p.gu, p.w1, 2 * p.F, p.w1.stride(2), p.w1.stride(1)
        wflat = None
    assert fused._l1_ws_usable(a, w, p.layout, p.world, None, None, k_dim, p.H, swk) is (
        which == "forward"
    )

    def run():
        return fused._launch_layer1(a, p.layout, w, p.world, None, wflat, row_slot, p.ws,
                                    k_dim=k_dim, n_out=p.H, stride_wn=swn, stride_wk=swk,
                                    save_o=True)  # fmt: skip

    monkeypatch.setenv("MOE_OVERLAP_L1_WS", "0")
    ref_y, ref_o = run()
    monkeypatch.delenv("MOE_OVERLAP_L1_WS")
    calls = _spy(monkeypatch, "_launch_l1_ws")
    # poison: the caching allocator hands this NaN block back as the GEMM's row buffer, so a
    # kept slot the kernel leaves unwritten shows up in y
    poison = torch.full_like(ref_o, float("nan"))
    del poison
    got_y, got_o = run()
    assert calls
    kept = p.layout.slot_of.view(-1)
    kept = kept[kept >= 0].long()
    assert kept.numel() > 0
    assert_close(got_o[kept], ref_o[kept], dtype=BF16, name=f"{which} rows")
    assert_close(got_y, ref_y, dtype=BF16, name=f"{which} y")
    assert not torch.isnan(got_y).any()


def test_layer1_misaligned_rows_take_the_triton_kernel():
    # TMA needs 16-byte aligned rows: a contiguous but misaligned h must fall back to the Triton
    # kernel (not fail in the descriptor) and give the same y
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    from sweep_bwd import problem  # tests/gpu is on sys.path (pytest prepends it)

    p = problem("olmoe", shape=(512, 256, 128, 8, 2))
    h, _ = fused._fwd_layer0(p.x, p.layout, p.w1, p.world, "swiglu", None, p.ws)
    buf = torch.empty(h.numel() + 8, dtype=h.dtype, device=h.device)
    hm = buf[1 : 1 + h.numel()].view_as(h)
    hm.copy_(h)
    assert hm.is_contiguous() and hm.data_ptr() % 16
    args = (p.layout, p.world, None, None, p.F, p.H, p.w2.stride(2))
    assert fused._l1_ws_usable(h, p.w2, *args) is True
    assert fused._l1_ws_usable(hm, p.w2, *args) is None
    wts = p.wflat.view(p.T, p.K)
    y = fused.layer1(h, p.layout, wts, p.w2, p.world)
    assert_close(fused.layer1(hm, p.layout, wts, p.w2, p.world), y, dtype=BF16, name="y")


@pytest.mark.parametrize("save_gu", [False, True])
def test_layer0_warp_specialized_equals_triton_kernel(save_gu, monkeypatch):
    # Same inputs through both forward kernels: h and the saved gate/up equal to bf16 rounding
    # (the Gluon kernel computes h from gate/up rounded to bf16, as the unfused pipeline does;
    # the Triton one from fp32), padding rows zero, every tile row written.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    from sweep_bwd import problem  # tests/gpu is on sys.path (pytest prepends it)

    p = problem("olmoe", shape=(2048, 1024, 768, 16, 8))
    x = torch.randn(p.T, p.H, device="cuda").to(BF16)
    w1 = (torch.randn(p.w2.shape[0], 2 * p.F, p.H, device="cuda") * p.H**-0.5).to(BF16)

    def run():
        return fused._fwd_layer0(x, p.layout, w1, p.world, "swiglu", None, p.ws, save_gu=save_gu)

    monkeypatch.setenv("MOE_OVERLAP_L0_WS", "0")
    ref_h, ref_gu = run()
    monkeypatch.delenv("MOE_OVERLAP_L0_WS")
    monkeypatch.setenv("MOE_OVERLAP_L0_STAGE", "1")  # inference at 2F < 2048: staging forced
    assert fused._l0_ws_usable(x, w1, p.layout, p.world, "swiglu", None, None)
    calls = _spy(monkeypatch, "_launch_l0_ws")
    # poison: the caching allocator hands these NaN blocks back as the kernel's outputs, so a
    # row the kernel leaves unwritten (padding included) shows up
    poison = [torch.full_like(ref_h, float("nan"))]
    if save_gu:
        poison.append(torch.full_like(ref_gu, float("nan")))
    del poison
    got_h, got_gu = run()
    assert calls
    n_rows = int(p.layout.n_tiles.item()) * p.layout.block_m
    tok = p.layout.row_tok[:n_rows]
    assert_close(got_h[:n_rows][tok >= 0], ref_h[:n_rows][tok >= 0], dtype=BF16, name="h")
    assert torch.all(got_h[:n_rows][tok < 0] == 0), "padding rows of h must be zeros"
    if save_gu:
        assert_close(got_gu[:n_rows][tok >= 0], ref_gu[:n_rows][tok >= 0], dtype=BF16, name="gu")
        assert torch.all(got_gu[:n_rows][tok < 0] == 0), "padding rows of gu must be zeros"
    else:
        assert got_gu is None and ref_gu is None


def test_dact_warp_specialized_equals_triton_kernel(monkeypatch):
    # Same inputs through both kernels: d gu equal to bf16 rounding (the Gluon kernel rounds d h
    # to bf16 before the derivative, the Triton one keeps it in fp32), the same padding zeros.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA: Hopper only")
    from sweep_bwd import problem  # tests/gpu is on sys.path (pytest prepends it)

    p = problem("olmoe", shape=(2048, 1024, 768, 16, 8))

    def run():
        dw_slot = fused._dw_slot(p.layout, p.world, None, p.dy, p.F)
        return fused._bwd_dispatch(p.dy, p.layout, p.w2, p.world, p.wflat, p.row_scale, p.ws,
                                   p.gu, "swiglu", a_rows=p.g_rows, dw_slot=dw_slot)  # fmt: skip

    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", "0")
    ref_gu, ref_part = run()
    monkeypatch.setenv("MOE_OVERLAP_DACT_WS", "1")
    assert fused._dact_ws_usable(p.g_rows, p.w2, p.gu, p.layout, p.world, "swiglu")
    # poison: the caching allocator hands this NaN block back as the kernel's d gu, so a row
    # the kernel leaves unwritten (padding included) shows up
    poison = torch.full_like(ref_gu, float("nan"))
    del poison
    got_gu, got_part = run()
    n_rows = int(p.layout.n_tiles.item()) * p.layout.block_m
    tok = p.layout.row_tok[:n_rows]
    assert_close(got_gu[:n_rows][tok >= 0], ref_gu[:n_rows][tok >= 0], dtype=BF16, name="d gu")
    assert torch.all(got_gu[:n_rows][tok < 0] == 0), "padding rows of d gu must be zeros"
    slots = p.layout.row_slot[:n_rows][tok >= 0].long()
    assert ref_part is not None and got_part is not None  # F 768 < H 1024: the partials path
    assert_close(got_part[slots].sum(1), ref_part[slots].sum(1), dtype=BF16, name="dw sums")


@pytest.mark.parametrize("epi", [2, 4])
@pytest.mark.parametrize("spec", [BACKWARD[0], BACKWARD[2]], ids=lambda s: f"W{s[0]}-{s[6]}")
def test_forward_backward_sliced_swiglu_forward_epilogue(spec, epi, monkeypatch):
    # The training forward's SwiGLU epilogue (saved gate/up, h) in column slices.
    monkeypatch.setenv("MOE_OVERLAP_L0_CONFIG", f"128,128,64,8,3,16,{epi}")
    monkeypatch.setenv("MOE_OVERLAP_L0_WS", "0")
    monkeypatch.setenv("MOE_OVERLAP_L0B_CONFIG", "128,256,64,8,3,8,4")
    test_forward_backward(spec)


# ------------------------------------------------------------------------------ delayed producers
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("where", ["op", "layer0", "layer1"])
def test_concurrent_with_a_delayed_rank(W, where):
    # One rank's stream sleeps before the op (static sizing: no host sync, the delay reaches the
    # count exchange and the dispatch waits), before layer 0, or before layer 1; every rank's
    # data must still be right.
    prob = make_problem(
        W, (512, 300, 0, 700)[:W], 512, 1000, 2 * W, 2, "swiglu", True, "uniform", seed=7
    )
    slow = W - 1

    def fn(world):
        r = world.rank
        lv = leaves_of(prob, r, world.device)
        ids = prob["ranks"][r]["ids"].to(world.device)
        act = prob["act"]
        if where == "op":
            if r == slow:
                torch.cuda._sleep(SLEEP_CYCLES)
            y = call(lv, ids, world, act, max_tokens_per_rank=1024)
        else:
            layout = fused.dispatch_layout(ids, prob["E"], world)
            if r == slow and where == "layer0":
                torch.cuda._sleep(SLEEP_CYCLES)
            h = fused.layer0(lv["x"], layout, lv["w1"], world, act, b1=lv["b1"])
            if r == slow and where == "layer1":
                torch.cuda._sleep(SLEEP_CYCLES)
            y = fused.layer1(h, layout, lv["topk_weights"], lv["w2"], world, b2=lv["b2"])
        world.check()
        return y

    got = spawn(W, fn, device="cuda", mode="concurrent", timeout=300)
    check(prob, got, torch.device("cuda", torch.cuda.current_device()), tag=f"{where} W{W}")


def test_concurrent_delayed_rank_backward():
    # The backward's dispatch and combine wait too: delay the slow rank right before backward.
    prob = make_problem(2, (400, 600), 512, 1000, 4, 2, "gelu", True, "zipf", seed=9)

    def fn(world):
        r = world.rank
        lv = leaves_of(prob, r, world.device, requires_grad=True)
        d = prob["ranks"][r]
        y = call(lv, d["ids"].to(world.device), world, prob["act"])
        if r == 1:
            torch.cuda._sleep(SLEEP_CYCLES)
        (y * d["gy"].to(world.device)).sum().backward()
        world.check()
        return y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()}

    got = spawn(2, fn, device="cuda", mode="concurrent", timeout=300)
    check(prob, got, torch.device("cuda", torch.cuda.current_device()), backward=True)


# ------------------------------------------------------------------------------ put transport
@pytest.mark.concurrent
@pytest.mark.parametrize("W,per_node", [(2, 1), (4, 2)])
def test_put_transport_equals_store_transport(W, per_node):
    """Emulated ranks on virtual nodes: rows to other nodes take the put path (compiled, with the
    emulated copy in place of the NVSHMEM call; kernels/put.py), forward and backward, one rank
    delayed. Values must be bitwise those of the all-store run, and right."""
    from moe_overlap.world.topology import Topology

    prob = make_problem(
        W, (512, 300, 0, 700)[:W], 512, 1000, 2 * W, 2, "swiglu", True, "zipf", seed=11
    )

    def run(multi_node):
        def fn(world):
            r = world.rank
            if multi_node:
                world.set_topology(Topology.from_local_world_size(W, per_node))
                assert world.has_puts
            lv = leaves_of(prob, r, world.device, requires_grad=True)
            d = prob["ranks"][r]
            if r == W - 1:
                torch.cuda._sleep(SLEEP_CYCLES)
            y = call(lv, d["ids"].to(world.device), world, prob["act"])
            if r == 0:
                torch.cuda._sleep(SLEEP_CYCLES)
            (y * d["gy"].to(world.device)).sum().backward()
            world.check()
            return y.detach(), {k: (None if v is None else v.grad) for k, v in lv.items()}

        return spawn(W, fn, device="cuda", mode="concurrent", timeout=300)

    puts, stores = run(True), run(False)
    for r in range(W):
        assert torch.equal(puts[r][0], stores[r][0]), f"rank {r}: y differs between transports"
        for k, g in puts[r][1].items():
            if g is not None:
                assert torch.equal(g, stores[r][1][k]), f"rank {r}: d{k} differs"
    check(prob, puts, torch.device("cuda", torch.cuda.current_device()), backward=True)


# ------------------------------------------------------------------------------ bias gradients
def test_expert_sum_is_deterministic_and_right():
    """The bias gradients' per-expert row sum is bitwise the same on every run (index_add_'s
    atomics gave a put-transport backward a db1 one bf16 ulp off the store run's on the H100,
    2026-12-05) and matches float64, on a layout with a hot and an empty expert."""
    from moe_overlap.dispatch.layout import build_layout

    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(3)
    ids = torch.randint(0, 8, (4096, 2), device=device, generator=g)
    ids[:1000, 0] = 5  # hot expert
    ids[ids == 2] = 3  # empty expert
    lay = build_layout(ids, 8, local_world(device), 128)
    real = lay.row_tok >= -1
    rows = torch.randn(lay.rows_cap, 2000, device=device, generator=g, dtype=torch.bfloat16)
    rows = torch.where(real[:, None], rows, torch.zeros_like(rows))
    runs = [fused._expert_sum(rows, lay) for _ in range(5)]
    for r in runs[1:]:
        assert torch.equal(r, runs[0])
    want = torch.zeros(8, 2000, dtype=torch.float64, device=device)
    want.index_add_(0, lay.row_local_expert.long()[real], rows[real].double())
    assert (runs[0].double() - want).abs().max().item() < 1e-3
    assert not runs[0][2].any()


# ------------------------------------------------------------------------------ CUDA graphs
# without a bias and at 2F >= 2048, the Gluon forward (kernels/moe_ws.py, on Hopper) on
# rows staged into the workspace is what the graph captures
@pytest.mark.parametrize("bias, F", [(True, 1000), (False, 1024)], ids=["bias", "no-bias"])
def test_cuda_graph_capture_replays_with_new_inputs(bias, F, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    world = local_world(device)
    ws_calls = _spy(monkeypatch, "_launch_l0_ws")
    T, H, E, K, act = 512, 512, 8, 2, "swiglu"
    probs = [make_problem(1, (T,), H, F, E, K, act, bias, "zipf", seed=s) for s in range(3)]
    for p in probs[1:]:
        p["glob"] = probs[0]["glob"]  # one set of expert weights, captured by the graph
    lv = leaves_of(probs[0], 0, device)  # weights stay fixed; x, ids, weights are replaced
    static_x = lv["x"].clone()
    static_ids = probs[0]["ranks"][0]["ids"].to(device)
    static_w = lv["topk_weights"].clone()

    def step():
        return mo.fused_experts(
            static_x,
            static_ids,
            static_w,
            lv["w1"],
            lv["w2"],
            world,
            activation=act,
            b1=lv["b1"],
            b2=lv["b2"],
            max_tokens_per_rank=T,
        )

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: compiles, grows the workspace and signal pad
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    for p in probs[1:] + probs[:1]:
        d = p["ranks"][0]
        static_x.copy_(d["x"])
        static_ids.copy_(d["ids"])
        static_w.copy_(d["wts"])
        graph.replay()
        torch.cuda.synchronize(device)
        eager = mo.fused_experts(
            d["x"].to(device),
            d["ids"].to(device),
            d["wts"].to(device),
            lv["w1"],
            lv["w2"],
            world,
            activation=act,
            b1=lv["b1"],
            b2=lv["b2"],
            max_tokens_per_rank=T,
        )
        world.check()
        assert torch.equal(static_y, eager), "graph replay differs from eager"
        ys, _, _ = reference(p, device)
        assert_close(static_y, ys[0], dtype=BF16, name="graph replay y")
    from moe_overlap.kernels.moe_ws import HAVE_GLUON

    hopper = torch.cuda.get_device_capability(device)[0] == 9
    want = hopper and HAVE_GLUON and not bias
    assert bool(ws_calls) == want, "the Gluon forward's use is not as expected"
