"""Dense tensor-parallel fused ops: ``all_gather_matmul`` and ``matmul_reduce_scatter``.

Host side of ``moe_overlap.kernels.ag_matmul`` / ``moe_overlap.kernels.matmul_rs`` (their module
docstrings are the design record: flags, tile orders, roles). This module validates inputs,
carves the world's shared workspace, runs the op protocol (``begin_op`` -> ``run_fused`` ->
``end_op``) and wires autograd:

* ``y = AG(x) @ w^T``: ``dx = RS(dy @ w)`` is ``matmul_reduce_scatter(dy, w.t())`` (dgrad of
  AG+GEMM is GEMM+RS); ``dw = dy^T @ AG(x)`` reuses the gathered x that the forward's GEMM
  tiles copied out (``SAVE_A``), so nothing is gathered twice; ``db = dy.sum(0)``.
* ``y = RS(x @ w^T)``: ``dx = AG(dy) @ w`` is ``all_gather_matmul(dy, w.t())``, whose tiles also
  copy out ``AG(dy)`` for ``dw = AG(dy)^T @ x``; ``db = dy.sum(0)`` is this rank's
  contribution: a bias shared by every rank (sequence parallel) needs its gradients summed over
  ranks, as Megatron does for sequence-parallel parameters
  (``moe_overlap.tp.sync_sequence_parallel_grads``).

Workspace and flags for the backward are reserved in the forward (same byte count, flag count
from the backward's tiling): growing either is collective (a host barrier), and a backward
node must never block on another rank's host progress (see DESIGN.md: on CUDA, autograd runs
every thread's backward nodes on one worker thread).

Collective contract: every rank calls the same ops in the same order with the same shapes,
dtypes and ``requires_grad`` pattern (the tiling, hence the flag layout, is derived from them).
The public ops check it where the world says to (``World.agree``: always in emulated worlds,
with ``MOE_OVERLAP_CHECK_SIZES=1`` or ``MOE_OVERLAP_DEBUG=1`` on real ones, a host all-gather
per op): ValueError on every rank rather than writes past a peer's buffers.
Row counts: ``matmul_reduce_scatter`` needs ``M % world_size == 0`` (ValueError otherwise; pad
the rows yourself: padding silently would hand some rank rows nobody asked for).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..kernels.ag_matmul import ag_matmul_config, ag_matmul_flags, launch_ag_matmul
from ..kernels.launch import warmup_only
from ..kernels.matmul_rs import launch_matmul_rs, matmul_rs_config, matmul_rs_flags
from ..world import WorkspacePlan, World, interpreted

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


# ---------------------------------------------------------------------------- validation
def _validate(op: str, x, weight, bias, world, xname: str):
    if not isinstance(world, World):
        raise TypeError(f"{op}: world must be a moe_overlap World, got {type(world).__name__}")
    for name, t in ((xname, x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: {xname} must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"{op}: weight must be 2-D [N, K] (nn.Linear layout), got shape {tuple(weight.shape)}"
        )
    if x.dtype not in _FLOATS:
        raise TypeError(f"{op}: {xname} must be float32/float16/bfloat16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight dtype {weight.dtype} differs from {xname} dtype {x.dtype}")
    for name, t in ((xname, x), ("weight", weight)):
        if t.device != world.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the world is on {world.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: K mismatch: {xname} is {tuple(x.shape)} (K = {x.shape[1]}) but "
            f"weight is {tuple(weight.shape)} (K = {weight.shape[1]})"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{op}: bias must have shape [N] = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise TypeError(f"{op}: bias dtype {bias.dtype} differs from {xname} dtype {x.dtype}")
        if bias.device != world.device:
            raise ValueError(f"{op}: bias is on {bias.device} but the world is on {world.device}")
        bias = bias.contiguous()
    return x.contiguous(), weight, bias


def _max_programs(world: World) -> int:
    mp = getattr(world, "max_programs", None)
    if mp is not None:
        return int(mp)
    if world.device.type == "cuda":
        return torch.cuda.get_device_properties(world.device).multi_processor_count
    return 1 << 30


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------- AG + GEMM
def _ag_plan(world: World, m_local: int, n: int, k: int, dtype: torch.dtype):
    cfg = ag_matmul_config(m_local, n, k, _esize(dtype), interpreted())
    plan = WorkspacePlan()
    off = plan.add((world.world_size * m_local, k), dtype)
    return cfg, plan.total, off, ag_matmul_flags(m_local, world.world_size, cfg)


def _rs_plan(world: World, m_local: int, n: int, k: int, dtype: torch.dtype):
    cfg = matmul_rs_config(m_local, n, k, _esize(dtype), interpreted())
    plan = WorkspacePlan()
    off = plan.add((world.world_size, m_local, n), dtype)
    return cfg, plan.total, off, matmul_rs_flags(m_local, n, world.world_size, cfg)


def _ag_forward(
    x, weight, world: World, bias=None, save_gathered=False, do_gemm=True, reserve=(0, 0)
):
    """x [Ms, K] contiguous, weight [N, K] (any strides) -> (y [M, N] or None, AG(x) or None).

    ``reserve`` = (workspace bytes, flag words) to grow to now, for a later backward op.
    """
    W = world.world_size
    Ms, K = x.shape
    N = weight.shape[0]
    M = W * Ms
    cfg, nbytes, off, nflags = _ag_plan(world, Ms, N if do_gemm else 0, K, x.dtype)
    ws = world.workspace(max(nbytes, reserve[0]))
    g = ws.view(off, (M, K), x.dtype)
    world.signal_pad(max(nflags, reserve[1]))
    flags = world.begin_op(nflags)
    pad_local, epoch = world.ready_args()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if do_gemm else None
    gathered = torch.empty(M, K, dtype=x.dtype, device=x.device) if save_gathered else None
    interp = interpreted()

    def launch(role):
        launch_ag_matmul(
            role,
            x,
            weight,
            bias,
            y if y is not None else x,
            gathered,
            g.local,
            g.ptrs,
            flags.ptrs,
            flags.local,
            pad_local,
            epoch,
            world.error_buffer,
            world.rank,
            W,
            world.wait_budget,
            world.use_timer,
            cfg,
            _max_programs(world),
            do_gemm=do_gemm,
            interpreted=interp,
        )

    if Ms:
        world.run_fused(launch)
    world.end_op()
    return y, gathered


def _rs_forward(x, weight, world: World, bias=None, reserve=(0, 0)):
    """x [M, K] contiguous, weight [N, K] (any strides) -> y [M / W, N]."""
    W = world.world_size
    M, K = x.shape
    N = weight.shape[0]
    Ms = M // W
    cfg, nbytes, off, nflags = _rs_plan(world, Ms, N, K, x.dtype)
    ws = world.workspace(max(nbytes, reserve[0]))
    buf = ws.view(off, (W, Ms, N), x.dtype)
    world.signal_pad(max(nflags, reserve[1]))
    flags = world.begin_op(nflags)
    pad_local, epoch = world.ready_args()
    y = torch.empty(Ms, N, dtype=x.dtype, device=x.device)
    interp = interpreted()

    def launch(role):
        launch_matmul_rs(
            role,
            x,
            weight,
            bias,
            y,
            buf.local,
            buf.ptrs,
            flags.ptrs,
            flags.local,
            pad_local,
            epoch,
            world.error_buffer,
            world.rank,
            W,
            world.wait_budget,
            world.use_timer,
            cfg,
            _max_programs(world),
            interpreted=interp,
        )

    if Ms:
        world.run_fused(launch)
    world.end_op()
    return y


def _check_rows(op: str, m: int, world: World, xname: str):
    W = world.world_size
    if m % W:
        raise ValueError(
            f"{op}: {xname} has {m} rows, not a multiple of world_size {W}: the reduce-scatter "
            f"splits rows into {W} equal blocks; pad the rows to {-(-m // W) * W}"
        )


def _warm_backward_needed(world: World) -> bool:
    """Emulated ranks sharing one GPU run their backward on autograd's one CUDA worker thread,
    where no barrier can protect a lazy kernel load (see kernels/launch.py): compile and load
    the backward's variants during the forward instead."""
    return world.concurrent and world.device.type == "cuda" and world.world_size > 1


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, world):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        reserve = (0, 0)
        if need_x:  # backward runs matmul_reduce_scatter(dy [M, N], weight.t() [K, N])
            _, nbytes, _, nflags = _rs_plan(
                world, x_shard.shape[0], x_shard.shape[1], weight.shape[0], x_shard.dtype
            )
            reserve = (nbytes, nflags)
        y, gathered = _ag_forward(
            x_shard, weight, world, bias, save_gathered=need_w, reserve=reserve
        )
        if need_x and _warm_backward_needed(world):
            with warmup_only():
                _rs_forward(torch.empty_like(y), weight.t(), world)
        ctx.world = world
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, gathered)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        with ctx.world.backward_scope():
            return _AllGatherMatmul._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        weight, gathered = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _rs_forward(dy, weight.t(), ctx.world)
        if ctx.needs_input_grad[1]:
            dw = dy.t().mm(gathered)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, world):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        reserve = (0, 0)
        if need_x or need_w:  # backward runs all_gather_matmul(dy [Ms, N], weight.t() [K, N])
            ms = x.shape[0] // world.world_size
            n_out = x.shape[1] if need_x else 0
            _, nbytes, _, nflags = _ag_plan(world, ms, n_out, weight.shape[0], x.dtype)
            reserve = (nbytes, nflags)
        y = _rs_forward(x, weight, world, bias, reserve=reserve)
        if (need_x or need_w) and _warm_backward_needed(world):
            with warmup_only():
                if need_x:
                    _ag_forward(torch.empty_like(y), weight.t(), world, save_gathered=need_w)
                else:
                    _ag_forward(
                        torch.empty_like(y), weight.t(), world, save_gathered=True, do_gemm=False
                    )
        ctx.world = world
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x if need_w else None, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        with ctx.world.backward_scope():
            return _MatmulReduceScatter._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_x:
            dx, gathered = _ag_forward(dy, weight.t(), ctx.world, save_gathered=need_w)
        elif need_w:
            # Gather only (no GEMM): the weight gradient still needs AG(dy).
            _, gathered = _ag_forward(dy, weight.t(), ctx.world, save_gathered=True, do_gemm=False)
        if need_w:
            dw = gathered.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None


# ---------------------------------------------------------------------------- public API
def all_gather_matmul(
    x_shard: torch.Tensor, weight: torch.Tensor, world: World, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``AllGather_rows(x_shard) @ weight^T (+ bias)`` with the gather inside the GEMM.

    Args:
        x_shard: ``[M / W, K]`` float32/float16/bfloat16, this rank's rows (sequence-parallel
            layout: rank r's shard becomes rows ``[r * M / W, (r + 1) * M / W)``). Made
            contiguous if it is not.
        weight: ``[N, K]`` same dtype (``nn.Linear`` layout; any strides, no copy is made).
        world: the :class:`~moe_overlap.World` all ranks share.
        bias: optional ``[N]`` same dtype, added in the epilogue.

    Returns:
        ``[M, N]`` in the input dtype (fp32 accumulation). Differentiable in all three tensors.

    Collective: every rank calls it with the same shapes. Raises TypeError/ValueError on bad
    input before anything is launched; a peer that never delivers makes the affected tiles NaN
    and raises :class:`~moe_overlap.CommTimeoutError` (stage 6) at the next check.
    """
    x_shard, weight, bias = _validate("all_gather_matmul", x_shard, weight, bias, world, "x_shard")
    grad = _needs_grad(x_shard, weight, bias)
    Ms, K = x_shard.shape
    # N may differ per rank (each multiplies by its own weight shard); the gathered rows may not
    world.agree("all_gather_matmul", rows=Ms, K=K, dtype=x_shard.dtype, grad=grad)
    if grad:
        return _AllGatherMatmul.apply(x_shard, weight, bias, world)
    return _ag_forward(x_shard, weight, world, bias)[0]


def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, world: World, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``ReduceScatter_rows(x @ weight^T) (+ bias)`` with the scatter inside the GEMM epilogue.

    Args:
        x: ``[M, K_local]`` float32/float16/bfloat16, this rank's activations (the K dimension
            is sharded over ranks, as after a column-parallel layer). ``M`` must be a multiple
            of the world size (ValueError otherwise). Made contiguous if it is not.
        weight: ``[N, K_local]`` same dtype (``nn.Linear`` layout; any strides).
        world: the :class:`~moe_overlap.World` all ranks share.
        bias: optional ``[N]`` same dtype, added once after the reduction.

    Returns:
        ``[M / W, N]``: rows ``[r * M / W, (r + 1) * M / W)`` of the sum over ranks, on rank r.
        Partials travel in the input dtype, the sum is fp32 in rank order (deterministic).
        Differentiable; ``bias.grad`` is this rank's contribution (see the module docstring).

    Collective: every rank calls it with the same shapes. A peer that never delivers makes the
    affected tiles NaN and raises :class:`~moe_overlap.CommTimeoutError` (stage 7).
    """
    x, weight, bias = _validate("matmul_reduce_scatter", x, weight, bias, world, "x")
    _check_rows("matmul_reduce_scatter", x.shape[0], world, "x")
    grad = _needs_grad(x, weight, bias)
    # K may differ per rank (an uneven row-parallel split); the reduced [M, N] block may not
    M, N = x.shape[0], weight.shape[0]
    world.agree("matmul_reduce_scatter", M=M, N=N, dtype=x.dtype, grad=grad)
    if grad:
        return _MatmulReduceScatter.apply(x, weight, bias, world)
    return _rs_forward(x, weight, world, bias)
