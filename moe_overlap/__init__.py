"""moe_overlap: MoE expert parallelism and dense tensor parallelism with communication hidden
inside Triton GEMM kernels, at tile granularity."""

from .config import MoEConfig
from .errors import CommTimeoutError, MissingBackendError
from .experts.fused import fused_experts
from .experts.layer import GroupedExperts, MoELayer
from .hybrid import HybridBlock
from .tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_matmul,
    matmul_reduce_scatter,
)
from .world import World, init_world, local_world

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "CommTimeoutError",
    "GroupedExperts",
    "HybridBlock",
    "MissingBackendError",
    "MoEConfig",
    "MoELayer",
    "RowParallelLinear",
    "World",
    "all_gather_matmul",
    "fused_experts",
    "init_world",
    "local_world",
    "matmul_reduce_scatter",
]
