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


def _tensor(name, t, dims):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def _same_place(ref_name, ref, world, **others):
    for name, t in others.items():
        if t is None:
            continue
        if t.dtype != ref.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if ref.device != world.device:
        raise ValueError(f"{ref_name} is on {ref.device} but the world is on {world.device}")


def check_layer0_args(x, layout, w1, world, activation, b1=None) -> None:
    """:func:`moe_overlap.experts.fused.layer0`'s arguments against the ``layout`` they run
    on: x ``[T, H]`` with the layout's T; w1 ``[El, 2F or F, H]`` with its El; b1 ``[El, 2F or
    F]``; all in x's dtype, on x's device (the world's)."""
    _tensor("x", x, 2)
    _tensor("w1", w1, 3)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    T, H = x.shape
    El = layout.local_experts
    if T != layout.num_tokens:
        raise ValueError(f"x has {T} rows but the layout was built for {layout.num_tokens} tokens")
    rows = w1.shape[1]
    if w1.shape[0] != El or w1.shape[2] != H or (activation == "swiglu" and rows % 2):
        what = "[El, 2F, H]" if activation == "swiglu" else "[El, F, H]"
        raise ValueError(f"w1 must be {what} with El={El}, H={H}, got {tuple(w1.shape)}")
    if b1 is not None:
        _tensor("b1", b1, 2)
        if tuple(b1.shape) != (El, rows):
            raise ValueError(f"b1 must be [{El}, {rows}], got {tuple(b1.shape)}")
    _same_place("x", x, world, w1=w1, b1=b1)


def check_layer1_args(h, layout, topk_weights, w2, world, b2=None) -> None:
    """:func:`moe_overlap.experts.fused.layer1`'s arguments: h ``[R, F]`` as layer 0 returned
    it for ``layout``; topk_weights ``[T, K]`` of the layout's tokens; w2 ``[El, H, F]``; b2
    ``[El, H]``; all but topk_weights in h's dtype; everything on h's device (the world's)."""
    _tensor("h", h, 2)
    _tensor("topk_weights", topk_weights, 2)
    _tensor("w2", w2, 3)
    R, F = h.shape
    El = layout.local_experts
    if R != layout.rows_cap:
        raise ValueError(
            f"h must have the layout's {layout.rows_cap} rows (layer0's output), got {R}"
        )
    if tuple(topk_weights.shape) != (layout.num_tokens, layout.top_k):
        raise ValueError(
            f"topk_weights must be [{layout.num_tokens}, {layout.top_k}], "
            f"got {tuple(topk_weights.shape)}"
        )
    if w2.shape[0] != El or w2.shape[2] != F:
        raise ValueError(f"w2 must be [El={El}, H, F={F}], got {tuple(w2.shape)}")
    if b2 is not None:
        _tensor("b2", b2, 2)
        if tuple(b2.shape) != (El, w2.shape[1]):
            raise ValueError(f"b2 must be [{El}, {w2.shape[1]}], got {tuple(b2.shape)}")
    _same_place("h", h, world, w2=w2, b2=b2)
    if topk_weights.device != h.device:
        raise ValueError(f"topk_weights is on {topk_weights.device} but h is on {h.device}")
