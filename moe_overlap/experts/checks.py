"""Argument checks shared by every experts implementation (fused and baseline): one place for
the shapes, dtypes and devices of ``(x, topk_ids, topk_weights, w1, w2, b1, b2)``, so both
paths refuse the same bad input with the same message, before any launch or collective."""

from __future__ import annotations

import torch

from ..config import ACTIVATIONS

_SIGNED_INTS = (torch.int8, torch.int16, torch.int32, torch.int64)


def check_expert_args(x, topk_ids, topk_weights, w1, w2, activation, b1=None, b2=None, world=None):
    """Validate the experts' arguments; returns ``(T, H, F, El, K)``.

    x ``[T, H]`` float; topk_ids ``[T, K]`` integer (K >= 1); topk_weights ``[T, K]`` float;
    w1 ``[El, 2F, H]`` for swiglu else ``[El, F, H]``; w2 ``[El, H, F]``; b1 ``[El, 2F or F]``;
    b2 ``[El, H]``; weights and biases in x's dtype; everything on x's device (and the world's).
    """
    for name, t in (
        ("x", x),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("w1", w1),
        ("w2", w2),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if topk_ids.dtype not in _SIGNED_INTS:
        # unsigned ids cannot hold -1 (dropped), and their range checks wrap (uint8 -1 is 255)
        raise TypeError(f"topk_ids must be a signed integer tensor, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T={T}, K >= 1], got {tuple(topk_ids.shape)}")
    K = topk_ids.shape[1]
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (T, K):
        raise ValueError(
            f"topk_weights must be [T, K] = ({T}, {K}), got {tuple(topk_weights.shape)}"
        )
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w1 must be [El, 2F or F, H] and w2 [El, H, F]; got "
            f"{tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    El, H2, F = w2.shape
    if El < 1:
        raise ValueError(f"w1 and w2 hold no experts (w2 is {tuple(w2.shape)}): El must be >= 1")
    rows = 2 * F if activation == "swiglu" else F
    if tuple(w1.shape) != (El, rows, H):
        raise ValueError(
            f"w1 must be [El={El}, {rows}, H={H}] for activation {activation!r}, "
            f"got {tuple(w1.shape)}"
        )
    if H2 != H:
        raise ValueError(f"w2 must be [El, H={H}, F], got {tuple(w2.shape)} (hidden size mismatch)")
    for name, b, shape in (("b1", b1, (El, rows)), ("b2", b2, (El, H))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name} must be {list(shape)}, got {got}")
    for name, t in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
    for name, t in (
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("w1", w1),
        ("w2", w2),
        ("b1", b1),
        ("b2", b2),
    ):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if world is not None and x.device != world.device:
        raise ValueError(f"x is on {x.device} but the world is on {world.device}")
    return T, H, F, El, K
