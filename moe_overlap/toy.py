"""``push_allreduce``: the toy fused op (see ``moe_overlap.kernels.toy_allreduce``).

Each rank pushes its tiles into every peer's symmetric buffer and raises one flag per
(source, tile); each consumer tile waits for its W flags and sums in rank order. Used by the
quickstart and the foundation tests; it is not faster than NCCL and is not meant to be.

>>> from moe_overlap.testing import spawn
>>> import torch
>>> outs = spawn(2, lambda w: push_allreduce(torch.full((3, 5), w.rank + 1.0), w))
>>> outs[0][0, 0].item(), outs[1][2, 4].item()
(3.0, 3.0)
"""

from __future__ import annotations

import torch

from .kernels.toy_allreduce import launch_push_allreduce
from .world import WorkspacePlan, World

_BLOCK = (16, 32)


def push_allreduce(x: torch.Tensor, world: World) -> torch.Tensor:
    """Sum of ``x`` over all ranks of ``world``; ``x [M, N]`` float, same shape on every rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, N], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.device != world.device:
        raise ValueError(f"x is on {x.device} but the world is on {world.device}")
    x = x.contiguous()
    M, N = x.shape
    W = world.world_size
    plan = WorkspacePlan()
    off = plan.add((W, M, N), x.dtype)
    ws = world.workspace(plan.total)
    buf = ws.view(off, (W, M, N), x.dtype)
    n_tiles = -(-M // _BLOCK[0]) * -(-N // _BLOCK[1])
    flags = world.begin_op(W * n_tiles)
    pad_local, epoch = world.ready_args()
    out = torch.empty_like(x)

    def launch(role):
        launch_push_allreduce(
            x,
            out,
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
            role,
            world.use_timer,
            block=_BLOCK,
        )

    if M * N:
        world.run_fused(launch)
    world.end_op()
    return out
