"""moe_overlap: MoE expert parallelism and dense tensor parallelism with communication hidden
inside Triton GEMM kernels, at tile granularity."""

from .config import MoEConfig
from .errors import CommTimeoutError, MissingBackendError
from .experts.fused import fused_experts
from .experts.layer import GroupedExperts, MoELayer
from .world import World, init_world, local_world

__version__ = "0.1.0"

__all__ = [
    "CommTimeoutError",
    "fused_experts",
    "MoEConfig",
    "MoELayer",
    "GroupedExperts",
    "MissingBackendError",
    "World",
    "init_world",
    "local_world",
]
