"""The one-rank routing layout in five small kernels (a stable counting sort by expert).

``moe_overlap.dispatch.layout`` builds the layout with torch ops: at one rank about 45 of them
(a radix sort, scatters, cumsums, a repeat_interleave ...), each its own launch. On the H200
(qwen3-30b-a3b, 16k tokens, top-8, 2026-12-04) a forward+backward step ran 161 kernels and its
GPU sat idle ~0.7 ms between them; the layout's ops were a third of those launches. Here:

1. ``_hist_kernel`` (one program per block of ``BLK`` assignments): per-block histogram of the
   sort key (the expert id; ``E`` for dropped assignments) -> ``hist [NB, E + 1]``.
2. ``_scan_kernel`` (one program per ``EC`` keys): exclusive prefix of ``hist`` over blocks,
   in place, and each key's total -> ``cnt [E + 1]``; then ``_key_start_kernel`` (one
   program) appends each key's first slot.
3. ``_place_kernel`` (per block): an assignment's slot is ``key start + earlier blocks' count
   of its key + its rank among the block's equal keys`` (a ``BLK x BLK`` compare, so the order
   inside an expert is the assignment order: the same stable order as ``torch.sort``;
   ``BLK`` 128 keeps that tile at 64 values a thread) ->
   ``sorted_assign``, ``slot_of``; program 0 also writes the per-expert fields.
4. ``_rows_kernel`` (per tile of ``BM`` receive rows, which share one expert): the tile's
   expert from the padded ends, each row's token through ``sorted_assign`` -> ``row_tok``,
   ``row_src``, ``row_local_expert``, ``row_slot``.

The padded per-expert prefix sums (``E + 1`` values) are recomputed by every program of
steps 3 and 4 instead of in another launch. Every value equals the torch layout's
(``tests/test_layout.py``).
"""

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _keys(ids_ptr, a, TK, E):
    """Sort keys of assignments ``a``: the expert id, ``E`` if dropped, ``E + 1`` past ``TK``."""
    am = a < TK
    e = tl.load(ids_ptr + a, mask=am, other=-1).to(tl.int32)
    return tl.where(am, tl.where(e >= 0, e, E), E + 1)


@triton.jit
def _hist_kernel(ids_ptr, hist_ptr, TK, E, BLK: tl.constexpr, EB: tl.constexpr):
    blk = tl.program_id(0)
    key = _keys(ids_ptr, blk * BLK + tl.arange(0, BLK), TK, E)
    bins = tl.arange(0, EB)
    h = tl.sum((key[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + blk * (E + 1) + bins, h, mask=bins <= E)


@triton.jit
def _scan_kernel(hist_ptr, cnt_ptr, NB, E, RB: tl.constexpr, EC: tl.constexpr):
    cols = tl.program_id(0) * EC + tl.arange(0, EC)
    cm = cols <= E
    carry = tl.zeros((EC,), tl.int32)
    for b0 in range(0, NB, RB):
        rows = b0 + tl.arange(0, RB)
        m = (rows < NB)[:, None] & cm[None, :]
        ptr = hist_ptr + rows[:, None] * (E + 1) + cols[None, :]
        h = tl.load(ptr, mask=m, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(ptr, incl - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(cnt_ptr + cols, carry, mask=cm)


@triton.jit
def _expert_prefix(cnt_ptr, E, BM, EB: tl.constexpr):
    """From ``cnt [E + 1]``: (keys, key start in slot order, padded base row, count, padded
    end) as ``[EB]`` vectors (the dropped key ``E`` starts at the kept total)."""
    e = tl.arange(0, EB)
    cnt = tl.load(cnt_ptr + e, mask=e <= E, other=0)
    start = tl.cumsum(cnt, axis=0) - cnt
    ptot = tl.where(e < E, (cnt + BM - 1) // BM * BM, 0)
    pend = tl.cumsum(ptot, axis=0)
    return e, start, pend - ptot, cnt, pend


@triton.jit
def _place_kernel(
    ids_ptr,
    hist_ptr,
    cnt_ptr,
    sorted_ptr,
    slot_of_ptr,
    counts_ptr,
    start_ptr,
    end_ptr,
    n_kept_ptr,
    n_tiles_ptr,
    TK,
    E,
    BM,
    BLK: tl.constexpr,
    EB: tl.constexpr,
):
    blk = tl.program_id(0)
    i = tl.arange(0, BLK)
    a = blk * BLK + i
    key = _keys(ids_ptr, a, TK, E)
    # rank among the block's equal keys that come earlier (stable)
    j_ = tl.arange(0, BLK)
    same = (key[None, :] == key[:, None]) & (j_[None, :] < i[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    ok = key <= E
    kc = tl.minimum(key, E)
    first = tl.load(hist_ptr + blk * (E + 1) + kc, mask=ok, other=0)
    start = tl.load(cnt_ptr + E + 1 + kc, mask=ok, other=0)  # key starts, see the launcher
    slot = start + first + rank
    tl.store(sorted_ptr + slot, a, mask=ok)
    tl.store(slot_of_ptr + a, tl.where(key < E, slot, -1), mask=a < TK)
    if blk == 0:
        e, _, base, cnt, pend = _expert_prefix(cnt_ptr, E, BM, EB)
        em = e < E
        tl.store(counts_ptr + e, cnt, mask=em)
        tl.store(start_ptr + e, base, mask=em)
        tl.store(end_ptr + e, base + cnt, mask=em)
        kept = tl.sum(tl.where(em, cnt, 0), axis=0)
        tl.store(n_kept_ptr, kept)
        tl.store(n_tiles_ptr, tl.max(tl.where(em, pend, 0), axis=0) // BM)


@triton.jit
def _key_start_kernel(cnt_ptr, E, EB: tl.constexpr):
    """``cnt_ptr[E + 1 + k]`` = first slot of key ``k`` (the exclusive prefix of ``cnt``)."""
    e = tl.arange(0, EB)
    cnt = tl.load(cnt_ptr + e, mask=e <= E, other=0)
    tl.store(cnt_ptr + E + 1 + e, tl.cumsum(cnt, axis=0) - cnt, mask=e <= E)


@triton.jit
def _rows_kernel(
    cnt_ptr,
    sorted_ptr,
    row_tok_ptr,
    row_src_ptr,
    row_l_ptr,
    row_slot_ptr,
    R,
    E,
    K_top,
    BM,
    BR: tl.constexpr,
    EB: tl.constexpr,
    PER_TILE: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    e, start, base, cnt, pend = _expert_prefix(cnt_ptr, E, BM, EB)
    if PER_TILE:
        # BR == BM: experts are padded to BM, so the program's rows share one expert (E: the
        # tail), found once from the padded ends
        r0 = tl.program_id(0) * BR
        seg = tl.sum(((pend <= r0) & (e < E)).to(tl.int32), axis=0)
        sel = e == seg
        base_r = tl.sum(tl.where(sel, base, 0), axis=0)
        cnt_r = tl.sum(tl.where(sel, cnt, 0), axis=0)
        start_r = tl.sum(tl.where(sel, start, 0), axis=0)
    else:
        # the row's expert: how many experts' padded ranges end at or before it
        seg = tl.sum(((pend[None, :] <= r[:, None]) & (e < E)[None, :]).to(tl.int32), axis=1)
        sel = e[None, :] == seg[:, None]
        base_r = tl.sum(tl.where(sel, base, 0), axis=1)
        cnt_r = tl.sum(tl.where(sel, cnt, 0), axis=1)
        start_r = tl.sum(tl.where(sel, start, 0), axis=1)
    in_slice = r - base_r
    seg = seg + tl.zeros_like(r)  # a [BR] vector in both branches
    local = (seg < E) & (in_slice < cnt_r)
    j = start_r + in_slice
    a = tl.load(sorted_ptr + j, mask=rm & local, other=0)
    tl.store(row_tok_ptr + r, tl.where(local, a // K_top, -2), mask=rm)
    tl.store(row_src_ptr + r, tl.where(local, 0, -1), mask=rm)
    tl.store(row_l_ptr + r, tl.minimum(seg, E - 1), mask=rm)
    tl.store(row_slot_ptr + r, tl.where(local, j, -1), mask=rm)


def counts_one_rank(topk_ids: torch.Tensor, E: int, interpreted: bool = False):
    """Steps 1-2: ``(hist [NB, E + 1] int32 exclusive over blocks, cnt [2 (E + 1)] int32)``;
    ``cnt[:E]`` are the experts' counts, ``cnt[E]`` the dropped ones, ``cnt[E + 1:]`` each
    key's first slot. ``topk_ids``: ``[T, K]`` int32/int64, contiguous."""
    ids = topk_ids.reshape(-1)
    TK = ids.numel()
    BLK = 32 if interpreted else 128
    NB = max(triton.cdiv(TK, BLK), 1)
    EB = triton.next_power_of_2(E + 2)
    EC = 16 if interpreted else 32
    hist = torch.empty(NB, E + 1, dtype=torch.int32, device=ids.device)
    cnt = torch.empty(2 * (E + 1), dtype=torch.int32, device=ids.device)
    launch(_hist_kernel, (NB,), ids, hist, TK, E, BLK=BLK, EB=EB, num_warps=8)
    RB = 16 if interpreted else 64
    launch(_scan_kernel, (triton.cdiv(E + 1, EC),), hist, cnt, NB, E, RB=RB, EC=EC)
    launch(_key_start_kernel, (1,), cnt, E, EB=EB)
    return hist, cnt, BLK, EB


def place_one_rank(topk_ids, E, block_m, rows_cap, hist, cnt, BLK, EB, out, interpreted=False):
    """Steps 3-4 into the int32 tensors of ``out`` (keys ``sorted_assign``, ``slot_of``,
    ``counts``, ``expert_start``, ``expert_end``, ``n_kept``, ``n_tiles``, ``row_tok``,
    ``row_src``, ``row_local_expert``, ``row_slot``)."""
    ids = topk_ids.reshape(-1)
    TK = ids.numel()
    NB = hist.shape[0]
    K = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    launch(
        _place_kernel,
        (NB,),
        ids,
        hist,
        cnt,
        out["sorted_assign"],
        out["slot_of"],
        out["counts"],
        out["expert_start"],
        out["expert_end"],
        out["n_kept"],
        out["n_tiles"],
        TK,
        E,
        block_m,
        BLK=BLK,
        EB=EB,
        num_warps=4,
    )
    if rows_cap:
        # one program per BM-row tile where BM is a power of two (always, from the configs)
        per_tile = block_m & (block_m - 1) == 0 and block_m <= 256
        BR = block_m if per_tile else (32 if interpreted else 128)
        launch(
            _rows_kernel,
            (triton.cdiv(rows_cap, BR),),
            cnt,
            out["sorted_assign"],
            out["row_tok"],
            out["row_src"],
            out["row_local_expert"],
            out["row_slot"],
            rows_cap,
            E,
            max(K, 1),
            block_m,
            BR=BR,
            EB=EB,
            PER_TILE=per_tile,
            num_warps=4,
        )
