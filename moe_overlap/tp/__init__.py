"""Dense tensor parallelism: fused AllGather+GEMM / GEMM+ReduceScatter and parallel linears."""

from .linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
    sync_sequence_parallel_grads,
)
from .ops import all_gather_matmul, matmul_reduce_scatter

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "all_gather_matmul",
    "copy_to_tensor_parallel",
    "matmul_reduce_scatter",
    "reduce_from_tensor_parallel",
    "sync_sequence_parallel_grads",
]
