"""Pure-torch references for the MoE layer: what every fast path is tested against.

Written for clarity, not speed, and deliberately with different code from the fast paths
(per-token Python selection, an explicit capacity counter, per-expert masks), so a shared bug
is unlikely. Any floating dtype goes in and the math runs in the input dtype; tests pass
float64 and differentiate through these functions with autograd.

Routing semantics (``route``), the contract of the whole package:

1. ``logits [T, E] = x @ W^T`` in float32, or float64 when ``x`` or ``W`` is float64.
2. ``scores = softmax(logits)`` or ``sigmoid(logits)``.
3. Selection scores = ``scores + correction_bias`` (bias only here, never in the weights).
4. Group-limited (``n_group`` set): experts form ``n_group`` groups of ``E / n_group``
   consecutive ids; a group scores the sum of its two highest selection scores (its one score
   when a group holds one expert); the ``topk_group`` best groups are kept and the top-k is
   taken among their experts only.
5. **Ties**: higher selection score first, and on an exact tie the lower expert id (lower
   group id for groups). The fast router sorts stably to get the same rule; ``torch.topk``
   leaves ties unspecified, so it is not used for selection.
6. ``topk_ids[:, k]`` is the k-th choice (descending selection score): k is the *choice
   rank* the capacity rule uses.
7. Weights = the chosen *unbiased* scores; divided by their sum (+1e-20 against an underflowed
   sum) when ``norm_topk_prob`` (sigmoid too); times ``routed_scaling_factor``.
8. Capacity (``capacity_factor`` set): each expert keeps at most
   ``config.expert_capacity(T, K, E, factor)`` assignments of this rank, taken in order of
   choice rank then token (all first choices, in token order, before any second choice).
   Dropped assignments get id -1 and weight 0; kept weights are not renormalized.
9. Load balance ``aux = E * sum_e f_e * P_e``: ``f_e`` = share of the ``T*K`` assignments
   (before capacity drops) on e (no gradient), ``P_e`` = mean over tokens of the softmax
   probability / raw sigmoid score of e; with ``aux_loss_scores="normalized"``, of that
   score divided by the sum of the token's scores over all E experts (+1e-20).
   ``z = mean_t logsumexp(logits_t)^2``. Both are unscaled here and exactly 0 (no NaN, still
   differentiable) when T = 0.

Expert math: ``swiglu`` uses ``w1 [2F, H]`` with the gate rows first,
``silu(x Wg^T + bg) * (x Wu^T + bu)``; the others are ``act(x W1^T + b1)`` with ``gelu`` the exact
(erf) GELU, ``relu``, ``silu``; then ``@ W2^T + b2``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .config import ACTIVATIONS, MoEConfig, expert_capacity

__all__ = [
    "RouteResult",
    "route",
    "balance_scores",
    "expert_mlp",
    "experts",
    "shared_experts",
    "moe_layer",
    "ep_reference",
]


class RouteResult(NamedTuple):
    topk_ids: torch.Tensor  # [T, K] int64 global expert ids, -1 = capacity drop
    topk_weights: torch.Tensor  # [T, K] compute dtype, 0 where dropped
    logits: torch.Tensor  # [T, E] compute dtype
    scores: torch.Tensor  # [T, E] softmax probabilities or sigmoid scores
    aux_loss: torch.Tensor  # scalar, unscaled load-balance loss
    z_loss: torch.Tensor  # scalar, unscaled router z-loss
    counts: torch.Tensor  # [E] int64 kept assignments per expert


def _compute_dtype(*tensors) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _select_one(sel: list[float], cfg: MoEConfig, cd: torch.dtype) -> list[int]:
    """The top-k expert ids of one token, best first (ties: lower id), group-limited if set
    (a group's score, the sum of its two best, rounded to the compute dtype ``cd``)."""
    E, K = cfg.num_experts, cfg.top_k
    candidates = list(range(E))
    if cfg.n_group is not None:
        size = E // cfg.n_group
        group_score = []
        for g in range(cfg.n_group):
            members = sorted(sel[g * size : (g + 1) * size], reverse=True)
            group_score.append(float(torch.tensor(members[:2], dtype=cd).sum()))
        groups = sorted(range(cfg.n_group), key=lambda g: (-group_score[g], g))
        kept = sorted(groups[: cfg.topk_group])
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    ranked = sorted(candidates, key=lambda e: (-sel[e], e))
    return ranked[:K]


def balance_scores(scores_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The per-token scores whose mean over tokens is the load-balance ``P_e`` (rule 9)."""
    if cfg.aux_loss_scores == "raw":
        return scores_TE
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)


def route(
    x_TH: torch.Tensor,
    router_weight_EH: torch.Tensor,
    cfg: MoEConfig,
    correction_bias_E: torch.Tensor | None = None,
) -> RouteResult:
    """Reference router (see the module docstring for every rule).

    x_TH [T, H] float; router_weight_EH [E, H] float; correction_bias_E [E] float or None
    (selection only). Weights, scores and both losses keep autograd to ``x`` and the router
    weight; the ids, counts and ``f_e`` carry none.
    """
    T, H = x_TH.shape
    E, K = cfg.num_experts, cfg.top_k
    if router_weight_EH.shape != (E, H):
        raise ValueError(f"router_weight must be [{E}, {H}], got {tuple(router_weight_EH.shape)}")
    cd = _compute_dtype(x_TH, router_weight_EH)
    logits = x_TH.to(cd) @ router_weight_EH.to(cd).t()
    if cfg.score_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    sel = scores.detach()
    if correction_bias_E is not None:
        sel = sel + correction_bias_E.detach().to(cd)

    ids = torch.tensor(
        [_select_one(sel[t].tolist(), cfg, cd) for t in range(T)],
        dtype=torch.int64,
        device=x_TH.device,
    ).reshape(T, K)
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor

    # Load balance uses the choices before capacity drops.
    all_counts = torch.zeros(E, dtype=torch.int64)
    for e in ids.reshape(-1).tolist():
        all_counts[e] += 1
    f = all_counts.to(cd).to(x_TH.device) / max(T * K, 1)
    P = balance_scores(scores, cfg).sum(dim=0) / max(T, 1)
    aux = E * (f * P).sum()
    z = torch.logsumexp(logits, dim=-1).square().sum() / max(T, 1)

    keep = torch.ones(T, K, dtype=torch.bool)
    if cfg.capacity_factor is not None:
        cap = expert_capacity(T, K, E, cfg.capacity_factor)
        used = [0] * E
        for k in range(K):  # choice rank first ...
            for t in range(T):  # ... then token order
                e = int(ids[t, k])
                if used[e] < cap:
                    used[e] += 1
                else:
                    keep[t, k] = False
    keep = keep.to(x_TH.device)
    ids = torch.where(keep, ids, torch.full_like(ids, -1))
    w = torch.where(keep, w, torch.zeros_like(w))
    counts = torch.zeros(E, dtype=torch.int64)
    for e in ids.reshape(-1).tolist():
        if e >= 0:
            counts[e] += 1
    return RouteResult(ids, w, logits, scores, aux, z, counts.to(x_TH.device))


def _act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h, approximate="none")
    if activation == "relu":
        return torch.relu(h)
    if activation == "silu":
        return F.silu(h)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def expert_mlp(
    x_NH: torch.Tensor,
    w1_rows_H: torch.Tensor,
    w2_HF: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert on rows ``x_NH [N, H]``: ``w1_rows_H [2F or F, H]``, ``w2_HF [H, F]``,
    ``b1 [2F or F]``, ``b2 [H]``. Returns ``[N, H]`` in the input dtype."""
    h = x_NH @ w1_rows_H.t()
    if b1 is not None:
        h = h + b1
    if activation == "swiglu":
        Fs = w2_HF.shape[1]
        if h.shape[-1] != 2 * Fs:
            raise ValueError(f"swiglu needs w1 with 2F={2 * Fs} rows, got {h.shape[-1]}")
        h = F.silu(h[:, :Fs]) * h[:, Fs:]
    else:
        h = _act(h, activation)
    y = h @ w2_HF.t()
    if b2 is not None:
        y = y + b2
    return y


def experts(
    x_TH: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t])`` with GLOBAL weights.

    x_TH [T, H]; topk_ids [T, K] int (-1 = dropped, contributes zero; duplicates allowed);
    topk_weights [T, K]; w1_EFH [E, 2F or F, H]; w2_EHF [E, H, F]; b1 [E, 2F or F]; b2 [E, H].
    Per-expert masks: each expert runs on the rows that chose it and its weighted output is
    added into those tokens.
    """
    E = w1_EFH.shape[0]
    ids = topk_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= E):
        raise ValueError(f"topk_ids must be in [-1, {E}), got [{int(ids.min())}, {int(ids.max())}]")
    wts = topk_weights.to(x_TH.dtype)
    y = torch.zeros_like(x_TH)
    for e in range(E):
        t_idx, k_idx = (ids == e).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        out = expert_mlp(
            x_TH[t_idx],
            w1_EFH[e],
            w2_EHF[e],
            activation,
            None if b1 is None else b1[e],
            None if b2 is None else b2[e],
        )
        y = y.index_add(0, t_idx, out * wts[t_idx, k_idx].unsqueeze(1))
    return y


def shared_experts(
    x_TH: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shared experts as one dense MLP: ``w1 [2Fs or Fs, H]``, ``w2 [H, Fs]`` with
    ``Fs = MoEConfig.shared_ffn_size`` (``shared_expert_ffn_size`` or
    ``n_shared_experts * ffn_hidden_size``)."""
    return expert_mlp(x_TH, w1, w2, activation, b1, b2)


def moe_layer(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    shared_w1: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    return_route: bool = False,
):
    """The whole layer on one rank's tokens with GLOBAL expert weights.

    x [..., H]; router_weight [E, H]; w1 [E, 2F or F, H]; w2 [E, H, F]; b1/b2 optional
    expert biases; shared_w1/shared_w2 required iff ``cfg.n_shared_experts > 0``.
    Returns ``(y, aux_total)`` (``y`` like ``x``; ``aux_total = aux_loss_coef * aux +
    z_loss_coef * z``), plus the :class:`RouteResult` when ``return_route``.
    """
    H = cfg.hidden_size
    if x.shape[-1] != H:
        raise ValueError(f"x must be [..., {H}], got {tuple(x.shape)}")
    x_TH = x.reshape(-1, H)
    r = route(x_TH, router_weight, cfg, correction_bias)
    y = experts(x_TH, r.topk_ids, r.topk_weights, w1, w2, cfg.activation, b1, b2)
    if cfg.n_shared_experts > 0:
        if shared_w1 is None or shared_w2 is None:
            raise ValueError("cfg.n_shared_experts > 0 needs shared_w1 and shared_w2")
        y = y + shared_experts(x_TH, shared_w1, shared_w2, cfg.activation)
    aux_total = cfg.aux_loss_coef * r.aux_loss + cfg.z_loss_coef * r.z_loss
    y = y.reshape(x.shape)
    return (y, aux_total, r) if return_route else (y, aux_total)


def ep_reference(
    x_per_rank: list,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    shared_w1: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    return_route: bool = False,
) -> list:
    """Expert-parallel reference: ``x_per_rank[r] [T_r, H]`` with GLOBAL weights.

    Routing, capacity and the aux losses are per source rank and the expert math is per token,
    so rank r's result is exactly :func:`moe_layer` on its own tokens. Returns one
    ``(y_r, aux_total_r[, route_r])`` per rank.
    """
    return [
        moe_layer(
            x_r,
            router_weight,
            w1,
            w2,
            cfg,
            correction_bias,
            shared_w1,
            shared_w2,
            b1,
            b2,
            return_route,
        )
        for x_r in x_per_rank
    ]
