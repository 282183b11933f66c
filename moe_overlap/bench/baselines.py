"""Baselines the benchmark measures in the same run as the fused ops.

Each ``build_*`` function takes one rank's :class:`MoEProblem` (or :class:`DenseProblem`) and its
world and returns a :class:`Case`: ``step(i)`` runs the baseline on input set ``i`` (sets rotate
so the L2 cache does not hold the inputs between calls) and returns its output; ``canon`` maps
that output to the canonical form every case of the same op shares (for the correctness
cross-checks, outside the timed region). A builder that cannot run here raises
:class:`Unavailable` with the reason; the harness reports it and goes on.

What each baseline is (all eager, no ``torch.compile``):

* ``grouped_mm`` (role ``floor``): ``torch._grouped_mm`` alone on the same GEMMs, rows already
  sorted by expert; no permute, activation or scatter. The GEMM floor the fused ops are held
  to. Not the same function as the others, so it is never a correctness reference.
* ``unfused``: index permute (``index_select``) + ``torch._grouped_mm`` + activation (layer 0);
  ``torch._grouped_mm`` + weighted ``index_add_`` (layer 1); both plus the router (``moe``).
* ``torchtitan``: TorchTitan-style eager MoE: router in fp32 -> softmax/sigmoid -> top-k ->
  renormalize; stable argsort by expert; groups padded to 16 rows (pad rows read a zero row
  appended to x); gather; ``_grouped_mm`` gate_up -> activation -> ``_grouped_mm`` down ->
  weighted ``index_add_``; with ``world.all_to_all`` of the rows (and one host sync for the
  split sizes, as TorchTitan's all_to_all_single needs) when the world has several ranks.
* ``loop``: the HF-Mixtral-style per-expert loop (for ``moe`` it also finds each expert's rows
  with ``torch.where`` inside the timed region, one host sync per expert as HF does, and one
  weight pair per expert as HF's ``ModuleList`` has, so its backward writes each weight
  gradient once; the ``layer0``/``layer1`` versions take the group bounds from the host).
* ``mo_baseline``: this library's own plain path, ``moe_overlap.dispatch.baseline``.
* ``deepspeed``: ``deepspeed.moe.layer.MoE`` (eval mode, dropless, no noisy gate) when
  deepspeed imports; several ranks under torchrun (one process each), one rank with or without.
* dense TP: ``mm`` (floor: the whole GEMM on one rank's operands), ``nccl`` (all_gather + mm,
  mm + reduce_scatter; needs torch.distributed), ``symm_mem``
  (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``).
* ``a2a`` / ``all_gather`` / ``reduce_scatter`` (role ``comm``): the communication alone, for
  the share of communication hidden (several real ranks only).

``torch._grouped_mm`` rules differ between versions and devices (16-byte row strides
everywhere; some versions want each group's row count aligned in backward, where the rows
become the reduction dimension of the weight gradient). :func:`grouped_mm_mode` probes the
device once on a small case against a per-expert loop and picks ``native`` (any offsets),
``padded`` (groups padded to 16 rows) or ``loop`` (one matmul per expert; CPU without grouped_mm,
odd strides). Padded rows read zeros and are never counted as FLOPs.

Emulated worlds with several ranks on one GPU cannot run a backward that calls host
collectives (autograd runs every rank's backward on one device thread, see
``moe_overlap.world.emulated``): those cases are unavailable there; run them under torchrun.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as Fn

from .presets import DenseShape, MoEShape

ALIGN_M = 16  # TorchTitan's group padding (rows)

__all__ = [
    "Unavailable",
    "Case",
    "InputSet",
    "MoEProblem",
    "DenseProblem",
    "make_moe_problem",
    "make_dense_problem",
    "torch_route",
    "sort_by_expert",
    "grouped_mm",
    "grouped_mm_mode",
    "activation_fn",
    "MOE_BASELINES",
    "DENSE_BASELINES",
    "build_baseline",
]


class Unavailable(Exception):
    """This case cannot run here; ``str(e)`` says why."""


@dataclass
class Case:
    """One timed thing. ``step(i) -> output`` on input set ``i``; ``canon(output)`` -> tensor or
    tuple of tensors in the op's canonical form, or ``canon=None`` when the output is not the
    op's function (floors, communication alone). ``flops``: counted FLOPs of one call on this
    rank (0 when not meaningful)."""

    name: str
    role: str  # "floor" | "baseline" | "candidate" | "comm"
    step: Callable[[int], object]
    canon: Callable[[object], object] | None
    flops: float
    note: str = ""
    trace_step: Callable | None = None  # step(i, trace=buf) for candidates that record tiles


# ------------------------------------------------------------------------------- problems
@dataclass
class InputSet:
    x_TH: torch.Tensor
    topk_ids_TK: torch.Tensor  # int64 global ids
    topk_w_TK: torch.Tensor  # float32
    gy_TH: torch.Tensor | None = None  # upstream gradient for backward runs


@dataclass
class MoEProblem:
    """One rank's MoE inputs: local experts ``w1 [El, R1, H]``, ``w2 [El, H, F]``, the router
    weight ``wr [E, H]`` (same on every rank) and rotating input sets."""

    shape: MoEShape
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    wr_EH: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    sets: list[InputSet]
    backward: bool = False
    cache: dict = field(default_factory=dict)

    @property
    def local_experts(self) -> int:
        return self.shape.experts // self.world_size


@dataclass
class DenseProblem:
    """One rank's dense TP inputs. ``ag-matmul``: ``x_shard [M/W, K]``, ``weight [N/W, K]``;
    ``matmul-rs``: ``x [M, K/W]``, ``weight [N, K/W]``."""

    op: str
    shape: DenseShape
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    weight: torch.Tensor
    xs: list[torch.Tensor]


def _randn(shape, gen, device, dtype, scale=1.0):
    t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return (t * scale).to(dtype)


def torch_route(x_TH: torch.Tensor, wr_EH: torch.Tensor, k: int, score_func: str = "softmax"):
    """The eager router every baseline uses: fp32 logits -> softmax/sigmoid -> top-k ->
    renormalize. Returns ``(topk_ids int64 [T, K], topk_w float32 [T, K])``; differentiable to
    ``x`` and ``wr`` through the weights."""
    logits = x_TH.float() @ wr_EH.float().t()
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    w, ids = torch.topk(scores, k, dim=-1)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w


def _gen(device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def n_sets_for(bytes_per_set: int, l2_bytes: int = 60 << 20, cap: int = 4) -> int:
    """Input sets to rotate: enough that their bytes exceed twice the L2, at least 2."""
    return max(2, min(cap, math.ceil(2 * l2_bytes / max(bytes_per_set, 1))))


def make_moe_problem(
    shape: MoEShape,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    device,
    n_sets: int | None = None,
    backward: bool = False,
    seed: int = 0,
) -> MoEProblem:
    """Random inputs (never zeros): x ~ N(0, 1), weights scaled so every output is O(1).
    The routing of each set comes from the router on that set's x."""
    device = torch.device(device)
    s = shape
    if s.experts % world_size:
        raise ValueError(f"experts ({s.experts}) must be divisible by world size ({world_size})")
    El = s.experts // world_size
    g = _gen(device, seed * 7919 + 17)  # router: the same on every rank
    wr = _randn((s.experts, s.hidden), g, device, dtype, s.hidden**-0.5)
    g = _gen(device, seed * 7919 + 1000 + rank)
    w1 = _randn((El, s.w1_rows, s.hidden), g, device, dtype, s.hidden**-0.5)
    w2 = _randn((El, s.hidden, s.ffn), g, device, dtype, s.ffn**-0.5)
    esize = torch.empty((), dtype=dtype).element_size()
    if n_sets is None:
        n_sets = n_sets_for(s.tokens * s.hidden * esize)
    sets = []
    for i in range(n_sets):
        gi = _gen(device, seed * 7919 + 100000 + rank * 1000 + i)
        x = _randn((s.tokens, s.hidden), gi, device, dtype)
        with torch.no_grad():
            ids, w = torch_route(x, wr, s.topk, s.score_func)
        gy = _randn((s.tokens, s.hidden), gi, device, dtype) if backward else None
        sets.append(InputSet(x, ids, w, gy))
    return MoEProblem(s, rank, world_size, dtype, device, wr, w1, w2, sets, backward)


def make_dense_problem(
    op: str,
    shape: DenseShape,
    world_size: int,
    rank: int,
    dtype,
    device,
    n_sets: int | None = None,
    seed: int = 0,
) -> DenseProblem:
    device = torch.device(device)
    M, N, K, W = shape.m, shape.n, shape.k, world_size
    if op == "ag-matmul":
        if M % W or N % W:
            raise ValueError(f"ag-matmul needs M ({M}) and N ({N}) divisible by W ({W})")
        xshape, wshape = (M // W, K), (N // W, K)
    elif op == "matmul-rs":
        if M % W or K % W:
            raise ValueError(f"matmul-rs needs M ({M}) and K ({K}) divisible by W ({W})")
        xshape, wshape = (M, K // W), (N, K // W)
    else:
        raise ValueError(f"unknown dense op {op!r}")
    g = _gen(device, seed * 7919 + 2000 + rank)
    weight = _randn(wshape, g, device, dtype, wshape[1] ** -0.5)
    esize = torch.empty((), dtype=dtype).element_size()
    if n_sets is None:
        n_sets = n_sets_for(math.prod(xshape) * esize)
    xs = [_randn(xshape, g, device, dtype) for _ in range(n_sets)]
    return DenseProblem(op, shape, rank, world_size, dtype, device, weight, xs)


# ------------------------------------------------------------------------ grouped GEMM helpers
def activation_fn(h: torch.Tensor, activation: str) -> torch.Tensor:
    """SwiGLU on ``h [M, 2F]`` (gate columns first) or a plain activation on ``h [M, F]``."""
    if activation == "swiglu":
        f = h.shape[-1] // 2
        return Fn.silu(h[..., :f]) * h[..., f:]
    if activation == "gelu":
        return Fn.gelu(h)
    if activation == "relu":
        return torch.relu(h)
    if activation == "silu":
        return Fn.silu(h)
    raise ValueError(f"unknown activation {activation!r}")


def _loop_mm(a_MK, b_EKN, offs):
    ends = [int(v) for v in offs.tolist()]
    outs, start = [], 0
    b_e = b_EKN.unbind(0)  # not b_EKN[e]: see dispatch.baseline.grouped_linear
    for e, end in enumerate(ends):
        outs.append(a_MK[start:end] @ b_e[e])
        start = end
    if start < a_MK.shape[0]:  # rows past the last group (padding capacity): zeros
        outs.append(a_MK.new_zeros((a_MK.shape[0] - start, b_EKN.shape[-1])))
    return torch.cat(outs) if outs else a_MK.new_zeros((0, b_EKN.shape[-1]))


@functools.cache
def grouped_mm_mode(device_type: str, device_index, dtype: torch.dtype, backward: bool) -> str:
    """'native' (any offsets), 'padded' (groups padded to 16 rows) or 'loop' for this device."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    dev = (
        torch.device(device_type, device_index)
        if device_index is not None
        else torch.device(device_type)
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3

    def attempt(offs_list):
        rows = offs_list[-1]
        a = torch.randn(rows, 64, generator=g).to(dev, dtype).requires_grad_(backward)
        b = torch.randn(3, 32, 64, generator=g).to(dev, dtype).requires_grad_(backward)
        offs = torch.tensor(offs_list, dtype=torch.int32, device=dev)
        bt = b.transpose(1, 2)
        out = torch._grouped_mm(a, bt, offs=offs)
        ref = _loop_mm(a.detach().float(), bt.detach().float(), offs)
        ok = _rel(out.detach().float(), ref) < tol
        if backward and ok:
            go = torch.randn(out.shape, generator=g).to(dev, dtype)
            ga, gb = torch.autograd.grad(out, [a, b], go)
            a32 = a.detach().float().requires_grad_()
            b32 = b.detach().float().requires_grad_()
            r = _loop_mm(a32, b32.transpose(1, 2), offs)
            ra, rb = torch.autograd.grad(r, [a32, b32], go.float())
            ok = _rel(ga.float(), ra) < tol and _rel(gb.float(), rb) < tol
        return ok

    for offs_list, mode in (([5, 21, 40], "native"), ([16, 32, 48], "padded")):
        try:
            if attempt(offs_list):
                return mode
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return "loop"


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, mode: str):
    """``out[rows of group e] = a[rows] @ b[e]``; ``offs_E`` int32 cumulative group ends."""
    if mode == "loop":
        return _loop_mm(a_MK, b_EKN, offs_E)
    return torch._grouped_mm(a_MK, b_EKN, offs=offs_E)


def _mode(p, backward=None) -> str:
    bwd = p.backward if backward is None else backward
    mode = grouped_mm_mode(p.device.type, p.device.index, p.dtype, bwd)
    # 16-byte row strides: H, the w1 rows and F must be multiples of 16 bytes.
    esize = torch.empty((), dtype=p.dtype).element_size()
    dims = (p.shape.hidden, p.shape.w1_rows, p.shape.ffn)
    if mode != "loop" and any(d * esize % 16 for d in dims):
        mode = "loop"
    return mode


# ----------------------------------------------------------------------------- sort layouts
@dataclass
class SortInfo:
    """One rank's assignments sorted by (local) expert.

    ``order [M]``: assignment index a = t*K + k of each sorted row (W = 1), or the received
    row of each sorted row (W > 1); ``token [M]`` token of each sorted row (W = 1);
    ``w_sorted [M]`` its weight; ``offs [El]`` int32 group ends; ``counts`` host ints.
    Padded (16 rows): ``dest [M]`` padded row of each sorted row, ``pad_offs [El]``, ``P`` rows.
    """

    order: torch.Tensor
    token: torch.Tensor | None
    w_sorted: torch.Tensor | None
    offs: torch.Tensor
    counts: list
    dest: torch.Tensor
    pad_offs: torch.Tensor
    P: int
    gather_pad: torch.Tensor | None = None  # [P] token per padded row (T = the zero row)
    a2a: object = None  # _A2APlan for W > 1


def _pad_layout(counts_dev: torch.Tensor, ids_sorted: torch.Tensor, M_cap: int):
    """Padded positions without a host sync: capacity ``M + El * 16`` rows (TorchTitan's)."""
    padded = (counts_dev + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts_dev, 0) - counts_dev
    M = ids_sorted.numel()
    pos = torch.arange(M, device=ids_sorted.device) - start[ids_sorted]
    dest = pad_start[ids_sorted] + pos
    return dest, pad_end.to(torch.int32), M_cap


def sort_by_expert(
    topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_local: int, first_expert: int = 0
) -> SortInfo:
    """Stable sort of this rank's kept assignments by expert (ties keep (token, k) order).

    Assignments on experts outside ``[first_expert, first_expert + num_local)`` or with id -1
    are left out. Reads the counts on the host (setup only).
    """
    T, K = topk_ids_TK.shape
    ids = topk_ids_TK.reshape(-1) - first_expert
    keep = (ids >= 0) & (ids < num_local) & (topk_ids_TK.reshape(-1) >= 0)
    key = torch.where(keep, ids, torch.full_like(ids, num_local))
    order_all = torch.sort(key, stable=True).indices
    M = int(keep.sum())
    order = order_all[:M]
    ids_sorted = key[order]
    counts_dev = torch.bincount(ids_sorted, minlength=num_local)[:num_local]
    offs = torch.cumsum(counts_dev, 0).to(torch.int32)
    dest, pad_offs, P = _pad_layout(counts_dev, ids_sorted, M + num_local * ALIGN_M)
    token = order // K
    gather_pad = torch.full((P,), T, dtype=torch.int64, device=order.device)
    gather_pad[dest] = token
    return SortInfo(
        order,
        token,
        topk_w_TK.reshape(-1)[order],
        offs,
        counts_dev.tolist(),
        dest,
        pad_offs,
        P,
        gather_pad,
    )


# ------------------------------------------------------------------ expert-parallel all-to-all
class _A2A(torch.autograd.Function):
    """Rows split by ``send`` go to each rank; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, world, send, recv):
        ctx.world, ctx.send, ctx.recv = world, send, recv
        out = world.all_to_all(list(rows.split(send)))
        return torch.cat(out) if out else rows[:0]

    @staticmethod
    def backward(ctx, g):
        back = ctx.world.all_to_all(list(g.contiguous().split(ctx.recv)))
        return torch.cat(back), None, None, None


@dataclass
class _A2APlan:
    send: list  # rows this rank sends to each rank
    recv: list  # rows it receives from each rank
    regroup: torch.Tensor  # received row of each locally sorted row
    counts_local: list  # rows per local expert


def _a2a_plan(ids_TK: torch.Tensor, world, E: int) -> tuple[_A2APlan, torch.Tensor]:
    """Source order (all kept assignments sorted by global expert) + the exchange plan.

    Host sync: the split sizes (as TorchTitan's all_to_all_single needs them)."""
    W, r = world.world_size, world.rank
    El = E // W
    flat = ids_TK.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    order_all = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)[:E]
    n_valid = int(counts.sum())
    order = order_all[:n_valid]
    cnt_all = world.all_gather_ints(counts.tolist())  # [W][E]
    send = [sum(cnt_all[r][d * El : (d + 1) * El]) for d in range(W)]
    recv = [sum(cnt_all[s][r * El : (r + 1) * El]) for s in range(W)]
    local_e = torch.cat(
        [
            torch.repeat_interleave(
                torch.arange(El, device=ids_TK.device),
                torch.tensor(cnt_all[s][r * El : (r + 1) * El], device=ids_TK.device),
            )
            for s in range(W)
        ]
    )
    regroup = torch.sort(local_e, stable=True).indices
    counts_local = [sum(cnt_all[s][r * El + e] for s in range(W)) for e in range(El)]
    return _A2APlan(send, recv, regroup, counts_local), order


# ------------------------------------------------------------------------ case construction
def _need_single(world, name):
    if world.world_size > 1:
        raise Unavailable(f"{name} is a single-rank baseline (world size {world.world_size})")


def _no_emulated_backward(p, world, name):
    if (
        p.backward
        and world.world_size > 1
        and getattr(world, "backend", "") == "emulated"
        and p.device.type == "cuda"
    ):
        raise Unavailable(
            f"{name} backward calls host collectives, which emulated ranks on one GPU cannot run "
            "inside autograd; run under torchrun"
        )


def _sorted_info(p: MoEProblem, world) -> list[SortInfo]:
    """Per set: the rank's local layout (W = 1: sort; W > 1: after the exchange plan)."""
    key = "sort"
    if key in p.cache:
        return p.cache[key]
    infos = []
    El, W = p.local_experts, world.world_size
    for s in p.sets:
        if W == 1:
            infos.append(sort_by_expert(s.topk_ids_TK, s.topk_w_TK, El))
            continue
        plan, order = _a2a_plan(s.topk_ids_TK, world, p.shape.experts)
        counts = torch.tensor(plan.counts_local, device=p.device)
        Mr = int(counts.sum())
        ids_sorted = torch.repeat_interleave(torch.arange(El, device=p.device), counts)
        dest, pad_offs, P = _pad_layout(counts, ids_sorted, Mr + El * ALIGN_M)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        info = SortInfo(order, None, None, offs, plan.counts_local, dest, pad_offs, P, None, plan)
        infos.append(info)
    p.cache[key] = infos
    return infos


def _received_rows(p: MoEProblem, world, infos) -> list[torch.Tensor]:
    """Rows each rank computes on, sorted by local expert (setup: through the exchange)."""
    key = "xs_sorted"
    if key in p.cache:
        return p.cache[key]
    out = []
    K = p.shape.topk
    for s, info in zip(p.sets, infos):
        if world.world_size == 1:
            out.append(s.x_TH.index_select(0, info.token))
        else:
            rows = s.x_TH.index_select(0, info.order // K)
            got = torch.cat(world.all_to_all(list(rows.split(info.a2a.send))))
            out.append(got.index_select(0, info.a2a.regroup))
    p.cache[key] = out
    return out


def layer0_h(p: MoEProblem, world) -> list[torch.Tensor]:
    """Per set, the layer-0 output in canonical order (setup, untimed): layer 1's input."""
    key = "h_sorted"
    if key in p.cache:
        return p.cache[key]
    infos = _sorted_info(p, world)
    xs = _received_rows(p, world, infos)
    w1t = p.w1.transpose(1, 2)
    mode = _mode(p, backward=False)
    with torch.no_grad():
        hs = [
            activation_fn(grouped_mm(x, w1t, i.offs, mode), p.shape.activation)
            for x, i in zip(xs, infos)
        ]
    p.cache[key] = hs
    return hs


def _pad_rows(rows: torch.Tensor, info: SortInfo) -> torch.Tensor:
    out = rows.new_zeros((info.P, rows.shape[1]))
    out[info.dest] = rows
    return out


def _flops_l0(p, M):
    return 2.0 * M * p.shape.hidden * p.shape.w1_rows


def _flops_l1(p, M):
    return 2.0 * M * p.shape.ffn * p.shape.hidden


def _M(infos) -> int:
    return sum(infos[0].counts)


# -- layer 0
def _l0_grouped_mm(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    xs = _received_rows(p, world, infos)
    mode = _mode(p, backward=False)
    w1t = p.w1.transpose(1, 2)
    if mode == "padded":
        xs = [_pad_rows(x, i) for x, i in zip(xs, infos)]
        offs = [i.pad_offs for i in infos]
    else:
        offs = [i.offs for i in infos]
    n = len(xs)
    return Case(
        "grouped_mm",
        "floor",
        lambda i: grouped_mm(xs[i % n], w1t, offs[i % n], mode),
        None,
        _flops_l0(p, _M(infos)),
        note=f"torch._grouped_mm ({mode})",
    )


def _l0_unfused(p: MoEProblem, world) -> Case:
    _need_single(world, "unfused")
    infos = _sorted_info(p, world)
    mode = _mode(p, backward=False)
    w1t = p.w1.transpose(1, 2)
    act = p.shape.activation
    n = len(infos)
    if mode == "padded":
        raise Unavailable("grouped_mm here needs padded groups: see torchtitan")

    def step(i):
        s, info = p.sets[i % n], infos[i % n]
        return activation_fn(
            grouped_mm(s.x_TH.index_select(0, info.token), w1t, info.offs, mode), act
        )

    return Case(
        "unfused",
        "baseline",
        step,
        lambda h: h,
        _flops_l0(p, _M(infos)),
        note=f"index_select + grouped_mm ({mode}) + {act}",
    )


def _l0_torchtitan(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    mode = _mode(p, backward=False)
    w1t = p.w1.transpose(1, 2)
    act = p.shape.activation
    n, K = len(infos), p.shape.topk
    W = world.world_size

    def step(i):
        s, info = p.sets[i % n], infos[i % n]
        if W == 1:
            xz = torch.cat([s.x_TH, s.x_TH.new_zeros((1, s.x_TH.shape[1]))])
            xp = xz.index_select(0, info.gather_pad)
        else:
            rows = s.x_TH.index_select(0, info.order // K)
            got = _A2A.apply(rows, world, info.a2a.send, info.a2a.recv)
            xp = _pad_rows(got.index_select(0, info.a2a.regroup), info)
        return activation_fn(grouped_mm(xp, w1t, info.pad_offs, mode), act)

    def canon(h):
        info = infos[0]
        return h.index_select(0, info.dest)

    return Case(
        "torchtitan",
        "baseline",
        step,
        canon,
        _flops_l0(p, _M(infos)),
        note="pad 16 + gather + grouped_mm + act" + (" + all_to_all" if W > 1 else ""),
    )


def _l0_loop(p: MoEProblem, world) -> Case:
    _need_single(world, "loop")
    infos = _sorted_info(p, world)
    act = p.shape.activation
    n = len(infos)
    bounds = [
        [(sum(i.counts[:e]), sum(i.counts[: e + 1])) for e in range(len(i.counts))] for i in infos
    ]

    def step(i):
        s, info = p.sets[i % n], infos[i % n]
        outs = []
        for e, (a, b) in enumerate(bounds[i % n]):
            if b > a:
                outs.append(activation_fn(s.x_TH[info.token[a:b]] @ p.w1[e].t(), act))
        return torch.cat(outs)

    return Case(
        "loop",
        "baseline",
        step,
        lambda h: h,
        _flops_l0(p, _M(infos)),
        note="per-expert matmul (host bounds)",
    )


# -- layer 1
def _l1_grouped_mm(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    hs = layer0_h(p, world)
    mode = _mode(p, backward=False)
    w2t = p.w2.transpose(1, 2)
    if mode == "padded":
        hs = [_pad_rows(h, i) for h, i in zip(hs, infos)]
        offs = [i.pad_offs for i in infos]
    else:
        offs = [i.offs for i in infos]
    n = len(hs)
    return Case(
        "grouped_mm",
        "floor",
        lambda i: grouped_mm(hs[i % n], w2t, offs[i % n], mode),
        None,
        _flops_l1(p, _M(infos)),
        note=f"torch._grouped_mm ({mode})",
    )


def _combine(p, world, info, s, rows_sorted):
    """Weighted scatter-add of expert outputs (sorted by local expert) into y [T, H]."""
    K = p.shape.topk
    if world.world_size == 1:
        token, w = info.token, info.w_sorted
    else:
        back = rows_sorted.new_empty(rows_sorted.shape)
        back[info.a2a.regroup] = rows_sorted
        rows_sorted = _A2A.apply(back, world, info.a2a.recv, info.a2a.send)
        token = info.order // K
        w = s.topk_w_TK.reshape(-1)[info.order]
    y = torch.zeros_like(s.x_TH)
    return y.index_add_(0, token, rows_sorted * w.to(rows_sorted.dtype).unsqueeze(1))


def _l1_unfused(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    hs = layer0_h(p, world)
    mode = _mode(p, backward=False)
    if mode == "padded":
        raise Unavailable("grouped_mm here needs padded groups: see torchtitan")
    w2t = p.w2.transpose(1, 2)
    n = len(hs)

    def step(i):
        info = infos[i % n]
        out = grouped_mm(hs[i % n], w2t, info.offs, mode)
        return _combine(p, world, info, p.sets[i % n], out)

    W = world.world_size
    return Case(
        "unfused",
        "baseline",
        step,
        lambda y: y,
        _flops_l1(p, _M(infos)),
        note=f"grouped_mm ({mode}) + weighted index_add_" + (" + all_to_all" if W > 1 else ""),
    )


def _l1_torchtitan(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    hs = [_pad_rows(h, i) for h, i in zip(layer0_h(p, world), infos)]
    mode = _mode(p, backward=False)
    w2t = p.w2.transpose(1, 2)
    n = len(hs)

    def step(i):
        info = infos[i % n]
        out = grouped_mm(hs[i % n], w2t, info.pad_offs, mode)
        return _combine(p, world, info, p.sets[i % n], out.index_select(0, info.dest))

    return Case(
        "torchtitan",
        "baseline",
        step,
        lambda y: y,
        _flops_l1(p, _M(infos)),
        note="padded grouped_mm + unpad + weighted index_add_",
    )


def _l1_loop(p: MoEProblem, world) -> Case:
    _need_single(world, "loop")
    infos = _sorted_info(p, world)
    hs = layer0_h(p, world)
    n = len(hs)
    bounds = [
        [(sum(i.counts[:e]), sum(i.counts[: e + 1])) for e in range(len(i.counts))] for i in infos
    ]

    def step(i):
        s, info, h = p.sets[i % n], infos[i % n], hs[i % n]
        y = torch.zeros_like(s.x_TH)
        for e, (a, b) in enumerate(bounds[i % n]):
            if b > a:
                out = h[a:b] @ p.w2[e].t()
                y.index_add_(0, info.token[a:b], out * info.w_sorted[a:b, None].to(out.dtype))
        return y

    return Case(
        "loop",
        "baseline",
        step,
        lambda y: y,
        _flops_l1(p, _M(infos)),
        note="per-expert matmul + index_add_ (host bounds)",
    )


# -- whole layer
def _leafs(p: MoEProblem):
    """Leaves for backward runs: a copy of x per set; wr, w1, w2 share the problem's storage
    (``detach`` makes new leaves without copying: at DeepSeek-V3 sizes a copy is 22 GB)."""
    key = "leafs"
    if key not in p.cache:
        xs = [s.x_TH.detach().clone().requires_grad_(True) for s in p.sets]
        ws = [t.detach().requires_grad_(True) for t in (p.wr_EH, p.w1, p.w2)]
        p.cache[key] = (xs, ws)
    return p.cache[key]


GRAD_EXPERTS_CHECKED = 2


def bwd_canon(out):
    """Backward outputs ``(y, dx, dwr, dw1, dw2)`` as compared: the weight gradients of the
    first experts only, so that holding every case's output does not hold every case's full
    weight gradients (22 GB each at DeepSeek-V3 sizes)."""
    y, dx, dwr, dw1, dw2 = out
    k = GRAD_EXPERTS_CHECKED
    return (y, dx, dwr, dw1[:k].clone(), dw2[:k].clone())


def _moe_step(p: MoEProblem, fwd):
    """Wrap ``fwd(x, wr, w1, w2, i) -> y`` into a step (forward, or forward + backward)."""
    n = len(p.sets)
    if not p.backward:

        def step(i):
            with torch.no_grad():
                return fwd(p.sets[i % n].x_TH, p.wr_EH, p.w1, p.w2, i % n)

        return step, (lambda y: y)
    xs, ws = _leafs(p)

    def step_bwd(i):
        x = xs[i % n]
        y = fwd(x, *ws, i % n)
        grads = torch.autograd.grad(y, [x, *ws], p.sets[i % n].gy_TH, allow_unused=True)
        return (y.detach(), *grads)

    return step_bwd, bwd_canon


def _moe_flops(p, M):
    f = _flops_l0(p, M) + _flops_l1(p, M)
    return 3 * f if p.backward else f


def _moe_grouped_mm(p: MoEProblem, world) -> Case:
    infos = _sorted_info(p, world)
    xs = _received_rows(p, world, infos)
    hs = layer0_h(p, world)
    mode = _mode(p)
    if mode == "padded":
        xs = [_pad_rows(x, i) for x, i in zip(xs, infos)]
        hs = [_pad_rows(h, i) for h, i in zip(hs, infos)]
        offs = [i.pad_offs for i in infos]
    else:
        offs = [i.offs for i in infos]
    n = len(xs)
    if not p.backward:

        def step(i):
            j = i % n
            a = grouped_mm(xs[j], p.w1.transpose(1, 2), offs[j], mode)
            return a, grouped_mm(hs[j], p.w2.transpose(1, 2), offs[j], mode)
    else:
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        hs = [h.detach().clone().requires_grad_(True) for h in hs]
        w1 = p.w1.detach().requires_grad_(True)
        w2 = p.w2.detach().requires_grad_(True)
        g1 = [torch.randn(x.shape[0], p.shape.w1_rows, device=p.device, dtype=p.dtype) for x in xs]
        g2 = [torch.randn(h.shape[0], p.shape.hidden, device=p.device, dtype=p.dtype) for h in hs]

        def step(i):
            j = i % n
            a = grouped_mm(xs[j], w1.transpose(1, 2), offs[j], mode)
            b = grouped_mm(hs[j], w2.transpose(1, 2), offs[j], mode)
            return torch.autograd.grad([a, b], [xs[j], w1, hs[j], w2], [g1[j], g2[j]])

    return Case(
        "grouped_mm",
        "floor",
        step,
        None,
        _moe_flops(p, _M(infos)),
        note=f"the two expert GEMMs alone ({mode})",
    )


def _titan_forward(p: MoEProblem, world, mode):
    s, E, K, El = p.shape, p.shape.experts, p.shape.topk, p.local_experts
    W = world.world_size

    def fwd(x, wr, w1, w2, j):
        T, H = x.shape
        ids, w = torch_route(x, wr, K, s.score_func)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        token = order // K
        if W == 1:
            counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).to(torch.int64)
            rows_src = None
        else:
            plan = p.cache["titan_plans"][j]
            rows_src = _A2A.apply(x.index_select(0, token), world, plan.send, plan.recv)
            rows_src = rows_src.index_select(0, plan.regroup)
            counts = torch.tensor(plan.counts_local, device=x.device)
        ids_sorted = torch.repeat_interleave(
            torch.arange(El, device=x.device),
            counts,
            output_size=int(rows_src.shape[0]) if W > 1 else T * K,
        )
        M_cap = ids_sorted.numel() + El * ALIGN_M
        dest, pad_offs, P = _pad_layout(counts, ids_sorted, M_cap)
        if W == 1:
            gather = torch.full((P,), T, dtype=torch.int64, device=x.device)
            gather[dest] = token
            xz = torch.cat([x, x.new_zeros((1, H))])
            xp = xz.index_select(0, gather)
        else:
            xp = rows_src.new_zeros((P, H)).index_copy(0, dest, rows_src)
        h = activation_fn(grouped_mm(xp, w1.transpose(1, 2), pad_offs, mode), s.activation)
        out = grouped_mm(h, w2.transpose(1, 2), pad_offs, mode).index_select(0, dest)
        if W > 1:
            back = out.new_empty(out.shape).index_copy(0, plan.regroup, out)
            out = _A2A.apply(back, world, plan.recv, plan.send)
        wsort = w.reshape(-1)[order].to(out.dtype)
        y = torch.zeros_like(x)
        return y.index_add(0, token, out * wsort.unsqueeze(1))

    return fwd


def _moe_torchtitan(p: MoEProblem, world) -> Case:
    _no_emulated_backward(p, world, "torchtitan")
    mode = _mode(p)
    if world.world_size > 1:
        # The a2a plan of each set is data-dependent: TorchTitan syncs for it every step; we
        # build it once per set in setup and still run the exchange inside the timed region.
        p.cache["titan_plans"] = [
            _a2a_plan(s.topk_ids_TK, world, p.shape.experts)[0] for s in p.sets
        ]
    step, canon = _moe_step(p, _titan_forward(p, world, mode))
    infos = _sorted_info(p, world)
    return Case(
        "torchtitan",
        "baseline",
        step,
        canon,
        _moe_flops(p, _M(infos)),
        note="router + argsort + pad 16 + grouped_mm x2 + index_add"
        + (" + all_to_all" if world.world_size > 1 else ""),
    )


def _moe_unfused(p: MoEProblem, world) -> Case:
    _need_single(world, "unfused")
    mode = _mode(p)
    if mode == "padded":
        raise Unavailable("grouped_mm here needs padded groups: see torchtitan")
    s, E, K = p.shape, p.shape.experts, p.shape.topk

    def fwd(x, wr, w1, w2, j):
        ids, w = torch_route(x, wr, K, s.score_func)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        token = order // K
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = activation_fn(
            grouped_mm(x.index_select(0, token), w1.transpose(1, 2), offs, mode), s.activation
        )
        out = grouped_mm(h, w2.transpose(1, 2), offs, mode)
        y = torch.zeros_like(x)
        return y.index_add(0, token, out * w.reshape(-1)[order].to(out.dtype).unsqueeze(1))

    step, canon = _moe_step(p, fwd)
    return Case(
        "unfused",
        "baseline",
        step,
        canon,
        _moe_flops(p, _M(_sorted_info(p, world))),
        note="router + argsort + index_select + grouped_mm x2 + index_add (no padding)",
    )


def _moe_loop(p: MoEProblem, world) -> Case:
    _need_single(world, "loop")
    s, E, K = p.shape, p.shape.experts, p.shape.topk

    def fwd(x, wr, w1, w2, j):
        ids, w = torch_route(x, wr, K, s.score_func)
        y = torch.zeros_like(x)
        # One weight pair per expert, as HF's ModuleList has. Indexing the stacked leaf instead
        # (w1[e]) costs a backward that writes a zero tensor the size of *all* experts' w1 and
        # adds it into the gradient, once per expert hit: 14 GiB each, 256 times, at
        # deepseek-v3, which ran the 80 GB card out of memory. unbind's backward stacks once.
        w1_e, w2_e = w1.unbind(0), w2.unbind(0)
        hit = torch.bincount(ids.reshape(-1), minlength=E).nonzero().reshape(-1).tolist()
        for e in hit:  # HF style: find the rows of each expert hit (host syncs, as HF)
            tok, kk = torch.where(ids == e)
            h = activation_fn(x[tok] @ w1_e[e].t(), s.activation) @ w2_e[e].t()
            y = y.index_add(0, tok, h * w[tok, kk].to(h.dtype).unsqueeze(1))
        return y

    step, canon = _moe_step(p, fwd)
    return Case(
        "loop",
        "baseline",
        step,
        canon,
        _moe_flops(p, _M(_sorted_info(p, world))),
        note="HF-Mixtral-style per-expert loop",
    )


def _moe_mo_baseline(p: MoEProblem, world) -> Case:
    _no_emulated_backward(p, world, "mo_baseline")
    try:
        from ..dispatch.baseline import baseline_experts
    except Exception as e:  # noqa: BLE001 - any import failure makes it unavailable
        raise Unavailable(f"moe_overlap.dispatch.baseline not importable: {e!r}") from e
    s = p.shape

    def fwd(x, wr, w1, w2, j):
        ids, w = torch_route(x, wr, s.topk, s.score_func)
        return baseline_experts(x, ids, w.to(x.dtype), w1, w2, world=world, activation=s.activation)

    step, canon = _moe_step(p, fwd)
    return Case(
        "mo_baseline",
        "baseline",
        step,
        canon,
        _moe_flops(p, _M(_sorted_info(p, world))),
        note="moe_overlap.dispatch.baseline (all_to_all + grouped_mm)",
    )


def _moe_deepspeed(p: MoEProblem, world) -> Case:
    import importlib.util

    import torch.distributed as dist

    s = p.shape
    # Cheap refusals first: importing deepspeed takes seconds and logs.
    if importlib.util.find_spec("deepspeed") is None:
        raise Unavailable("deepspeed is not installed (pip install 'deepspeed>=0.16')")
    if s.activation != "swiglu" or s.score_func != "softmax" or s.topk != 2:
        # DeepSpeed renormalizes the two weights of top-2 only (top-1 keeps the raw softmax).
        raise Unavailable("the deepspeed baseline covers softmax top-2 SwiGLU experts")
    # One rank needs no process group: without an expert-parallel group DeepSpeed's layer
    # skips its collectives (the dropless capacity's all-reduce, the all-to-alls). Several
    # ranks need one process each.
    if world.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise Unavailable("deepspeed's MoE needs one process per rank (torchrun)")
    if world.world_size > 1 and dist.get_world_size() != world.world_size:
        raise Unavailable("deepspeed's MoE needs one process per rank")
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DSMoE
    except Exception as e:  # noqa: BLE001 - deepspeed broken
        raise Unavailable(f"deepspeed does not import: {type(e).__name__}: {e}") from e
    # DeepSpeed's collectives go through its own comm module, set up by init_distributed (it
    # adopts the existing process group); without it the first all-to-all finds no backend.
    if world.world_size > 1:
        deepspeed.init_distributed(dist_backend=dist.get_backend())

    class _Expert(torch.nn.Module):
        def __init__(self, w1, w2):
            super().__init__()
            self.w1 = torch.nn.Parameter(w1.detach().clone())
            self.w2 = torch.nn.Parameter(w2.detach().clone())

        def forward(self, x):
            return activation_fn(x @ self.w1.t(), "swiglu") @ self.w2.t()

    try:
        layer = DSMoE(
            s.hidden,
            _Expert(p.w1[0], p.w2[0]),
            num_experts=s.experts,
            ep_size=world.world_size,
            k=s.topk,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        ).to(p.device)
        # The expert-parallel group (deepspeed.initialize would make it): without it each rank
        # sizes its dropless all-to-all from its own tokens and the collective aborts.
        if world.world_size > 1:
            layer.set_deepspeed_parallelism()
        layer.eval()
        experts = layer.deepspeed_moe.experts.deepspeed_experts
        with torch.no_grad():
            for e, ex in enumerate(experts):
                ex.w1.copy_(p.w1[e])
                ex.w2.copy_(p.w2[e])
            layer.deepspeed_moe.gate.wg.weight.copy_(p.wr_EH.float())
        layer.to(p.dtype)
        layer.deepspeed_moe.gate.wg.float()
    except Exception as e:  # noqa: BLE001 - version differences: report, do not crash
        raise Unavailable(f"deepspeed MoE setup failed: {type(e).__name__}: {e}") from e

    def fwd(x, wr, w1, w2, j):
        return layer(x)[0]

    n = len(p.sets)
    if p.backward:
        xs = [s_.x_TH.detach().clone().requires_grad_(True) for s_ in p.sets]
        params = [layer.deepspeed_moe.gate.wg.weight]
        params += [ex.w1 for ex in experts] + [ex.w2 for ex in experts]

        def step(i):
            x = xs[i % n]
            y = layer(x)[0]
            g = torch.autograd.grad(y, [x, *params], p.sets[i % n].gy_TH)
            w1g = torch.stack(g[2 : 2 + len(experts)])
            w2g = torch.stack(g[2 + len(experts) :])
            return (y.detach(), g[0], g[1].to(p.dtype), w1g, w2g)
    else:

        def step(i):
            with torch.no_grad():
                return layer(p.sets[i % n].x_TH)[0]

    return Case(
        "deepspeed",
        "baseline",
        step,
        bwd_canon if p.backward else (lambda o: o),
        _moe_flops(p, _M(_sorted_info(p, world))),
        note="deepspeed.moe.layer.MoE (eval, dropless)",
    )


def _moe_a2a(p: MoEProblem, world) -> Case:
    import torch.distributed as dist

    if world.world_size == 1:
        raise Unavailable("no communication with one rank")
    if not (dist.is_available() and dist.is_initialized()):
        raise Unavailable("communication alone is measured with real ranks only (torchrun)")
    infos = _sorted_info(p, world)
    K, n = p.shape.topk, len(infos)

    def step(i):
        info, s = infos[i % n], p.sets[i % n]
        rows = s.x_TH.index_select(0, info.order // K)
        got = torch.cat(world.all_to_all(list(rows.split(info.a2a.send))))
        return torch.cat(world.all_to_all(list(got.split(info.a2a.recv))))

    return Case("a2a", "comm", step, None, 0.0, note="dispatch + combine all_to_all alone")


# ------------------------------------------------------------------------------------ dense
def _dist_group(world):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise Unavailable("needs torch.distributed initialized (run under torchrun)")
    group = getattr(world, "group", None)
    if group is None:
        raise Unavailable(f"needs a torch.distributed world, got {type(world).__name__}")
    return dist, group


def _dense_mm(p: DenseProblem, world) -> Case:
    M, N, K, W = p.shape.m, p.shape.n, p.shape.k, p.world_size
    n = len(p.xs)
    if p.op == "ag-matmul":
        # The non-split GEMM: the whole gathered x times this rank's weight.
        full = [x.repeat(W, 1) for x in p.xs]
        flops = 2.0 * M * (N // W) * K
        step = lambda i: full[i % n] @ p.weight.t()
    else:
        flops = 2.0 * M * N * (K // W)
        step = lambda i: p.xs[i % n] @ p.weight.t()
    return Case("mm", "floor", step, None, flops, note="torch.mm on the full operands")


def _dense_flops(p):
    M, N, K, W = p.shape.m, p.shape.n, p.shape.k, p.world_size
    return 2.0 * M * (N // W) * K if p.op == "ag-matmul" else 2.0 * M * N * (K // W)


def _dense_nccl(p: DenseProblem, world) -> Case:
    dist, group = _dist_group(world)
    W, n = p.world_size, len(p.xs)
    if p.op == "ag-matmul":

        def step(i):
            x = p.xs[i % n]
            full = x.new_empty((x.shape[0] * W, x.shape[1]))
            dist.all_gather_into_tensor(full, x, group=group)
            return full @ p.weight.t()

        note = "NCCL all_gather + mm"
    else:

        def step(i):
            y = p.xs[i % n] @ p.weight.t()
            out = y.new_empty((y.shape[0] // W, y.shape[1]))
            dist.reduce_scatter_tensor(out, y, group=group)
            return out

        note = "mm + NCCL reduce_scatter"
    return Case("nccl", "baseline", step, lambda y: y, _dense_flops(p), note=note)


def _dense_symm(p: DenseProblem, world) -> Case:
    dist, group = _dist_group(world)
    ops = getattr(torch.ops, "symm_mem", None)
    name = "fused_all_gather_matmul" if p.op == "ag-matmul" else "fused_matmul_reduce_scatter"
    if ops is None or not hasattr(ops, name):
        raise Unavailable(f"torch.ops.symm_mem.{name} not in this torch")
    try:  # needed by some torch versions, absent or a no-op in others
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
    except (ImportError, AttributeError, RuntimeError):
        pass
    gname, n = group.group_name, len(p.xs)
    wt = p.weight.t()
    if p.op == "ag-matmul":

        def step(i):
            _, outs = ops.fused_all_gather_matmul(p.xs[i % n], [wt], 0, gname)
            return outs[0]
    else:

        def step(i):
            return ops.fused_matmul_reduce_scatter(p.xs[i % n], wt, "sum", 0, gname)

    return Case(
        "symm_mem",
        "baseline",
        step,
        lambda y: y,
        _dense_flops(p),
        note=f"torch.ops.symm_mem.{name}",
    )


def _dense_comm(p: DenseProblem, world) -> Case:
    W, n = p.world_size, len(p.xs)
    if W == 1:
        raise Unavailable("no communication with one rank")
    dist, group = _dist_group(world)
    if p.op == "ag-matmul":

        def step(i):
            x = p.xs[i % n]
            full = x.new_empty((x.shape[0] * W, x.shape[1]))
            dist.all_gather_into_tensor(full, x, group=group)
            return full

        name = "all_gather"
    else:
        ys = [x.new_empty((x.shape[0], p.weight.shape[0])).normal_() for x in p.xs]

        def step(i):
            y = ys[i % n]
            out = y.new_empty((y.shape[0] // W, y.shape[1]))
            dist.reduce_scatter_tensor(out, y, group=group)
            return out

        name = "reduce_scatter"
    return Case("comm", "comm", step, None, 0.0, note=f"NCCL {name} alone")


MOE_BASELINES: dict[str, dict[str, Callable]] = {
    "layer0": {
        "grouped_mm": _l0_grouped_mm,
        "unfused": _l0_unfused,
        "torchtitan": _l0_torchtitan,
        "loop": _l0_loop,
    },
    "layer1": {
        "grouped_mm": _l1_grouped_mm,
        "unfused": _l1_unfused,
        "torchtitan": _l1_torchtitan,
        "loop": _l1_loop,
    },
    "moe": {
        "grouped_mm": _moe_grouped_mm,
        "torchtitan": _moe_torchtitan,
        "unfused": _moe_unfused,
        "loop": _moe_loop,
        "mo_baseline": _moe_mo_baseline,
        "deepspeed": _moe_deepspeed,
        "a2a": _moe_a2a,
    },
}
DENSE_BASELINES: dict[str, Callable] = {
    "mm": _dense_mm,
    "nccl": _dense_nccl,
    "symm_mem": _dense_symm,
    "comm": _dense_comm,
}


def baseline_names(op: str) -> list[str]:
    if op in MOE_BASELINES:
        return list(MOE_BASELINES[op])
    if op in ("ag-matmul", "matmul-rs"):
        return list(DENSE_BASELINES)
    raise ValueError(f"unknown op {op!r}")


def build_baseline(op: str, name: str, problem, world) -> Case:
    """The baseline ``name`` of ``op`` for this rank, or :class:`Unavailable`."""
    table = MOE_BASELINES.get(op, DENSE_BASELINES)
    if name not in table:
        raise ValueError(f"unknown baseline {name!r} for {op}; choose from {sorted(table)}")
    return table[name](problem, world)
