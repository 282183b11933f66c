"""Routing layout: who sends which assignment where, and how each rank's rows are tiled.

Given ``topk_ids [T, K]`` (global expert ids, -1 = dropped) on every rank of an EP world with
``El = E / W`` experts per rank, this module computes, with torch ops on the device (at one
rank on a GPU or in the interpreter: five kernels, ``kernels/moe_layout.py``, same values):

*Source side* (this rank sends):
  ``sorted_assign [T*K]``: assignment indices ``a = t*K + k`` sorted by expert (stable; kept
  ones first); position ``j`` in that order is the assignment's *slot*.
  ``slot_of [T*K]``: a -> j, or -1 for dropped assignments.
  ``chunks [C, 5]``: the remote sends, split into chunks of at most ``CHUNK`` rows that never
  cross a (destination, expert) slice: (dst rank, first slot j, rows, first dst row, flag).

*Receive side* (this rank computes its local experts on):
  rows grouped by local expert, each expert padded to a multiple of ``block_m`` so every GEMM
  M-tile belongs to one expert; inside an expert, sources in rotated order starting with this
  rank, so an expert's first tiles hold local rows that need no wait.
  ``row_tok [R]``: token index for local rows (read straight from x: no permute copy), -1 for
  rows that arrive from peers into the receive buffer, -2 for padding.
  ``row_src [R]`` (source rank or -1), ``row_local_expert [R]``, ``expert_end [El]`` (end of
  real rows), ``slice_off/slice_cnt [W, El]`` (where each source's slice starts, how long).

Host syncs. Exact sizing (``max_tokens_per_rank`` unset) reads the ``[W, E]`` count matrix
back once per layer call: the receive buffer, the GEMM output and the workspace are sized from
it (the only way to size them without a worst case). With ``max_tokens_per_rank`` set every
size is a static worst case, the kernels read the true counts on the device, and the whole
forward has no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.moe_counts import launch_count_exchange
from ..world import WorkspacePlan, World, interpreted, launch_lock
from ..world.base import SIZE_WORDS, check_size_rows, size_words

CHUNK = 64
# The layout kernels hold [128, next_pow2(E + 2)] compare tiles: past this many experts they
# would spill heavily (and past ~8190 not compile), so larger E takes the torch layout.
LAYOUT_KERNELS_MAX_E = 1022


def _cdiv(a, b):
    return -(-a // b)


@dataclass
class Layout:
    world_size: int
    rank: int
    num_experts: int
    local_experts: int
    top_k: int
    num_tokens: int
    block_m: int
    # host sizes (exact or worst case)
    rows_cap: int  # R: rows of this rank's receive layout (padded)
    rows_cap_max: int  # max over ranks (symmetric buffer size)
    slots_cap_max: int  # max over ranks of kept assignments (combine buffer rows)
    chunks_cap: int
    tiles_cap: int
    # source side
    counts: torch.Tensor  # [E] int32
    cnt_all: torch.Tensor  # [W, E] int32
    sorted_assign: torch.Tensor  # [T*K] int32
    slot_of: torch.Tensor  # [T*K] int32
    n_kept: torch.Tensor  # [1] int32
    chunks: torch.Tensor  # [chunks_cap, 5] int32
    n_chunks: torch.Tensor  # [1] int32
    # receive side
    row_tok: torch.Tensor  # [R] int32
    row_src: torch.Tensor  # [R] int32
    row_local_expert: torch.Tensor  # [R] int32
    row_slot: torch.Tensor  # [R] int32 (local rows; remote rows get theirs from producers)
    expert_end: torch.Tensor  # [El] int32
    expert_start: torch.Tensor  # [El] int32
    slice_off: torch.Tensor  # [W, El] int32
    slice_cnt: torch.Tensor  # [W, El] int32
    n_tiles: torch.Tensor  # [1] int32 (valid M-tiles)
    recv_rows: torch.Tensor  # [El] int32 real rows per local expert

    @property
    def static(self) -> bool:
        return False


def exchange_counts(counts: torch.Tensor, world: World) -> torch.Tensor:
    """All-gather the ``[E]`` int32 count vectors through symmetric memory -> ``[W, E]``."""
    W, E = world.world_size, counts.numel()
    if W == 1:
        return counts.view(1, E).clone()
    plan = WorkspacePlan()
    off = plan.add((W, E), torch.int32)
    ws = world.workspace(plan.total)
    buf = ws.view(off, (W, E), torch.int32)
    sig = None
    if world.has_puts:
        flags, sig = world.begin_op_signals(W, W)
    else:
        flags = world.begin_op(W)
    pad_local, epoch = world.ready_args()
    out = torch.empty(W, E, dtype=torch.int32, device=counts.device)
    put = (
        dict(
            sig_local=sig.local,
            sig_table=sig.ptrs,
            put_mask=world.put_mask,
            use_nvshmem=world.uses_nvshmem,
        )
        if sig is not None
        else {}
    )

    def launch(role):
        launch_count_exchange(
            counts,
            out,
            buf.local,
            buf.ptrs,
            flags.local,
            flags.ptrs,
            pad_local,
            epoch,
            world.error_buffer,
            world.rank,
            W,
            world.wait_budget,
            role,
            world.use_timer,
            **put,
        )

    world.run_fused(launch)
    world.end_op()
    return out


def build_layout(
    topk_ids: torch.Tensor,
    num_experts: int,
    world: World,
    block_m: int,
    max_tokens_per_rank: int | None = None,
    sizes: tuple[str, dict] | None = None,
) -> Layout:
    """Compute the routing layout (see module docstring). ``topk_ids [T, K]`` int.

    ``sizes``: ``(op, {name: int or dtype})`` that every rank must share (``fused_experts``
    passes its row width, dtype, experts per rank, top-k and static sizing). At W > 1 they
    travel with the count exchange, so every rank compares every rank's at no extra cost: a
    ValueError on every rank with exact sizing (the exchange's one host read), a device-side
    assert with static sizing (no host read to piggyback on)."""
    if world.world_size == 1:
        if (topk_ids.is_cuda or interpreted()) and num_experts <= LAYOUT_KERNELS_MAX_E:
            return _build_layout_one_rank_kernels(
                topk_ids, num_experts, block_m, max_tokens_per_rank
            )
        return _build_layout_one_rank(topk_ids, num_experts, block_m, max_tokens_per_rank)
    return _build_layout_world(topk_ids, num_experts, world, block_m, max_tokens_per_rank, sizes)


def _build_layout_world(
    topk_ids, num_experts, world, block_m, max_tokens_per_rank, sizes=None
) -> Layout:
    device = topk_ids.device
    W, rank, E = world.world_size, world.rank, num_experts
    El = E // W
    T, K = topk_ids.shape
    TK = T * K
    i32 = torch.int32
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = ids >= 0
    key = torch.where(valid, ids, torch.full_like(ids, E))
    order = torch.sort(key, stable=True).indices
    counts64 = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts64.scatter_add_(0, key, torch.ones_like(key))
    counts = counts64[:E].to(i32)
    n_kept = counts64[:E].sum().to(i32).view(1)
    slot_of = torch.empty(TK, dtype=torch.int64, device=device)
    slot_of[order] = torch.arange(TK, device=device)
    slot_of = torch.where(valid, slot_of, torch.full_like(slot_of, -1)).to(i32)
    send_start = torch.cumsum(counts64[:E], 0) - counts64[:E]  # [E]

    if sizes is None:
        cnt_all = exchange_counts(counts, world)  # [W, E] int32
        size_rows = None
    else:
        words = torch.tensor(size_words(*sizes), dtype=i32, device=device)
        both = exchange_counts(torch.cat([counts, words]), world)  # [W, E + SIZE_WORDS]
        cnt_all, size_rows = both[:, :E].contiguous(), both[:, E:]
    cnt_raw = cnt_all.to(torch.int64)
    # A timed-out exchange leaves -1 for the missing source (and its record in the world's error
    # buffer, raised at the op's end); zeros keep every size below non-negative meanwhile.
    cnt64 = cnt_raw.clamp(min=0)

    # ---- receive geometry of every destination d (all ranks compute all of it)
    cnt_recv = cnt64.view(W, W, El)  # [s, d, l]
    tot = cnt_recv.sum(0)  # [d, l]
    ptot = (tot + block_m - 1) // block_m * block_m
    exp_base = torch.cumsum(ptot, 1) - ptot  # [d, l]
    # rotated source order for destination d: s_i = (d + i) % W
    d_idx = torch.arange(W, device=device)
    i_idx = torch.arange(W, device=device)
    s_rot = (d_idx[:, None] + i_idx[None, :]) % W  # [d, i]
    cnt_rot = cnt_recv.permute(1, 0, 2).gather(1, s_rot[:, :, None].expand(W, W, El))  # [d,i,l]
    pre_rot = torch.cumsum(cnt_rot, 1) - cnt_rot
    inv = (i_idx[None, :] - d_idx[:, None]) % W  # position of source s in d's rotation [d, s]
    pre = pre_rot.gather(1, inv[:, :, None].expand(W, W, El))  # [d, s, l]
    slice_off_all = exp_base[:, None, :] + pre  # [d, s, l]
    rows_pad = ptot.sum(1)  # [d]

    e_ids = torch.arange(E, device=device)
    dst_of_e = e_ids // El
    l_of_e = e_ids % El
    is_remote = dst_of_e != rank
    n_ch_e = torch.where(is_remote, (counts64[:E] + CHUNK - 1) // CHUNK, 0)
    n_chunks64 = n_ch_e.sum()

    exact = max_tokens_per_rank is None
    if exact:
        # The one host sync of exact sizing (see module docstring).
        parts = [rows_pad, n_kept_all(cnt64), n_chunks64.view(1), cnt_raw.min().view(1)]
        if size_rows is not None:
            parts.append(size_rows.reshape(-1).to(torch.int64))
        host = torch.cat(parts).cpu().tolist()
        if size_rows is not None:
            rows_of_sizes = host[2 * W + 2 :]
            host = host[: 2 * W + 2]
        if host[-1] < 0:  # the count exchange timed out: raise its record, never use -1s
            world.check()
            raise RuntimeError(f"rank {rank}: the count exchange returned negative counts")
        if size_rows is not None:
            n = SIZE_WORDS
            rows = [rows_of_sizes[r * n : (r + 1) * n] for r in range(W)]
            check_size_rows(sizes[0], rank, sizes[1], rows)
        rows_cap = int(host[rank])
        rows_cap_max = int(max(host[:W]))
        slots_cap_max = int(max(host[W : 2 * W]))
        chunks_cap = max(int(host[2 * W]), 1)
    else:
        Tm = int(max_tokens_per_rank)
        # K, not min(K, El): a token may repeat an expert id (allowed), so a rank can get W*Tm*K.
        rows_cap = _cdiv(W * Tm * K + El * (block_m - 1), block_m) * block_m
        rows_cap_max = rows_cap
        slots_cap_max = Tm * K
        chunks_cap = _cdiv(Tm * K, CHUNK) + E
        # Every rank sizes its buffers from its own bound, so a peer with a larger one (or more
        # tokens than this rank's bound) would overflow them: raised here, before any write (a
        # device-side assert on the GPU, as the id range check; no host sync).
        if size_rows is not None:
            torch._assert_async(
                (size_rows == size_rows[rank : rank + 1]).all(),
                f"rank {rank}: {sizes[0]}: the ranks disagree on its sizes "
                f"({', '.join(sizes[1])}); every rank must call it with the same ones",
            )
        torch._assert_async(
            (rows_pad <= rows_cap).all() & (n_kept_all(cnt64) <= slots_cap_max).all(),
            f"rank {rank}: the receive rows or a peer's assignments exceed the static sizing of "
            f"max_tokens_per_rank={Tm}; it must be the same on every rank and bound every "
            f"rank's tokens",
        )
    tiles_cap = max(rows_cap // block_m, 1)

    # ---- source side: remote chunks (a dummy tail segment keeps output_size exact: no sync)
    n_chunks = n_chunks64.to(i32).view(1)
    ch_e = torch.repeat_interleave(
        torch.cat([e_ids, e_ids.new_zeros(1)]),
        torch.cat([n_ch_e, (chunks_cap - n_chunks64).view(1)]),
        output_size=chunks_cap,
    )
    ch_first = torch.cumsum(n_ch_e, 0) - n_ch_e
    ci = torch.arange(chunks_cap, device=device) - ch_first[ch_e]
    j0 = send_start[ch_e] + ci * CHUNK
    nrows = torch.clamp(counts64[:E][ch_e] - ci * CHUNK, 0, CHUNK)
    dst = dst_of_e[ch_e]
    dst_row = slice_off_all[dst, rank, l_of_e[ch_e]] + ci * CHUNK
    flag = rank * El + l_of_e[ch_e]
    chunks = torch.stack([dst, j0, nrows, dst_row, flag], 1).to(i32).contiguous()

    # ---- receive side of this rank
    my_off = slice_off_all[rank]  # [s, l]
    my_cnt = cnt_recv[:, rank, :]  # [s, l]
    my_tot = tot[rank]
    my_base = exp_base[rank]
    # segments in row order: for each l: W slices in rotated order, then a pad segment
    # torch.full, not torch.tensor: no host-to-device copy inside a CUDA-graph capture.
    seg_src = torch.cat([s_rot[rank], torch.full((1,), -1, device=device, dtype=s_rot.dtype)])
    seg_src = seg_src[None, :].expand(El, W + 1)
    seg_len = torch.cat([cnt_rot[rank].t(), (ptot[rank] - my_tot)[:, None]], 1)  # [l, W+1]
    seg_l = torch.arange(El, device=device)[:, None].expand(El, W + 1)
    seg_src = seg_src.reshape(-1)
    seg_len = seg_len.reshape(-1)
    seg_l = seg_l.reshape(-1)
    tail = rows_cap - rows_pad[rank]
    seg_src = torch.cat([seg_src, torch.full((1,), -1, device=device, dtype=seg_src.dtype)])
    seg_l = torch.cat([seg_l, torch.full((1,), max(El - 1, 0), device=device, dtype=seg_l.dtype)])
    seg_len = torch.cat([seg_len, tail.view(1)])
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    seg_of_row = torch.repeat_interleave(
        torch.arange(seg_len.numel(), device=device), seg_len, output_size=rows_cap
    )
    r = torch.arange(rows_cap, device=device)
    row_src = seg_src[seg_of_row]
    row_l = seg_l[seg_of_row]
    in_slice = r - seg_start[seg_of_row]
    is_local = row_src == rank
    e_of_row = rank * El + row_l
    j_local = send_start[e_of_row.clamp(max=E - 1)] + in_slice
    tok = torch.where(
        is_local,
        order.gather(0, j_local.clamp(0, max(TK - 1, 0))) // K if TK > 0 else in_slice * 0,
        torch.where(row_src >= 0, -1, -2),
    )
    row_slot = torch.where(is_local, j_local, -1)
    n_tiles = (rows_pad[rank] // block_m).to(i32).view(1)

    return Layout(
        world_size=W,
        rank=rank,
        num_experts=E,
        local_experts=El,
        top_k=K,
        num_tokens=T,
        block_m=block_m,
        rows_cap=rows_cap,
        rows_cap_max=rows_cap_max,
        slots_cap_max=max(slots_cap_max, 1),
        chunks_cap=chunks_cap,
        tiles_cap=tiles_cap,
        counts=counts,
        cnt_all=cnt_all,
        sorted_assign=order.to(i32),
        slot_of=slot_of,
        n_kept=n_kept,
        chunks=chunks,
        n_chunks=n_chunks,
        row_tok=tok.to(i32),
        row_src=row_src.to(i32),
        row_local_expert=row_l.to(i32),
        row_slot=row_slot.to(i32),
        expert_end=(my_base + my_tot).to(i32),
        expert_start=my_base.to(i32),
        slice_off=my_off.to(i32).contiguous(),
        slice_cnt=my_cnt.to(i32).contiguous(),
        n_tiles=n_tiles,
        recv_rows=my_tot.to(i32),
    )


def _one_rank_sizes(T, K, E, block_m, max_tokens_per_rank, exact):
    """``(rows_cap, slots_cap, chunks_cap)`` of a one-rank layout; ``exact()`` -> the true
    ``(padded rows, kept assignments)``, called (a host sync) only where no bound applies."""
    TK = T * K
    if max_tokens_per_rank is not None:
        Tm = int(max_tokens_per_rank)
        rows_cap = _cdiv(Tm * K + E * (block_m - 1), block_m) * block_m
        return rows_cap, Tm * K, _cdiv(Tm * K, CHUNK) + E
    if 4 * E * (block_m - 1) <= TK:
        return _cdiv(TK + E * (block_m - 1), block_m) * block_m, TK, 1
    rows_cap, slots_cap = exact()
    return rows_cap, slots_cap, 1


_ZEROS: dict = {}


def _zeros_i32(n, device):
    """Cached all-zero int32 ``[n]`` (``chunks`` and ``n_chunks`` at one rank: never written,
    and no kernel reads ``chunks`` there). Not cached while a CUDA graph is being captured."""
    device = torch.device(device)
    t = _ZEROS.get((n, device))
    if t is None:
        t = torch.zeros(n, dtype=torch.int32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ZEROS[(n, device)] = t
    return t


def _one_rank_layout(T, K, E, block_m, sizes, counts, base, end, **fields) -> Layout:
    """A one-rank :class:`Layout` from its int32 fields; ``sizes`` = (rows, slots, chunks)."""
    rows_cap, slots_cap, chunks_cap = sizes
    return Layout(
        world_size=1,
        rank=0,
        num_experts=E,
        local_experts=E,
        top_k=K,
        num_tokens=T,
        block_m=block_m,
        rows_cap=rows_cap,
        rows_cap_max=rows_cap,
        slots_cap_max=max(slots_cap, 1),
        chunks_cap=chunks_cap,
        tiles_cap=max(rows_cap // block_m, 1),
        counts=counts,
        cnt_all=counts.view(1, E),
        expert_start=base,
        expert_end=end,
        slice_off=base.view(1, E),
        slice_cnt=counts.view(1, E),
        recv_rows=counts,
        **fields,
    )


def _build_layout_one_rank_kernels(topk_ids, E, block_m, max_tokens_per_rank) -> Layout:
    """:func:`_build_layout_one_rank` in five kernel launches (``kernels/moe_layout.py``):
    the same fields and values. One int32 allocation holds every field."""
    from ..kernels.moe_layout import counts_one_rank, place_one_rank

    device = topk_ids.device
    T, K = topk_ids.shape
    TK = T * K
    ids = topk_ids.contiguous()
    if not ids.is_cuda and ids.numel() and not bool(((ids >= -1) & (ids < E)).all()):
        # (on the GPU fused_experts checks them without a sync) an id >= E would leave a
        # slot unwritten in the kernels, where the torch layout raises
        raise ValueError(f"topk_ids out of range [-1, {E})")
    with launch_lock():
        hist, cnt, BLK, EB = counts_one_rank(ids, E, interpreted())

    def exact():
        c = cnt[:E].long()
        both = torch.stack([((c + block_m - 1) // block_m * block_m).sum(), c.sum()])
        return tuple(int(v) for v in both.cpu().tolist())

    rows_cap, slots_cap, chunks_cap = _one_rank_sizes(T, K, E, block_m, max_tokens_per_rank, exact)
    sizes = dict(
        sorted_assign=TK, slot_of=TK, counts=E, expert_start=E, expert_end=E, n_kept=1,
        n_tiles=1, row_tok=rows_cap, row_src=rows_cap, row_local_expert=rows_cap,
        row_slot=rows_cap,
    )  # fmt: skip
    # Every field starts on a 64-byte boundary: Triton specializes pointer arguments on their
    # 16-byte alignment, so fields at offsets that follow T x K would make the consumer
    # kernels compile new variants whenever T changed parity.
    offs, off = {}, 0
    for k, n in sizes.items():
        offs[k] = off
        off += -(-n // 16) * 16
    flat = torch.empty(max(off, 1), dtype=torch.int32, device=device)
    out = {k: flat[offs[k] : offs[k] + n] for k, n in sizes.items()}
    with launch_lock():
        place_one_rank(ids, E, block_m, rows_cap, hist, cnt, BLK, EB, out, interpreted())
    chunks = _zeros_i32(chunks_cap * 5, device).view(chunks_cap, 5)
    return _one_rank_layout(
        T,
        K,
        E,
        block_m,
        (rows_cap, slots_cap, chunks_cap),
        out["counts"],
        out["expert_start"],
        out["expert_end"],
        sorted_assign=out["sorted_assign"],
        slot_of=out["slot_of"],
        n_kept=out["n_kept"],
        chunks=chunks,
        n_chunks=_zeros_i32(1, device),
        row_tok=out["row_tok"],
        row_src=out["row_src"],
        row_local_expert=out["row_local_expert"],
        row_slot=out["row_slot"],
        n_tiles=out["n_tiles"],
    )


def _build_layout_one_rank(topk_ids, E, block_m, max_tokens_per_rank) -> Layout:
    """:func:`build_layout` at one rank, in a third of its device ops (no exchange, no remote
    chunks, one source per expert): the layout is host-bound on small-expert shapes (measured
    on the H200, qwen3-30b-a3b: 176 small ops in the general form). Same fields, same values,
    except ``chunks``, which no kernel reads at one rank (``n_chunks`` is 0), is all zeros.

    Sizing: with ``max_tokens_per_rank`` unset the sizes are still taken without a host sync
    when the padding bound ``E * (block_m - 1)`` is at most a quarter of ``T * K`` (rows past
    the real ones are tail padding, which every kernel skips by ``n_tiles``): the sync stalls
    the GPU until the host has issued the rest of the layer (on the H200, qwen3-30b-a3b:
    15.5 ms exact against 12.6 ms static forward+backward). Otherwise exact, one sync."""
    device = topk_ids.device
    T, K = topk_ids.shape
    TK = T * K
    i32 = torch.int32
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = ids >= 0
    key = torch.where(valid, ids, E)
    order = torch.sort(key, stable=True).indices
    # scatter_add, not bincount: bincount sizes its output from a host read of the max
    cnt = torch.zeros(E + 1, dtype=torch.int64, device=device)
    cnt = cnt.scatter_add_(0, key, torch.ones_like(key))[:E]
    ends = torch.cumsum(cnt, 0)
    n_kept = ends[-1:]
    slot_of = torch.full((TK,), -1, dtype=i32, device=device)
    slot_of.scatter_(0, order, torch.arange(TK, dtype=i32, device=device))
    slot_of = torch.where(valid, slot_of, -1)
    ptot = (cnt + block_m - 1) // block_m * block_m
    pend = torch.cumsum(ptot, 0)
    base = pend - ptot
    rows_pad = pend[-1:]

    def exact():  # the one host sync of exact sizing
        return tuple(int(v) for v in torch.cat([rows_pad, n_kept]).cpu().tolist())

    rows_cap, slots_cap, chunks_cap = _one_rank_sizes(T, K, E, block_m, max_tokens_per_rank, exact)

    # rows: expert l's real rows, its padding, then the tail (segment E: the last expert's)
    seg_id = torch.repeat_interleave(
        torch.arange(E + 1, device=device),
        torch.cat([ptot, (rows_cap - rows_pad).clamp(min=0)]),
        output_size=rows_cap,
    )
    zero = cnt.new_zeros(1)
    row_l = seg_id.clamp(max=E - 1)
    in_slice = torch.arange(rows_cap, device=device) - torch.cat([base, rows_pad])[seg_id]
    is_local = in_slice < torch.cat([cnt, zero])[seg_id]
    j_local = torch.cat([ends - cnt, zero])[seg_id] + in_slice
    if TK > 0:
        tok = torch.where(is_local, order.gather(0, j_local.clamp(0, TK - 1)) // K, -2)
    else:
        tok = torch.full_like(in_slice, -2)
    cnt32 = cnt.to(i32)
    return _one_rank_layout(
        T,
        K,
        E,
        block_m,
        (rows_cap, slots_cap, chunks_cap),
        cnt32,
        base.to(i32),
        (base + cnt).to(i32),
        sorted_assign=order.to(i32),
        slot_of=slot_of,
        n_kept=n_kept.to(i32).view(1),
        chunks=torch.zeros(chunks_cap, 5, dtype=i32, device=device),
        n_chunks=torch.zeros(1, dtype=i32, device=device),
        row_tok=tok.to(i32),
        row_src=torch.where(is_local, 0, -1).to(i32),
        row_local_expert=row_l.to(i32),
        row_slot=torch.where(is_local, j_local, -1).to(i32),
        n_tiles=(rows_pad // block_m).to(i32).view(1),
    )


def n_kept_all(cnt64: torch.Tensor) -> torch.Tensor:
    """Kept assignments of every source rank, ``[W]``."""
    return cnt64.sum(1)
