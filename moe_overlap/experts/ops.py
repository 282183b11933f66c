"""``torch.library`` custom ops over the fused experts, so ``torch.compile`` can trace models
that use them.

A World is not a schema type: ops carry the name :func:`moe_overlap.world.register_world`
gave it (as PyTorch's symm_mem ops carry a group name).

The eager path (``_FusedExpertsFn``) saves the forward's intermediates (rows gathered for the
weight gradients, pre-activations, expert outputs); their sizes depend on the routing, which a
traced graph cannot hold as static shapes without a worst case. The compiled path therefore
saves only the op's inputs and the backward op re-runs the forward kernels to rebuild what it
needs (the same trade as activation checkpointing: one more forward, no data-dependent shapes
in the graph). Fake implementations return the static shapes of the outputs.
"""

from __future__ import annotations

import torch

from ..world import get_world
from . import fused


def _layout(x, topk_ids, w2, world_name, max_tokens_per_rank, agree=False):
    world = get_world(world_name)
    E = w2.shape[0] * world.world_size
    sizes = fused.expert_sizes(x, w2.shape[0], topk_ids.shape[1], max_tokens_per_rank)
    if agree:
        world.agree("fused_experts", **sizes)
    pinned = fused.tuning.pinned(
        world.device, x.dtype, x.shape[1], w2.shape[2], E, topk_ids.shape[1]
    )
    layout = fused.dispatch_layout(topk_ids, E, world, max_tokens_per_rank or None, pinned, sizes)
    return world, layout


def _opt(t):
    return None if t is None or t.numel() == 0 else t


@torch.library.custom_op("moe_overlap::fused_experts", mutates_args=())
def fused_experts_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    world_name: str,
    activation: str,
    max_tokens_per_rank: int,
) -> torch.Tensor:
    world, layout = _layout(x, topk_ids, w2, world_name, max_tokens_per_rank, agree=True)
    y, _ = fused._forward_impl(
        x.contiguous(), topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad=False
    )
    return y


@fused_experts_op.register_fake
def _(x, topk_ids, topk_weights, w1, w2, b1, b2, world_name, activation, max_tokens_per_rank):
    return x.new_empty(x.shape)


@torch.library.custom_op("moe_overlap::fused_experts_backward", mutates_args=())
def fused_experts_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    world_name: str,
    activation: str,
    max_tokens_per_rank: int,
) -> list[torch.Tensor]:
    world, layout = _layout(x, topk_ids, w2, world_name, max_tokens_per_rank)
    _, saved = fused._forward_impl(
        x.contiguous(), topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad=True
    )
    dx, dw, d1, d2, db1, db2 = fused._backward_impl(
        dy, saved, topk_weights, w1, w2, b1, b2, world, layout, activation, x.dtype
    )
    # Two distinct empties: outputs of a custom op may not alias each other. Contiguous, as
    # the fake below says (dx follows x's layout otherwise).
    return [
        dx.contiguous(),
        dw.contiguous(),
        d1.contiguous(),
        d2.contiguous(),
        x.new_empty(0) if db1 is None else db1.contiguous(),
        x.new_empty(0) if db2 is None else db2.contiguous(),
    ]


@fused_experts_backward_op.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w2, b1, b2, world_name, activation, max_tokens_per_rank):
    # Contiguous, as the real op's gradients are (empty_like would keep a transposed input's
    # strides, and inductor checks the real outputs against these).
    return [
        x.new_empty(x.shape),
        topk_weights.new_empty(topk_weights.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
        x.new_empty(0) if b1 is None else b1.new_empty(b1.shape),
        x.new_empty(0) if b2 is None else b2.new_empty(b2.shape),
    ]


def _setup(ctx, inputs, output):
    x, topk_ids, topk_weights, w1, w2, b1, b2, world_name, activation, mt = inputs
    ctx.save_for_backward(
        x,
        topk_ids,
        topk_weights,
        w1,
        w2,
        b1 if b1 is not None else x.new_empty(0),
        b2 if b2 is not None else x.new_empty(0),
    )
    ctx.meta = (world_name, activation, mt)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w1, w2, b1, b2 = ctx.saved_tensors
    world_name, activation, mt = ctx.meta
    dx, dw, d1, d2, db1, db2 = fused_experts_backward_op(
        dy, x, topk_ids, topk_weights, w1, w2, _opt(b1), _opt(b2), world_name, activation, mt
    )
    return dx, None, dw, d1, d2, _opt(db1), _opt(db2), None, None, None


fused_experts_op.register_autograd(_backward, setup_context=_setup)
