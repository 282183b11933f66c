"""Column- and row-parallel linear layers on top of the fused TP ops.

The Megatron pairing, sequence-parallel by default:

* ``ColumnParallelLinear`` holds rows ``[r * out / W, (r + 1) * out / W)`` of the full weight.
  With ``gather_input=True`` its input is this rank's sequence shard ``x [S / W, ..., in]`` and
  the forward is ``all_gather_matmul`` (output ``[S, ..., out / W]``: the gather runs along
  dim 0, so use sequence-first layouts ``[S, B, H]`` as Megatron does). With
  ``gather_input=False`` the input is the full, replicated ``x [..., in]``: a plain local matmul
  whose backward all-reduces ``dx`` (Megatron's copy-to-tensor-parallel region).
* ``RowParallelLinear`` holds columns ``[r * in / W, (r + 1) * in / W)``. With
  ``scatter_output=True`` the forward is ``matmul_reduce_scatter`` (input ``[S, ..., in / W]``,
  output this rank's sequence shard ``[S / W, ..., out]``; ``S % W == 0`` is required). With
  ``scatter_output=False``: local matmul + ``world.all_reduce`` (backward: identity), output
  replicated ``[..., out]``.

Leading dims are flattened to rows (row-major), so dim 0 of the input is the one gathered or
scattered. Weights start like ``nn.Linear`` (uniform in ``+-1/sqrt(in_features)``, drawn from the
world's per-rank generator, so shards differ); biases start at zero (Megatron's choice: a
replicated bias then agrees on every rank without communication).

The row-parallel bias under ``scatter_output=True`` is replicated while each rank sees only its
own rows' gradient: it carries ``sequence_parallel = True`` and its ``.grad`` is this rank's
contribution. Call :func:`sync_sequence_parallel_grads` (an all-reduce per such parameter)
before the optimizer step, as Megatron does for sequence-parallel parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..world import World, default_world
from .ops import all_gather_matmul, matmul_reduce_scatter

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "sync_sequence_parallel_grads",
]


def _resolve_world(world):
    """``world`` or the process's default world (``moe_overlap.world.default_world``, the one
    ``MoELayer`` and ``fused_experts`` take too: one workspace for every layer built without a
    world; a second ``init_world()`` would allocate another, or fail under nvshmem)."""
    if world is None:
        return default_world()
    if not isinstance(world, World):
        raise TypeError(f"world must be a moe_overlap World or None, got {type(world).__name__}")
    return world


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dx = dy.contiguous().clone()
        ctx.world.all_reduce(dx)
        return dx, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world):
        y = x.contiguous().clone()
        world.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def copy_to_tensor_parallel(x: torch.Tensor, world: World) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (input replicated on every rank).

    The backward is a host collective: fine on real worlds and CPU emulation; an emulated
    world on one GPU cannot run it inside autograd (see ``moe_overlap.world.emulated``).
    """
    return _CopyToTP.apply(x, world)


def reduce_from_tensor_parallel(x: torch.Tensor, world: World) -> torch.Tensor:
    """Sum over ranks (``world.all_reduce``) forward; identity backward."""
    return _ReduceFromTP.apply(x, world)


def _init_weight_(weight: torch.Tensor, fan_in: int, world: World) -> None:
    # A CPU generator seeded from the world's per-rank stream: reproducible, any device.
    seed = int(
        torch.randint(
            0, 2**62, (1,), generator=world.generator, device=world.generator.device
        ).item()
    )
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    w = torch.empty(weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    with torch.no_grad():
        weight.copy_(w)


def _check_features(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _setup(mod, world, in_features, out_features, split, dtype, device):
    """Common constructor part of the parallel linears: checks, sizes, parameter factory.
    ``split`` names the dimension sharded over ranks; returns (world, its local size, factory)."""
    world = _resolve_world(world)
    in_features = _check_features("in_features", in_features)
    out_features = _check_features("out_features", out_features)
    W = world.world_size
    full = in_features if split == "in_features" else out_features
    if full % W:
        raise ValueError(f"{split} {full} is not a multiple of world_size {W}")
    mod.world, mod.in_features, mod.out_features = world, in_features, out_features
    factory = dict(
        dtype=dtype or torch.get_default_dtype(),
        device=torch.device(device) if device is not None else world.device,
    )
    return world, full // W, factory


def _check_full(weight_full, bias_full):
    """``(out, in)`` of a full ``nn.Linear`` weight handed to ``from_full``, bias checked."""
    if not isinstance(weight_full, torch.Tensor) or weight_full.dim() != 2:
        raise ValueError("weight_full must be a 2-D tensor [out_features, in_features]")
    if not weight_full.is_floating_point():
        raise TypeError(f"weight_full must be a floating tensor, got {weight_full.dtype}")
    out_f, in_f = weight_full.shape
    if bias_full is not None:
        if not isinstance(bias_full, torch.Tensor):
            raise TypeError(f"bias_full must be a tensor or None, got {type(bias_full).__name__}")
        if tuple(bias_full.shape) != (out_f,):
            raise ValueError(f"bias_full must have shape ({out_f},), got {tuple(bias_full.shape)}")
    return out_f, in_f


def _check_unfused_input(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The unfused paths' input check: the fused ops check the same before launching, so
    both paths refuse alike rather than one with a matmul's RuntimeError. Under autocast the
    matmul casts x itself, so only the device is checked there."""
    if x.device != weight.device:
        raise ValueError(f"{name}: input is on {x.device}, the weight on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{name}: input dtype {x.dtype} differs from the weight's {weight.dtype}")


class ColumnParallelLinear(nn.Module):
    """``y = x @ W^T + b`` with W's output rows split over ranks: ``weight [out / W, in]``.

    Args:
        in_features, out_features: full sizes; ``out_features % world_size == 0``.
        world: the World (default: ``moe_overlap.init_world()``, built once per process).
        bias: add a bias shard ``[out / W]``.
        gather_input: input is this rank's row shard (all_gather_matmul) rather than the
            full replicated input.
        dtype, device: of the parameters (default: torch's default dtype, the world's device).

    ``forward(x [S, ..., in]) -> [S * W or S, ..., out / W]``: with ``gather_input`` x is this
    rank's ``S`` rows along dim 0 (rank r holds rows ``[r S, (r + 1) S)``, sequence first) and
    the output has every rank's rows; else x is the full replicated input. x in the weight's
    dtype, on the world's device.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        world: World | None = None,
        bias: bool = False,
        gather_input: bool = True,
        dtype=None,
        device=None,
    ):
        super().__init__()
        world, self.out_local, factory = _setup(
            self, world, in_features, out_features, "out_features", dtype, device
        )
        self.gather_input = bool(gather_input)
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_local, **factory))
        else:
            self.register_parameter("bias", None)
        _init_weight_(self.weight, in_features, world)

    @classmethod
    def from_full(
        cls,
        weight_full: torch.Tensor,
        world: World | None = None,
        bias_full: torch.Tensor | None = None,
        gather_input: bool = True,
    ):
        """Shard a full ``nn.Linear`` weight ``[out, in]`` (and bias ``[out]``): this rank keeps
        rows ``[r * out / W, (r + 1) * out / W)``. Parameters are copies."""
        world = _resolve_world(world)
        out_f, in_f = _check_full(weight_full, bias_full)
        mod = cls(
            in_f,
            out_f,
            world,
            bias=bias_full is not None,
            gather_input=gather_input,
            dtype=weight_full.dtype,
            device=world.device,
        )
        r, n = world.rank, mod.out_local
        with torch.no_grad():
            mod.weight.copy_(weight_full[r * n : (r + 1) * n])
            if bias_full is not None:
                mod.bias.copy_(bias_full[r * n : (r + 1) * n])
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < (2 if self.gather_input else 1):
            raise ValueError(
                "ColumnParallelLinear input must be a tensor [rows, ..., in] "
                f"(2-D or more with gather_input), got {getattr(x, 'shape', x)}"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear: input has {x.shape[-1]} features, expected "
                f"{self.in_features} (input shape {tuple(x.shape)})"
            )
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.in_features)
        if self.gather_input:
            y = all_gather_matmul(x2, self.weight, self.world, self.bias)
            return y.view(self.world.world_size * lead[0], *lead[1:], self.out_local)
        _check_unfused_input("ColumnParallelLinear", x2, self.weight)
        x2 = copy_to_tensor_parallel(x2, self.world)
        return F.linear(x2, self.weight, self.bias).view(*lead, self.out_local)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.out_local}), bias={self.bias is not None}, "
            f"gather_input={self.gather_input}, world_size={self.world.world_size}"
        )


class RowParallelLinear(nn.Module):
    """``y = x @ W^T + b`` with W's input columns split over ranks: ``weight [out, in / W]``.

    Args:
        in_features, out_features: full sizes; ``in_features % world_size == 0``.
        world: the World (default: ``moe_overlap.init_world()``, built once per process).
        bias: add a replicated bias ``[out]`` once, after the reduction.
        scatter_output: reduce-scatter the rows (matmul_reduce_scatter) rather than
            all-reduce them.
        dtype, device: of the parameters (default: torch's default dtype, the world's device).

    ``forward(x [S, ..., in / W]) -> [S / W or S, ..., out]``: x holds this rank's input
    columns (a ColumnParallelLinear's output); with ``scatter_output`` rank r keeps rows
    ``[r S / W, (r + 1) S / W)`` along dim 0 of the summed result, else every rank gets all
    ``S`` rows. x in the weight's dtype, on the world's device.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        world: World | None = None,
        bias: bool = False,
        scatter_output: bool = True,
        dtype=None,
        device=None,
    ):
        super().__init__()
        world, self.in_local, factory = _setup(
            self, world, in_features, out_features, "in_features", dtype, device
        )
        self.scatter_output = bool(scatter_output)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **factory))
            self.bias.sequence_parallel = self.scatter_output
        else:
            self.register_parameter("bias", None)
        _init_weight_(self.weight, in_features, world)

    @classmethod
    def from_full(
        cls,
        weight_full: torch.Tensor,
        world: World | None = None,
        bias_full: torch.Tensor | None = None,
        scatter_output: bool = True,
    ):
        """Shard a full ``nn.Linear`` weight ``[out, in]``: this rank keeps columns
        ``[r * in / W, (r + 1) * in / W)``; the bias ``[out]`` is replicated. Copies."""
        world = _resolve_world(world)
        out_f, in_f = _check_full(weight_full, bias_full)
        mod = cls(
            in_f,
            out_f,
            world,
            bias=bias_full is not None,
            scatter_output=scatter_output,
            dtype=weight_full.dtype,
            device=world.device,
        )
        r, k = world.rank, mod.in_local
        with torch.no_grad():
            mod.weight.copy_(weight_full[:, r * k : (r + 1) * k])
            if bias_full is not None:
                mod.bias.copy_(bias_full)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < (2 if self.scatter_output else 1):
            raise ValueError(
                "RowParallelLinear input must be a tensor [rows, ..., in / W] "
                f"(2-D or more with scatter_output), got {getattr(x, 'shape', x)}"
            )
        if x.shape[-1] != self.in_local:
            raise ValueError(
                f"RowParallelLinear: input has {x.shape[-1]} features, expected "
                f"in_features / world_size = {self.in_local} (input shape "
                f"{tuple(x.shape)})"
            )
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.in_local)
        W = self.world.world_size
        if self.scatter_output:
            if lead[0] % W:
                raise ValueError(
                    f"RowParallelLinear: input dim 0 ({lead[0]}) is not a multiple "
                    f"of world_size {W}; the output is scattered along it"
                )
            y = matmul_reduce_scatter(x2, self.weight, self.world, self.bias)
            return y.view(lead[0] // W, *lead[1:], self.out_features)
        _check_unfused_input("RowParallelLinear", x2, self.weight)
        y = reduce_from_tensor_parallel(F.linear(x2, self.weight), self.world)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_local}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"scatter_output={self.scatter_output}, world_size={self.world.world_size}"
        )


def sync_sequence_parallel_grads(module: nn.Module) -> int:
    """All-reduce (sum) the ``.grad`` of every parameter marked ``sequence_parallel`` in the
    row-parallel layers of ``module``, over each layer's world. Collective; returns the count."""
    n = 0
    for m in module.modules():
        if isinstance(m, RowParallelLinear):
            for p in m.parameters(recurse=False):
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    m.world.all_reduce(p.grad)
                    n += 1
    return n
