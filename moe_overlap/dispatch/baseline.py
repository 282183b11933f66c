"""``baseline_experts``: the plain (unfused) expert-parallel path, and ``impl="baseline"``.

What a careful eager implementation does, for comparison and as a fallback:

1. Drop ``-1`` ids; sort the remaining assignments by global expert id (stable, so inside an
   expert the rows keep (token, k) order). Experts ``[d*El, (d+1)*El)`` live on rank d, so the
   sorted rows are already split by destination.
2. ``world.all_to_all`` the local expert ids, then the rows. The split sizes must be known on
   the host, so this path syncs the host by design (the id range check, which every rank
   agrees on before any exchange so a bad rank cannot leave its peers waiting; the send
   counts; the per-expert row counts).
3. Regroup the received rows by local expert (stable sort) and run the experts:
   ``torch._grouped_mm`` when its rules allow (CUDA, bf16, 16-byte-aligned row strides: H, the
   w1 rows and F multiples of 8), else one matmul per local expert. Every local expert runs,
   even on zero rows, so every weight gets a (zero) gradient and ``w.grad`` is never ``None``.
4. ``all_to_all`` the outputs back, scatter them to their (token, k) slot (no accumulation),
   and sum ``w_k * out_k`` over k in increasing k order in fp32 (fp64 for fp64 input): the same
   inputs give bitwise the same output.

Autograd: the two all_to_alls are an ``autograd.Function`` whose backward is the reverse
all_to_all, so ``x``, ``topk_weights``, ``w1``, ``w2``, ``b1``, ``b2`` all get gradients. The
backward is collective: every rank must run backward through this op (SPMD; a rank with no
tokens still does, with empty tensors) and the ranks must agree on which inputs require grad.

Trap: emulated worlds run ranks as threads. On the CPU autograd runs backward on the calling
thread, so host collectives inside backward work. On CUDA autograd runs every thread's backward
nodes on one device worker thread, so a host barrier in backward can never be met; the backward
raises a clear error there instead of hanging (emulated CUDA world with W > 1 only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..experts.checks import check_expert_args

__all__ = ["baseline_experts", "grouped_linear", "grouped_mm_usable"]


class _AllToAllRows(torch.autograd.Function):
    """``rows [N, ...]`` split by ``send_splits`` -> concatenated rows received from each rank."""

    @staticmethod
    def forward(ctx, rows, world, send_splits, recv_splits):
        ctx.world = world
        ctx.send_splits = send_splits
        ctx.recv_splits = recv_splits
        recv = world.all_to_all(list(rows.split(send_splits)))
        for s, (r, n) in enumerate(zip(recv, recv_splits)):
            if r.shape[0] != n:
                raise RuntimeError(f"all_to_all: expected {n} rows from rank {s}, got {r.shape[0]}")
        return torch.cat(recv).reshape(sum(recv_splits), *rows.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        world = ctx.world
        if (
            getattr(world, "backend", None) == "emulated"
            and grad.device.type == "cuda"
            and world.world_size > 1
        ):
            raise RuntimeError(
                "baseline_experts backward is not supported on an emulated multi-rank CUDA "
                "world: autograd runs all ranks' CUDA backward on one thread, so the reverse "
                "all_to_all's host barrier can never be met. Use the CPU emulated world, a real "
                "world, or world_size 1."
            )
        back = world.all_to_all(list(grad.contiguous().split(ctx.recv_splits)))
        g = torch.cat(back).reshape(sum(ctx.send_splits), *grad.shape[1:])
        return g, None, None, None


def _exchange(rows, world, send_splits, recv_splits):
    if world is None or world.world_size == 1:
        return rows
    return _AllToAllRows.apply(rows, world, send_splits, recv_splits)


def grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm(x [N, K], w [G, Nout, K]^T)`` is allowed for these operands."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    # Row strides and the per-group base of w must be 16-byte aligned (8 bf16 elements).
    K, Nout = x.shape[1], w.shape[1]
    if K % 8 or Nout % 8:
        return False
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


_GROUPED_MM_BROKEN: set = set()


def grouped_linear(
    x_NK: torch.Tensor,
    w_GOK: torch.Tensor,
    counts: list[int],
    b_GO: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
):
    """``out[rows of group g] = x[rows] @ w[g]^T (+ b[g])`` for rows grouped contiguously.

    x_NK [N, K] rows sorted by group; w_GOK [G, O, K]; counts: G host ints summing to N;
    b_GO [G, O] optional; group_ids [N] int64 (needed with a bias on the grouped_mm path).
    """
    G = w_GOK.shape[0]
    key = (x_NK.device, tuple(w_GOK.shape[1:]))
    if grouped_mm_usable(x_NK, w_GOK) and key not in _GROUPED_MM_BROKEN:
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        try:
            out = torch._grouped_mm(
                x_NK.contiguous(), w_GOK.transpose(-2, -1), offs=offs.to(x_NK.device)
            )
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_BROKEN.add(key)  # a rule we did not know about: loop from now on
        else:
            if b_GO is not None:
                out = out + b_GO[group_ids]
            return out
    # unbind, not w_GOK[g]: each indexed slice's backward writes a zero tensor the size of the
    # whole stack and adds it into the gradient (G times); unbind's backward stacks once.
    w_g = w_GOK.unbind(0)
    b_g = None if b_GO is None else b_GO.unbind(0)
    outs = []
    start = 0
    for g in range(G):
        rows = x_NK[start : start + counts[g]]
        o = rows @ w_g[g].t()
        if b_g is not None:
            o = o + b_g[g]
        outs.append(o)
        start += counts[g]
    return torch.cat(outs) if outs else x_NK.new_zeros((0, w_GOK.shape[1]))


def _check(x, topk_ids, topk_weights, w1, w2, activation, b1, b2, world):
    check_expert_args(x, topk_ids, topk_weights, w1, w2, activation, b1, b2, world=world)


def baseline_experts(
    x_TH: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    world=None,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts of an EP world with plain all_to_alls: ``y[t] = sum_k w[t,k] * expert_id(x[t])``.

    x_TH [T, H] float (T may be 0, and may differ per rank); topk_ids [T, K] int global expert
    ids in [-1, El*W) (-1 = dropped, contributes zero); topk_weights [T, K] float; w1 LOCAL
    [El, 2F or F, H] (swiglu: gate rows then up rows); w2 LOCAL [El, H, F]; b1 [El, 2F or F];
    b2 [El, H]; world: a moe_overlap World (``None`` = one rank, no communication). The global
    id of local expert i is ``world.rank * El + i``. Returns y [T, H] in x's dtype.
    Collective: every rank of the world must call it (and its backward).
    """
    _check(x_TH, topk_ids, topk_weights, w1, w2, activation, b1, b2, world)
    W = 1 if world is None else world.world_size
    rank = 0 if world is None else world.rank
    T, H = x_TH.shape
    K = topk_ids.shape[1]
    El = w1.shape[0]
    E = El * W
    dev = x_TH.device

    ids = topk_ids.to(torch.int64).reshape(-1)  # assignment a = t*K + k
    lo, hi = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    bad = lo < -1 or hi >= E
    # Agree on the verdict first: a rank that raised alone would leave its peers waiting in the
    # all_to_all below.
    if W > 1:
        bad_ranks = [r for r, (v,) in enumerate(world.all_gather_ints([int(bad)])) if v]
    else:
        bad_ranks = [rank] if bad else []
    if bad_ranks:
        mine = f"; this rank's ids span [{lo}, {hi}]" if bad else ""
        raise ValueError(
            f"topk_ids must be in [-1, {E}) (E = El*W = {El}*{W}); out of range on rank(s) "
            f"{bad_ranks}{mine}"
        )

    # 1. Valid assignments sorted by expert; destination runs are contiguous.
    valid = (ids >= 0).nonzero(as_tuple=True)[0]
    order = torch.sort(ids[valid], stable=True).indices
    a_sorted = valid[order]  # assignment index of each sorted row
    e_sorted = ids[a_sorted]
    dest = torch.div(e_sorted, El, rounding_mode="floor")
    send_counts = torch.zeros(W, dtype=torch.int64, device=dev)
    send_counts.scatter_add_(0, dest, torch.ones_like(dest))
    send_splits = send_counts.tolist()

    # 2. Exchange the local expert ids (their sizes tell each rank what it receives), then
    #    the rows.
    lid = e_sorted - dest * El
    if W > 1:
        lid_parts = world.all_to_all(list(lid.split(send_splits)))
        recv_splits = [int(p.shape[0]) for p in lid_parts]
        recv_lid = torch.cat(lid_parts)
    else:
        recv_splits, recv_lid = send_splits, lid
    rows = x_TH[torch.div(a_sorted, K, rounding_mode="floor")]
    recv_rows = _exchange(rows, world, send_splits, recv_splits)

    # 3. Group the received rows by local expert and run the experts.
    g_order = torch.sort(recv_lid, stable=True).indices
    g_lid = recv_lid[g_order]
    xg = recv_rows[g_order]
    g_counts_t = torch.zeros(El, dtype=torch.int64, device=dev)
    g_counts_t.scatter_add_(0, g_lid, torch.ones_like(g_lid))
    g_counts = g_counts_t.tolist()
    h = grouped_linear(xg, w1, g_counts, b1, g_lid)
    if activation == "swiglu":
        Fw = w2.shape[2]
        h = F.silu(h[:, :Fw]) * h[:, Fw:]
    elif activation == "gelu":
        h = F.gelu(h, approximate="none")
    elif activation == "relu":
        h = torch.relu(h)
    else:
        h = F.silu(h)
    og = grouped_linear(h, w2, g_counts, b2, g_lid)
    # Undo the grouping with a gather by the inverse permutation.
    inv = torch.empty_like(g_order)
    inv.scatter_(0, g_order, torch.arange(g_order.numel(), device=dev))
    out_recv = og[inv]

    # 4. Send the outputs home and reduce over k in a fixed order.
    out_sorted = _exchange(out_recv, world, recv_splits, send_splits)
    slots = x_TH.new_zeros((T * K, H)).index_copy(0, a_sorted, out_sorted).view(T, K, H)
    acc = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
    wts = topk_weights.to(acc)
    y = x_TH.new_zeros((T, H), dtype=acc)
    for k in range(K):
        y = y + wts[:, k : k + 1] * slots[:, k].to(acc)
    return y.to(x_TH.dtype)
