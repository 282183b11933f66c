"""Fused MoE experts: dispatch -> grouped GEMM + activation (layer 0), grouped GEMM -> combine
(layer 1), and their backward built from the same kernels in mirrored roles.

>>> import torch, moe_overlap as mo
>>> T, H, F, E, K = 5, 8, 6, 4, 2
>>> x = torch.randn(T, H)
>>> ids = torch.tensor([[0, 1], [2, 3], [1, -1], [0, 0], [3, 2]])
>>> w = torch.rand(T, K)
>>> w1, w2 = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
>>> y = mo.fused_experts(x, ids, w, w1, w2)          # single-rank world, SwiGLU
>>> y.shape
torch.Size([5, 8])

Forward of ``fused_experts`` on rank r (every step a kernel or torch op on the device):

1. layout: count exchange (symmetric memory, flags), receive geometry, remote chunks;
2. layer 0 (one launch): communication programs push remote token rows into their owners'
   receive buffers with per-(source, expert) counters while GEMM programs compute, local rows
   first, waiting per tile only for the sources they need; SwiGLU (or GELU/ReLU/SiLU) and bias
   in the epilogue;
3. layer 1 (two launches): grouped GEMM whose epilogue stores rows into the source ranks'
   combine buffers and bumps per-column counters; then the deterministic weighted reduction.

Backward (mirrored roles, same kernels):
  * layer 1: ``d topk_weights = <dy, o>`` (``kernels/row_dot.py``) from the rows layer 1
    saved (the reduction's copy at W > 1; at one rank the GEMM's own row buffer), or, at one
    rank without ``b2`` where ``F < H``, from partial sums the dispatch GEMM's epilogue writes
    (``<act(gu), w * dy @ w2>`` per slot and column tile, divided by ``w``); ``dy * w`` is
    *dispatched* by the layer-0 kernel into a GEMM with ``w2`` (-> d h; its own block config,
    ``layer0_config("dact")``), and ``d w2 = g^T h`` is a grouped weight-gradient GEMM (one
    rank: the gathered ``g`` rows are the dispatch GEMM's TMA operand too);
  * activation backward from the saved pre-activations;
  * layer 0: ``d gu @ w1`` is computed by the layer-1 kernel and *combined* back to the source
    ranks (unweighted), ``d w1 = d gu^T x`` is a grouped weight-gradient GEMM.
The backward needs no count exchange and no host collective (the forward layout is reused),
so emulated ranks on one GPU can run it in the concurrent mode.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..dispatch.layout import CHUNK, Layout, build_layout
from ..kernels import moe_wgrad
from ..kernels.gather_rows import gather_rows
from ..kernels.gather_rows import row_scale as _row_scale_kernel
from ..kernels.launch import launch as _launch
from ..kernels.launch import warming_up, warmup_only
from ..kernels.moe_layer0 import ACT_CODES, _layer0_kernel
from ..kernels.moe_layer1 import _combine_kernel, _layer1_gemm_kernel
from ..kernels.row_dot import row_dot, weights_grad_from_partials
from ..world import SymmTensor, WorkspacePlan, World, interpreted, launch_lock
from . import tuning
from .checks import check_expert_args, check_layer0_args, check_layer1_args
from .tuning import tune  # noqa: F401 - the bench CLI's tuning hook

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------- configs
def _env_cfg(name):
    v = tuning.getenv(name)
    if not v:
        return None
    want = "BM,BN,BK,warps,stages[,GROUP_M[,EPI]]"
    try:
        parts = [int(p) for p in v.split(",")]
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected integers {want}") from None
    if len(parts) not in (5, 6, 7):
        raise ValueError(f"{name}={v!r}: expected {want}")
    # Checked here, not by the compiler: GROUP_M 0 divides by zero in the tile order (garbage,
    # no error), a block that is not a power of two fails deep in Triton.
    for what, b in zip(("BM", "BN", "BK"), parts):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={v!r}: {what} must be a power of two >= 16, got {b}")
    if parts[3] not in (1, 2, 4, 8, 16) or parts[4] < 1:
        raise ValueError(f"{name}={v!r}: warps must be 1, 2, 4, 8 or 16 and stages >= 1")
    if len(parts) >= 6 and parts[5] < 1:
        raise ValueError(f"{name}={v!r}: GROUP_M must be >= 1, got {parts[5]}")
    cfg = dict(BM=parts[0], BN=parts[1], BK=parts[2], num_warps=parts[3], num_stages=parts[4])
    if len(parts) >= 6:
        cfg["GM"] = parts[5]
    if len(parts) == 7:
        if parts[6] not in (1, 2, 4, 8) or parts[1] % (parts[6] * 8):
            raise ValueError(
                f"{name}={v!r}: EPI (epilogue slices) must be 1, 2, 4 or 8, BN a multiple of 8 EPI"
            )
        cfg["EPI"] = parts[6]
    return cfg


def block_m(pinned=None) -> int:
    """Rows per M-tile (experts are padded to it); shared by layer 0 and layer 1."""
    cfg = _env_cfg("MOE_OVERLAP_L0_CONFIG")
    if cfg:
        return cfg["BM"]
    if pinned is not None and not interpreted():
        return pinned["l0"]["BM"]
    return 16 if interpreted() else 128


def layer0_config(activation: str, elem_size: int = 2, pinned=None) -> dict:
    """Block config of the layer-0 GEMM (``activation``: "swiglu", "plain" or "dact", the
    backward's dispatch GEMM). ``MOE_OVERLAP_L0_CONFIG=BM,BN,BK,warps,stages`` pins one (BM must
    match layer 1's; ``MOE_OVERLAP_L0B_CONFIG`` for "dact" only); else a tuned config from the
    pinned table (``moe_overlap.experts.tuning``); else the defaults below."""
    if activation == "dact":
        cfg = _env_cfg("MOE_OVERLAP_L0B_CONFIG")
        if cfg:
            return cfg
        if pinned is not None and "l0b" in pinned:
            return dict(pinned["l0b"])
    cfg = _env_cfg("MOE_OVERLAP_L0_CONFIG")
    if cfg:
        return cfg
    if pinned is not None and activation == "swiglu":
        return dict(pinned["l0"])
    if interpreted():
        return dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=1)
    # 4-byte operands halve BK: 3 stages of 128x64 + 2x64x128 fp32 tiles need 288 KiB of shared
    # memory, over the H200's 227 KiB (measured: the launch fails).
    bk = 64 if elem_size <= 2 else 32
    # Pinned configs are tuned for the SwiGLU forward: a plain GEMM keeps only their BLOCK_M.
    bm = pinned["l0"]["BM"] if pinned is not None else 128
    if activation == "swiglu":  # two accumulators: a 128 x (2 x 128) tile
        return dict(BM=bm, BN=128, BK=bk, num_warps=8, num_stages=3)
    if activation == "dact":
        # The backward's epilogue loads the saved gate and up tiles beside the accumulator: at
        # BN 256 in one piece that spilled (H200, mixtral-8x7b: 18.5 ms for 3.85 TFLOP); in four
        # column slices it is the fastest config measured (6.65 ms; 128x128 unsliced 7.96).
        return dict(BM=bm, BN=256, BK=bk, num_warps=8, num_stages=3, EPI=4)
    return dict(BM=bm, BN=256, BK=bk, num_warps=8, num_stages=3)


def layer1_config(elem_size: int = 2, pinned=None) -> dict:
    cfg = _env_cfg("MOE_OVERLAP_L1_CONFIG")
    if cfg:
        return cfg
    if pinned is not None:
        return dict(pinned["l1"])
    if interpreted():
        return dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=1)
    return dict(BM=128, BN=256, BK=64 if elem_size <= 2 else 32, num_warps=8, num_stages=3)


def _tma_usable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be a TMA operand: contiguous, 16-byte aligned base and rows.

    On the GPU only 16-bit operands take TMA (fp32 stays on pointer loads: tf32 tiles there are
    a test path, and its transposed B would need a layout change wgmma does not take); the
    interpreter takes every dtype, so the CPU suite covers the descriptor path's indexing.
    ``MOE_OVERLAP_TMA=0`` turns TMA off everywhere (for bisecting)."""
    if os.environ.get("MOE_OVERLAP_TMA", "1") == "0" or t.numel() == 0:
        return False
    if not interpreted() and (not t.is_cuda or t.element_size() != 2):
        return False
    es = t.element_size()
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * es) % 16 == 0


def _weight_operand(
    w, n_rows: int, k_dim: int, n_dim: int, stride_wn, stride_wk, BN, BK, pair=False
):
    """``(B_MODE, descriptor or None)`` for the weight ``w[l, n, k]`` of a grouped GEMM (see
    ``kernels.moe_layer0.load_b_tile``). ``n_rows``: rows of ``w[l]`` in the k-contiguous case
    (N, or 2N for SwiGLU's gate and up halves). ``pair`` (SwiGLU's forward): gate and up tiles
    in one box (mode 3, ``load_gate_up``), unless ``MOE_OVERLAP_L0_PAIR=0``."""
    if w.dim() != 3 or not _tma_usable(w):
        return 0, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    El = w.shape[0]
    k_major = stride_wk == 1 and tuple(w.shape[1:]) == (n_rows, k_dim)
    if pair and k_major and n_rows == 2 * n_dim and os.environ.get("MOE_OVERLAP_L0_PAIR") != "0":
        return 3, TensorDescriptor.from_tensor(w.view(El * 2, n_dim, k_dim), [2, BN, BK])
    if k_major:
        return 1, TensorDescriptor.from_tensor(w.view(El * n_rows, k_dim), [BN, BK])
    if stride_wn == 1 and tuple(w.shape[1:]) == (k_dim, n_dim):
        return 2, TensorDescriptor.from_tensor(w.view(El * k_dim, n_dim), [BK, BN])
    return 0, None


def _out_descs(out, gu, act: str, dact, BM: int, cfg: dict):
    """``(out_desc, gu_desc, EPI_SUB)``: TMA store descriptors for layer 0's SwiGLU forward
    epilogue (``kernels.moe_layer0._swiglu_store``; ``out [R, N]``, ``gu`` viewed ``[R, 2, N]``
    or None), one column slice per box, or ``(None, None, EPI)`` where TMA does not apply or
    ``MOE_OVERLAP_L0_TMA_STORE=0``. With TMA stores a config that does not name its slicing
    stores in 2 slices: the store buffers sit beside the main loop's stages in shared memory
    (sm_90, 4 stages of 128 x 256 x 64 and a 128 x 128 box for h and each gate/up half: 256
    KiB, over the 227 KiB a block may have; 2 slices 224 KiB)."""
    epi = cfg.get("EPI", 1)
    if dact is not None or act != "swiglu" or os.environ.get("MOE_OVERLAP_L0_TMA_STORE") == "0":
        return None, None, epi
    if not _tma_usable(out) or (gu is not None and not _tma_usable(gu)):
        return None, None, epi
    from triton.tools.tensor_descriptor import TensorDescriptor

    if "EPI" not in cfg:
        epi = 2
    if epi not in (1, 2, 4):  # the forward slices in 1, 2 or 4 pieces only
        epi = 1
    R, N = out.shape
    bn = cfg["BN"] // epi
    out_desc = TensorDescriptor.from_tensor(out, [BM, bn])
    gu_desc = None
    if gu is not None:
        gu_desc = TensorDescriptor.from_tensor(gu.view(R, 2, N), [BM, 1, bn])
    return out_desc, gu_desc, epi


def _programs(world: World, total: int) -> int:
    if interpreted():
        return max(1, min(total, 3))
    return max(1, min(total, getattr(world, "max_programs", 132)))


# ------------------------------------------------------------------------------- checks
def _check_inputs(x, topk_ids, topk_weights, w1, w2, world, activation, b1, b2):
    if isinstance(activation, str) and activation == "none":
        raise ValueError("activation must be one of swiglu, gelu, relu, silu; got 'none'")
    T, H, F, El, K = check_expert_args(
        x, topk_ids, topk_weights, w1, w2, activation, b1, b2, world=world
    )
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    E = El * world.world_size
    if topk_ids.numel() and world.device.type != "cuda" and not torch.compiler.is_compiling():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"topk_ids must be in [-1, {E}) (E = El * world_size), found values in [{lo}, {hi}]"
            )
    return T, H, F, El, K, E


def check_ids_on_device(topk_ids, E):
    """On the GPU, range-check ids without a host sync: bad ids become an async error."""
    if topk_ids.numel():
        torch._assert_async(
            ((topk_ids >= -1) & (topk_ids < E)).all(), "topk_ids out of range [-1, E)"
        )


# ------------------------------------------------------------------------------- plans
class _Stage(NamedTuple):
    """The MoE ops' regions of the world's workspace (symmetric, same offsets on every rank).

    ``recv [R, H]`` / ``slot [R]``: layer 0's receive rows and their source slots; ``comb [S,
    H]``: layer 1's rows back at their source, by slot. Where some peer takes puts
    (``World.has_puts``) also the put sources: ``put_rows [S, H]`` / ``put_slots [S]`` (layer 0,
    by assignment) and ``put_out [R, H]`` (layer 1, by receive row); else None."""

    recv: SymmTensor
    slot: SymmTensor
    comb: SymmTensor
    put_rows: SymmTensor | None = None
    put_slots: SymmTensor | None = None
    put_out: SymmTensor | None = None


def _workspace(world: World, layout: Layout, H: int, dtype: torch.dtype) -> _Stage:
    R, S = layout.rows_cap_max, layout.slots_cap_max
    plan = WorkspacePlan()
    shapes = [((R, H), dtype), ((R,), torch.int32), ((S, H), dtype)]
    if world.has_puts:
        shapes += [((S, H), dtype), ((S,), torch.int32), ((R, H), dtype)]
    offs = [plan.add(shape, dt) for shape, dt in shapes]
    ws = world.workspace(plan.total)
    return _Stage(*(ws.view(o, shape, dt) for o, (shape, dt) in zip(offs, shapes)))


def _put_args(world: World, sig, stage: _Stage, kernel: str) -> dict:
    """The put-path arguments of ``kernel`` ("layer0", "layer1" or "combine"); an empty dict
    on a world without puts (``sig`` None)."""
    if sig is None:
        return {}
    args = dict(PUT=True, USE_NVSHMEM=world.uses_nvshmem)
    if kernel == "layer0":
        args.update(
            put_mask_ptr=world.put_mask,
            sig_local=sig.local,
            sig_table=sig.ptrs,
            stage_rows=stage.put_rows.local,
            stage_slots=stage.put_slots.local,
        )
    elif kernel == "layer1":
        args.update(put_mask_ptr=world.put_mask, sig_table=sig.ptrs, stage_out=stage.put_out.local)
    else:
        args.update(sig_local=sig.local)
    if world.uses_nvshmem:
        from ..kernels.nvshmem_device import compile_options

        args.update(compile_options())
    return args


def dispatch_layout(
    topk_ids: torch.Tensor,
    num_experts: int,
    world: World,
    max_tokens_per_rank: int | None = None,
    pinned=None,
    sizes: dict | None = None,
) -> Layout:
    """Routing layout of ``topk_ids [T, K]`` over ``world`` (count exchange included).

    ``pinned``: a tuned joint config (``moe_overlap.experts.tuning.pinned``) whose BLOCK_M the
    layout pads experts to; the layers then use its block shapes. ``sizes``: what every rank
    must share (:func:`expert_sizes`), checked with the count exchange
    (``moe_overlap.dispatch.layout.build_layout``)."""
    if num_experts % world.world_size:
        raise ValueError(
            f"num_experts {num_experts} must be divisible by world_size {world.world_size}"
        )
    if max_tokens_per_rank is not None and topk_ids.shape[0] > max_tokens_per_rank:
        raise ValueError(
            f"{topk_ids.shape[0]} tokens on rank {world.rank} exceed "
            f"max_tokens_per_rank={max_tokens_per_rank}"
        )
    layout = build_layout(
        topk_ids,
        num_experts,
        world,
        block_m(pinned),
        max_tokens_per_rank,
        None if sizes is None else ("fused_experts", sizes),
    )
    layout.pinned = pinned if (pinned is not None and not interpreted()) else None
    return layout


_DUMMIES: dict = {}


def _dummy(device, dtype=torch.int32):
    """A one-element stand-in for a pointer argument the kernel's constexpr flags never touch.

    Cached per (device, dtype): a fused forward+backward passes ~22 of them, and each fresh one
    was an allocation plus a fill launch on the host's critical path (the qwen3-30b-a3b layer
    is close to host-bound, BENCHMARKS.md). Never cached while a CUDA graph is being captured:
    a tensor from the graph's private pool must not outlive the graph in this cache."""
    device = torch.device(device)
    key = (device, dtype)
    t = _DUMMIES.get(key)
    if t is None:
        t = torch.zeros(1, dtype=dtype, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _DUMMIES[key] = t
    return t


def _check_trace(trace, device):
    if trace is None:
        return None
    if (
        not isinstance(trace, torch.Tensor)
        or trace.dtype != torch.int64
        or trace.dim() != 2
        or trace.shape[1] != 6
        or trace.shape[0] < 2
    ):
        raise ValueError(
            "trace must be an int64 tensor [n >= 2, 6] (moe_overlap.bench.trace.new_buffer); "
            "its last row is the interpreter's logical clock"
        )
    if trace.device != device or not trace.is_contiguous():
        raise ValueError(f"trace must be contiguous on {device}")
    return trace


# ------------------------------------------------------------------------------- layer 0
def _launch_layer0(
    x,
    layout,
    w,
    world,
    act,
    bias=None,
    scale=None,
    row_scale=None,
    save_gu=False,
    n_out=None,
    stride_wn=None,
    stride_wk=None,
    stage_ws=None,
    trace=None,
    dact=None,
    pre=None,
    a_rows=None,
    a_rows_scaled=False,
    dw_slot=None,
):
    """Dispatch rows of ``x`` and compute ``act(rows @ w[l]^T + b)`` per local expert.

    ``w`` is indexed ``w[l, n, k]`` through ``stride_wn`` / ``stride_wk`` (so a transposed view
    works for the backward). Returns (out [R, N], gu [R, 2N or N] or None, recv, slot).
    ``dact`` (backward; ``act`` must be "none"): the epilogue multiplies by the derivative of
    that activation at the saved pre-activations ``pre [R, 2N or N]``, and ``out`` is then
    ``d pre`` (``[R, 2N]`` for SwiGLU), zero on padding rows.

    One rank with a TMA weight operand: the rows are staged contiguously (``a_rows [R, H]``
    when the caller already gathered them, else into the workspace's receive buffer) and the
    GEMM loads A by TMA, since Hopper's TMA cannot gather rows itself. ``a_rows_scaled``: the
    given ``a_rows`` already carry ``row_scale`` (applied in the epilogue only where the GEMM
    falls back to gathering rows of ``x``).

    One rank on a Hopper GPU, SwiGLU forward without bias or trace: the warp-specialized Gluon
    kernel (``kernels/moe_ws.py``, :func:`_l0_ws_usable`) on the staged rows instead.

    ``dw_slot [R]`` int32 (``dact`` at one rank only): the slot of each row; the epilogue then
    also writes, per (slot, column tile), the tile's part of ``<act(pre), out row before the
    derivative>``, and the second result is those partials ``[S, n_tiles_N]`` fp32 (see
    ``kernels/row_dot.py``) instead of ``gu``.
    """
    device = x.device
    W = world.world_size
    ws_fwd = dact is None and scale is None and row_scale is None and dw_slot is None
    # One rank on Hopper: the warp-specialized kernel (kernels/moe_ws.py) on rows the caller
    # gathered, else staged first whatever the width (since its nested K loop it beats the
    # Triton kernel's pointer loads where staging does not pay that kernel: qwen3-30b-a3b
    # inference 1.533 ms against 1.594-1.598, H200, 2026-12-05; MOE_OVERLAP_L0_STAGE=0 keeps
    # the Triton kernel's pointer loads there)
    ws_fwd = ws_fwd and (a_rows is not None or os.environ.get("MOE_OVERLAP_L0_STAGE") != "0")
    if ws_fwd and _l0_ws_usable(x, w, layout, world, act, bias, trace) and n_out == w.shape[1] // 2:
        rows = _staged_rows(x, layout, stage_ws.recv, a_rows)
        if rows is not None:
            return _launch_l0_ws(rows, w, layout, world, save_gu)
    kind = "dact" if dact is not None else ("swiglu" if act == "swiglu" else "plain")
    cfg = layer0_config(kind, x.element_size(), getattr(layout, "pinned", None))
    BM = layout.block_m
    R = layout.rows_cap
    H = x.shape[1]
    N = n_out
    if dact is not None:
        if act != "none" or save_gu or pre is None or pre.shape[0] != R:
            raise ValueError("dact needs act='none', no save_gu and pre [R, ...]")
        out = torch.empty(R, pre.shape[1], dtype=x.dtype, device=device)
    else:
        out = torch.empty(R, N, dtype=x.dtype, device=device)
    gu = None
    if dw_slot is not None and (dact is None or W != 1):
        raise ValueError("dw_slot is for the backward's dispatch GEMM at one rank")
    if save_gu:
        gu = torch.empty(R, 2 * N if act == "swiglu" else N, dtype=x.dtype, device=device)
    recv, slot = stage_ws.recv, stage_ws.slot
    flags = sig = None
    if W > 1:
        El = layout.local_experts
        if world.has_puts:  # int64 counters: rows, then slots, per (source, local expert)
            flags, sig = world.begin_op_signals(W * El, 2 * W * El)
        else:
            flags = world.begin_op(W * El)
        pad_local, epoch = world.ready_args()
    else:
        pad_local = epoch = _dummy(device)
    n_n = -(-N // cfg["BN"])
    total = layout.tiles_cap * n_n
    part = None
    if dw_slot is not None:
        part = torch.empty(layout.slots_cap_max, n_n, dtype=torch.float32, device=device)
    n_comm = 0
    if W > 1:
        n_comm = min(
            layout.chunks_cap,
            2 if interpreted() else max(1, getattr(world, "max_programs", 132) // 8),
        )
    n_gemm = (
        _programs(world, total)
        if interpreted()
        else max(1, min(total, getattr(world, "max_programs", 132) - n_comm))
    )
    di = _dummy(device)
    df = _dummy(device, x.dtype)
    n_rows = 2 * N if act == "swiglu" else N
    b_mode, w_desc = _weight_operand(
        w, n_rows, H, N, stride_wn, stride_wk, cfg["BN"], cfg["BK"], pair=act == "swiglu"
    )
    out_desc, gu_desc, epi = _out_descs(out, gu, act, dact, BM, cfg)
    a_desc = None
    if W == 1 and b_mode and (a_rows is not None or _stage_pays(n_rows)):
        a_desc = _staged_rows_desc(x, layout, recv, a_rows, BM, cfg["BK"])
    if a_desc is not None and a_rows is not None and a_rows_scaled:
        row_scale = None
    # Flattening the tile loop into the K loop, which wins for layer 1, loses here: measured on
    # the H200 (mixtral-8x7b, 2026-12-03) 0.779x grouped_mm flattened against 0.978x not
    # (SwiGLU's two accumulators). MOE_OVERLAP_L0_FLAT=1 turns it on for experiments.
    flat = a_desc is not None and trace is None and os.environ.get("MOE_OVERLAP_L0_FLAT") == "1"
    args = dict(
        x_ptr=x,
        scale_ptr=scale if scale is not None else df,
        sorted_ptr=layout.sorted_assign,
        chunk_ptr=layout.chunks,
        n_chunks_ptr=layout.n_chunks,
        recv_table=recv.ptrs,
        slot_table=slot.ptrs,
        flag_table=flags.ptrs if flags is not None else _dummy(device, torch.int64),
        pad_local=pad_local,
        epoch_ptr=epoch,
        recv_local=recv.local,
        row_tok_ptr=layout.row_tok,
        row_l_ptr=layout.row_local_expert,
        exp_end_ptr=layout.expert_end,
        n_tiles_ptr=layout.n_tiles,
        slice_off_ptr=layout.slice_off,
        slice_cnt_ptr=layout.slice_cnt,
        flags_local=flags.local if flags is not None else di,
        row_scale_ptr=row_scale if row_scale is not None else df,
        w_ptr=w,
        w_desc=w_desc,
        a_desc=a_desc,
        b_ptr=bias if bias is not None else df,
        out_ptr=out,
        gu_ptr=gu if gu is not None else (pre if pre is not None else df),
        err_ptr=world.error_buffer,
        rank=world.rank,
        budget=world.wait_budget,
        n_comm=n_comm,
        trace_ptr=trace if trace is not None else _dummy(device, torch.int64),
        trace_rows=trace.shape[0] - 1 if trace is not None else 0,
        H=H,
        N=N,
        K_top=layout.top_k,
        stride_xt=x.stride(0),
        stride_we=w.stride(0),
        stride_wn=stride_wn,
        stride_wk=stride_wk,
        stride_be=bias.stride(0) if bias is not None else 0,
        stride_om=out.stride(0),
        stride_gm=gu.stride(0) if gu is not None else (pre.stride(0) if pre is not None else 0),
        W=W,
        El=layout.local_experts,
        ACT=ACT_CODES[act],
        HAS_BIAS=bias is not None,
        SAVE_GU=save_gu,
        HAS_SCALE=scale is not None,
        ROW_SCALE=row_scale is not None,
        EVEN_K=H % cfg["BK"] == 0,
        BM=BM,
        BN=cfg["BN"],
        BK=cfg["BK"],
        CH=CHUNK,
        BH=32 if interpreted() else 128,
        GROUP_M=cfg.get("GM", 8),
        USE_TIMER=world.use_timer,
        TRACE=trace is not None,
        DACT=ACT_CODES[dact] if dact is not None else -1,
        EPI_SUB=epi,
        B_MODE=b_mode,
        A_TMA=a_desc is not None,
        FLAT=flat,
        dw_ptr=part if part is not None else df,
        dw_slot_ptr=dw_slot if dw_slot is not None else di,
        DW=dw_slot is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **_put_args(world, sig, stage_ws, "layer0"),
        out_desc=out_desc,
        gu_desc=gu_desc,
        O_TMA=out_desc is not None,
    )

    def launch(role):
        grid = {0: n_comm + n_gemm, 1: n_comm, 2: n_gemm}[role]
        if grid > 0:
            _launch(_layer0_kernel, (grid,), ROLE=role, **args)

    if W > 1:
        world.run_fused(launch)
        world.end_op()
    else:
        with launch_lock():
            launch(0)
    return out, (part if part is not None else gu)


def _stage_pays(n_cols: int) -> bool:
    """Whether gathering layer 0's A rows in a pass of their own (for TMA loads) beats pointer
    loads in the GEMM, where the caller has not gathered them anyway. The pass costs the same
    bytes whatever the GEMM's width ``n_cols`` (2F for SwiGLU), the GEMM's gain grows with it:
    measured on the H200 (2026-12-03) staged against pointer loads 1.000x / 0.978x grouped_mm
    at mixtral-8x7b (2F 28672), 1.064x / 0.993x at deepseek-v3 (4096), but 0.907x / 0.938x at
    qwen3-30b-a3b (1536). ``MOE_OVERLAP_L0_STAGE=0/1`` forces it. (This is the Triton kernel's
    rule; the warp-specialized forward stages always, see :func:`_launch_layer0`.)"""
    env = os.environ.get("MOE_OVERLAP_L0_STAGE")
    if env in ("0", "1"):
        return env == "1"
    # the interpreter stages always: the CPU suite then covers the descriptor path's indexing
    return interpreted() or n_cols >= 2048


def _staged_rows(x, layout: Layout, recv, a_rows):
    """One rank: layer 0's A rows ``[R, H]`` in receive order (zeros on padding rows) as a
    TMA-ready tensor, or None where TMA does not apply. ``a_rows``: the rows already gathered
    (the training forward keeps them for the wgrad), else they are gathered into the
    workspace's receive buffer, which one rank does not otherwise use."""
    R, H = layout.rows_cap, x.shape[1]
    if R == 0 or not _tma_usable(x):
        return None
    if a_rows is None:
        buf = recv.local[:R]
        if buf.shape[1] != H or buf.dtype != x.dtype:
            return None
        with launch_lock():
            a_rows = gather_rows(x, layout.row_tok, None, None, interpreted(), out_RH=buf)
    if not _tma_usable(a_rows) or tuple(a_rows.shape) != (R, H):
        return None
    return a_rows


def _staged_rows_desc(x, layout: Layout, recv, a_rows, BM: int, BK: int):
    """A Triton TMA descriptor over :func:`_staged_rows`, or None."""
    a_rows = _staged_rows(x, layout, recv, a_rows)
    if a_rows is None:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(a_rows, [BM, BK])


def _launch_l0_ws(a_rows, w1, layout: Layout, world: World, save_gu: bool):
    """The Gluon path of :func:`_launch_layer0`'s SwiGLU forward -> ``(h [R, F], gu or None)``."""
    from ..kernels.moe_ws import swiglu_ws

    cfg = layer0_ws_config()
    R = a_rows.shape[0]
    F = w1.shape[1] // 2
    h = torch.empty(R, F, dtype=a_rows.dtype, device=a_rows.device)
    gu = torch.empty(R, 2 * F, dtype=a_rows.dtype, device=a_rows.device) if save_gu else None
    n_n = -(-F // (cfg["BN"] // 2))
    grid = max(1, min(layout.tiles_cap * n_n, getattr(world, "max_programs", 132)))
    swiglu_ws(a_rows, w1, h, gu, layout, cfg, grid)
    return h, gu


def _row_slots(layout: Layout, slot) -> torch.Tensor:
    """Slots of every receive row: local rows from the layout, remote ones from producers."""
    if layout.world_size == 1:
        return layout.row_slot
    return torch.where(layout.row_tok == -1, slot.local[: layout.rows_cap], layout.row_slot)


def _gather_rows(layout: Layout, x, recv, row_scale=None) -> torch.Tensor:
    """The A rows layer 0 used, as an ordinary tensor ``[R, H]`` (zeros on padding rows)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    recv_rows = recv.local[: layout.rows_cap] if layout.world_size > 1 else None
    scale = row_scale.float().contiguous() if row_scale is not None else None
    with launch_lock():  # the interpreter is not thread-safe (emulated ranks are threads)
        return gather_rows(x, layout.row_tok, recv_rows, scale, interpreted())


# ------------------------------------------------------------------------------- layer 1
def _combine_config(W: int, gemm_bn: int) -> tuple:
    """``(tokens, columns, warps)`` of a reduction tile. At W > 1 the reduction waits per GEMM
    column tile, so it tiles columns alike; at one rank narrower tiles keep the unrolled top-k
    loads in registers. 16 tokens, not 32: layer 1 at qwen3-30b-a3b 0.842 ms against 0.880 in
    one H200 call (2026-12-04; 16x256 0.884 against 0.911 in another, equal in a third).
    ``MOE_OVERLAP_COMBINE_CONFIG=BT,BN,warps`` pins the one-rank tile (A/B runs; powers of
    two)."""
    if W > 1 or interpreted():
        return (16 if interpreted() else 32), gemm_bn, 4
    env = os.environ.get("MOE_OVERLAP_COMBINE_CONFIG")
    if env:
        try:
            bt, bn, warps = (int(v) for v in env.split(","))
        except ValueError:
            bt = bn = warps = 0
        if min(bt, bn, warps) < 1 or any(v & (v - 1) for v in (bt, bn, warps)):
            raise ValueError(
                f"MOE_OVERLAP_COMBINE_CONFIG must be BT,BN,warps (powers of two), got {env!r}"
            )
        return bt, bn, warps
    return 16, 128, 4


def _launch_layer1(
    h,
    layout,
    w,
    world,
    bias,
    weights,
    row_slot,
    stage_ws,
    k_dim,
    n_out,
    stride_wn,
    stride_wk,
    save_o=False,
    trace=None,
):
    """Grouped GEMM ``h @ w[l]^T`` whose rows go to their source ranks, then the reduction
    ``y[t] = sum_k weights[t, k] * row(t, k)`` (unweighted when ``weights`` is None). One rank
    on Hopper: the GEMM in the warp-specialized Gluon kernel where :func:`_l1_ws_usable` says."""
    device = h.device
    W = world.world_size
    cfg = layer1_config(h.element_size(), getattr(layout, "pinned", None))
    BM = layout.block_m
    T, K = layout.num_tokens, layout.top_k
    H = n_out
    comb = stage_ws.comb
    if W == 1:
        comb_local = torch.empty(layout.slots_cap_max, H, dtype=h.dtype, device=device)
        comb_table = _dummy(device, torch.int64)
    else:
        comb_local, comb_table = comb.local, comb.ptrs
    y = torch.empty(T, H, dtype=h.dtype, device=device)
    o = None
    if save_o:
        # One rank: the GEMM's rows land in a tensor of their own already (not workspace), so
        # the backward keeps that one instead of the reduction copying every row out.
        o = (
            comb_local
            if W == 1
            else torch.empty(layout.slots_cap_max, H, dtype=h.dtype, device=device)
        )
    copy_o = save_o and W > 1
    n_n = -(-H // cfg["BN"])
    flags = sig = None
    if W > 1:
        if world.has_puts:  # int64 counters of the rows that come back by puts
            flags, sig = world.begin_op_signals(n_n, n_n)
        else:
            flags = world.begin_op(n_n)
        pad_local, epoch = world.ready_args()
    else:
        pad_local = epoch = _dummy(device)
    di = _dummy(device)
    df = _dummy(device, h.dtype)
    total = layout.tiles_cap * n_n
    n_gemm = _programs(world, total)
    BT, red_bn, red_warps = _combine_config(W, cfg["BN"])
    n_red_tiles = -(-T // BT) * -(-H // red_bn)
    # Persistent reduction programs only where they wait for peers (they must then fit beside
    # the GEMM's); one rank launches one program per tile: the reduction is a latency-bound
    # gather, and 132 programs of 4 warps left most of each SM idle.
    n_red = (_programs(world, n_red_tiles) if W > 1 or interpreted() else n_red_tiles) if T else 0
    b_mode, w_desc = _weight_operand(w, H, k_dim, H, stride_wn, stride_wk, cfg["BN"], cfg["BK"])
    h_desc = None
    if b_mode and _tma_usable(h) and h.shape[1] == k_dim:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor.from_tensor(h, [BM, cfg["BK"]])
    # Flattening the tile loop into the K loop overlaps a tile's epilogue with the next tile's
    # loads: measured on the H200 (tests/gpu/gemm_variants.py) 1.02x / 1.06x grouped_mm on
    # Mixtral / Qwen3 against 1.02x / 1.00x unflattened; only with TMA operands and one rank.
    flat = W == 1 and h_desc is not None and trace is None
    put1 = _put_args(world, sig, stage_ws, "layer1")
    red_put = _put_args(world, sig, stage_ws, "combine")
    # One rank on Hopper: the warp-specialized kernel (kernels/moe_ws.py), its epilogue's row
    # stores off the tensor cores' path
    ws_kmajor = None
    if W == 1:
        ws_kmajor = _l1_ws_usable(h, w, layout, world, bias, trace, k_dim, H, stride_wk)

    def launch(role):
        if role == 0 and ws_kmajor is not None:
            _launch_l1_ws(h, w, comb_local, row_slot, layout, world, ws_kmajor)
        elif role in (0, 1):
            _launch(
                _layer1_gemm_kernel,
                (n_gemm,),
                h,
                h_desc,
                w,
                w_desc,
                bias if bias is not None else df,
                layout.row_local_expert,
                layout.expert_end,
                layout.n_tiles,
                layout.row_src,
                row_slot,
                comb_local,
                comb_table,
                flags.ptrs if flags is not None else _dummy(device, torch.int64),
                pad_local,
                epoch,
                world.error_buffer,
                world.rank,
                world.wait_budget,
                trace if trace is not None else _dummy(device, torch.int64),
                trace.shape[0] - 1 if trace is not None else 0,
                k_dim,
                H,
                h.stride(0),
                w.stride(0),
                stride_wn,
                stride_wk,
                bias.stride(0) if bias is not None else 0,
                W=W,
                HAS_BIAS=bias is not None,
                EVEN_K=k_dim % cfg["BK"] == 0,
                ES=h.element_size(),
                BM=BM,
                BN=cfg["BN"],
                BK=cfg["BK"],
                GROUP_M=cfg.get("GM", 8),
                USE_TIMER=world.use_timer,
                TRACE=trace is not None,
                A_TMA=h_desc is not None,
                B_MODE=b_mode,
                FLAT=flat,
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
                **put1,
            )
        if role in (0, 2) and n_red:
            _launch(
                _combine_kernel,
                (n_red,),
                comb_local,
                layout.slot_of,
                weights if weights is not None else df,
                y,
                o if copy_o else df,
                flags.local if flags is not None else di,
                layout.n_kept,
                world.error_buffer,
                world.rank,
                world.wait_budget,
                T,
                H,
                y.stride(0),
                K_top=K,
                W=W,
                HAS_W=weights is not None,
                SAVE_O=copy_o,
                BT=BT,
                BN=red_bn,
                USE_TIMER=world.use_timer,
                num_warps=red_warps,
                **red_put,
            )

    if W > 1:
        world.run_fused(launch, split=True)
        world.end_op()
    else:
        with launch_lock():
            launch(0)
    return y, o


# ------------------------------------------------------------------------------- backward helpers
def _valid_rows(layout: Layout) -> torch.Tensor:
    return layout.row_tok >= -1


def _expert_sum(rows, layout: Layout):
    """Per-local-expert sum of ``rows [R, N]`` (padding rows must be zero) -> ``[El, N]`` fp32.

    Deterministic: every expert's rows start on a ``block_m`` boundary, so each block of rows
    belongs to one expert; blocks are summed by a plain reduction and each expert's run of
    blocks is a difference of float64 prefix sums. (``index_add_`` adds by atomics on CUDA:
    two runs of one backward gave bias gradients a bf16 ulp apart on the H100, 2026-12-05.)
    """
    R, N = rows.shape
    bm = layout.block_m  # R is a whole number of blocks (every layout pads rows_cap so)
    blocks = rows.reshape(R // bm, bm, N).sum(1, dtype=torch.float32)
    pre = torch.zeros(R // bm + 1, N, dtype=torch.float64, device=rows.device)
    torch.cumsum(blocks, 0, dtype=torch.float64, out=pre[1:])
    first = layout.expert_start.long() // bm
    last = torch.maximum((layout.expert_end.long() + bm - 1) // bm, first)
    return (pre[last] - pre[first]).float()


def wgrad_config() -> dict:
    """Block config of the weight-gradient kernel (``kernels/moe_wgrad.py``);
    ``MOE_OVERLAP_WGRAD_CONFIG=BM,BN,BK,warps,stages[,GROUP_M]`` pins one (``BK`` must divide
    the layout's BLOCK_M); ``MOE_OVERLAP_WGRAD_GRID=tiles`` launches one program per tile
    instead of one per SM (``GRID``), so two can share an SM where the config fits twice."""
    cfg = _env_cfg("MOE_OVERLAP_WGRAD_CONFIG")
    if cfg is None:
        if interpreted():
            cfg = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=1)
        else:  # 3 x 48 KiB of A and B stages + the 64 KiB output tile the TMA store stages
            cfg = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)
    cfg.setdefault("GM", 8)
    grid = os.environ.get("MOE_OVERLAP_WGRAD_GRID", "persistent")
    if grid not in ("persistent", "tiles"):
        raise ValueError(f"MOE_OVERLAP_WGRAD_GRID must be persistent or tiles, got {grid!r}")
    cfg["GRID"] = grid
    return cfg


def _wgrad_env() -> str:
    """``MOE_OVERLAP_WGRAD``: ``auto`` (default: the warp-specialized kernel where
    :func:`_wgrad_ws_usable` allows, else ``torch._grouped_mm``), ``ws`` (that kernel, else the
    Triton one), ``kernel`` (the Triton one, ``kernels/moe_wgrad.py``), ``grouped_mm``."""
    env = os.environ.get("MOE_OVERLAP_WGRAD", "auto")
    if env not in ("auto", "grouped_mm", "kernel", "ws"):
        raise ValueError(f"MOE_OVERLAP_WGRAD must be auto, grouped_mm, kernel or ws, got {env!r}")
    return env


def _wgrad_kernel_usable(a_rows, b_rows, layout: Layout, out_dtype, cfg) -> bool:
    """Whether :func:`_grouped_wgrad` may run a real-rows kernel (which one: ``_wgrad_env``):
    not ``grouped_mm``, TMA-usable operands of one dtype and output dtype, ``BK`` dividing
    BLOCK_M (the K loop's last step must stay inside the expert's zero padding)."""
    if _wgrad_env() == "grouped_mm" or not (a_rows.is_cuda or interpreted()):
        return False
    if a_rows.dtype != b_rows.dtype or out_dtype != a_rows.dtype:
        return False
    if layout.block_m % cfg["BK"] or a_rows.shape[0] != b_rows.shape[0]:
        return False
    return _tma_usable(a_rows) and _tma_usable(b_rows)


def wgrad_ws_config() -> dict:
    """Block config of the warp-specialized weight-gradient mode (``kernels/moe_ws.py``);
    ``MOE_OVERLAP_WGRAD_WS_CONFIG=BN,BK,STAGES,GROUP_M,EPI_REGS`` pins one (``BK`` must divide
    BLOCK_M). Triton 3.6 ptxas at the default (128x256x64, 3 stages): no spills."""
    return _ws_config("MOE_OVERLAP_WGRAD_WS_CONFIG")


def _wgrad_ws_usable(a_rows, b_rows, layout: Layout, world: World) -> bool:
    """``MOE_OVERLAP_WGRAD`` ``auto`` or ``ws`` and what :func:`_ws_common_ok` says (one rank,
    Hopper, 16-bit, TMA-aligned, compiled), ``BK`` dividing BLOCK_M."""
    if _wgrad_env() not in ("auto", "ws"):
        return False
    if not _ws_common_ok(a_rows, b_rows, layout, world) or b_rows.shape[1] % 8:
        return False
    return layout.block_m % wgrad_ws_config()["BK"] == 0


def _launch_wgrad_ws(a_rows, b_rows, layout: Layout, world: World, out):
    from ..kernels.moe_ws import wgrad_ws

    cfg = wgrad_ws_config()
    El, A, B = out.shape
    n = El * -(-A // cfg["BM"]) * -(-B // cfg["BN"])
    grid = max(1, min(n, getattr(world, "max_programs", 132)))
    return wgrad_ws(a_rows, b_rows, layout.expert_start, layout.expert_end, out, cfg, grid)


def _grouped_wgrad(a_rows, b_rows, layout: Layout, out_dtype, world: World):
    """``out[l] = a_rows[rows of l]^T @ b_rows[rows of l]`` -> ``[El, A, B]``.

    Padding rows inside the experts' padded ranges are zero in both operands, so each expert
    can use its whole padded range; rows past the last range are unspecified.
    One rank on Hopper (``MOE_OVERLAP_WGRAD`` auto, the default): the warp-specialized kernel
    of ``kernels/moe_ws.py``, whose contraction stops at each expert's real rows (the padding
    is ~20% of deepseek-v3's rows; measured on the H200 2026-12-05: MoELayer forward+backward
    7.41 against 7.63 ms at qwen3-30b-a3b, 9.05 against 9.29 at olmoe, 41.3 against 42.7 at
    deepseek-v3). ``MOE_OVERLAP_WGRAD=kernel``: the Triton ``kernels/moe_wgrad.py`` (43.3 ms
    at deepseek-v3: its tiles' loads wait behind the previous tile's epilogue).
    bf16 on the GPU: one ``torch._grouped_mm``. Otherwise one matmul per expert on its row
    range, which needs the ranges on the host (a sync) - except for emulated ranks sharing a
    GPU, whose backward must never block autograd's shared worker thread: there, a masked
    product per expert (El times the work; test sizes only).
    """
    El = layout.local_experts
    BM = layout.block_m
    A, B = a_rows.shape[1], b_rows.shape[1]
    cfg = wgrad_config()
    usable = _wgrad_kernel_usable(a_rows, b_rows, layout, out_dtype, cfg)
    if usable and _wgrad_ws_usable(a_rows, b_rows, layout, world):
        out = torch.empty(El, A, B, dtype=out_dtype, device=a_rows.device)
        return _launch_wgrad_ws(a_rows, b_rows, layout, world, out)
    if usable and _wgrad_env() in ("kernel", "ws"):
        out = torch.empty(El, A, B, dtype=out_dtype, device=a_rows.device)
        n = El * -(-A // cfg["BM"]) * -(-B // cfg["BN"])
        n = n if cfg["GRID"] == "tiles" and not interpreted() else _programs(world, n)
        starts, ends = layout.expert_start, layout.expert_end
        with launch_lock():
            return moe_wgrad.grouped_wgrad(a_rows, b_rows, starts, ends, out, cfg, n)
    if (
        a_rows.is_cuda
        and a_rows.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and A % 8 == 0
        and B % 8 == 0
    ):
        ends = layout.expert_start + (layout.expert_end - layout.expert_start + BM - 1) // BM * BM
        try:
            return torch._grouped_mm(
                a_rows.t(), b_rows, offs=ends.to(torch.int32), out_dtype=out_dtype
            )
        except (RuntimeError, TypeError):
            pass
    out = torch.empty(El, A, B, dtype=out_dtype, device=a_rows.device)
    if a_rows.is_cuda and world.backend == "emulated" and world.world_size > 1:
        rl = layout.row_local_expert
        valid = _valid_rows(layout)
        for le in range(El):
            m = ((rl == le) & valid)[:, None]
            a = torch.where(m, a_rows, torch.zeros_like(a_rows)).float()
            b = torch.where(m, b_rows, torch.zeros_like(b_rows)).float()
            out[le] = (a.t() @ b).to(out_dtype)
        return out
    # Whole padded ranges, as the grouped_mm path reads them: so the CPU suite checks the
    # zero-padding contract the GPU path relies on.
    starts = layout.expert_start.tolist()
    counts = (layout.expert_end - layout.expert_start).tolist()
    for le in range(El):
        s, e = starts[le], starts[le] + -(-counts[le] // BM) * BM
        out[le] = (a_rows[s:e].float().t() @ b_rows[s:e].float()).to(out_dtype)
    return out


def _weights_grad(o, dy, layout: Layout) -> torch.Tensor:
    """``d w[a] = <o[slot_of[a]], dy[a // K]>`` in fp32 -> ``[T * K]`` (0 for dropped ones).

    On the GPU (and in the interpreter) one kernel reads ``o`` in place; plain CPU tensors take
    the torch form."""
    if o.is_cuda or interpreted():
        with launch_lock():
            return row_dot(o, dy, layout.slot_of, layout.top_k, interpreted())
    T, H = dy.shape
    slot = layout.slot_of.long()
    o_rows = o.index_select(0, slot.clamp(min=0)).view(T, layout.top_k, H)
    d_w = torch.bmm(o_rows.float(), dy.float().view(T, H, 1)).view(-1)
    return torch.where(slot >= 0, d_w, torch.zeros_like(d_w))


def _mask_rows(t, valid):
    return torch.where(valid[:, None], t, torch.zeros_like(t))


def _forward_impl(x, topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad):
    """Forward; returns ``(y, saved)`` where ``saved`` holds what the backward needs."""
    if (
        world.concurrent
        and world.device.type == "cuda"
        and world.world_size > 1
        and not world.in_backward
    ):
        # Load every kernel variant of this forward *and* its backward before any rank launches
        # one: measured on the H200, a module load issued while peers' kernels of this op ran
        # (the backward's variants, loaded after the forward's launches) blocked for good.
        with warmup_only():
            _forward_body(x, topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad)
        world.barrier()
    return _forward_body(x, topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad)


def _fwd_layer0(x, layout, w1, world, activation, b1, ws, save_gu=False, trace=None, a_rows=None):
    """Forward layer 0 (dispatch + GEMM + activation) -> ``(h [R, F], gu or None)``; shared by
    :func:`fused_experts` and the public :func:`layer0`."""
    F = w1.shape[1] // 2 if activation == "swiglu" else w1.shape[1]
    return _launch_layer0(
        x,
        layout,
        w1,
        world,
        activation,
        bias=None if b1 is None else b1.contiguous(),  # the kernels read bias rows densely
        save_gu=save_gu,
        n_out=F,
        stride_wn=w1.stride(1),
        stride_wk=w1.stride(2),
        stage_ws=ws,
        trace=trace,
        a_rows=a_rows,
    )


def _fwd_layer1(h, layout, wflat, w2, world, b2, row_slot, ws, save_o=False, trace=None):
    """Forward layer 1 (GEMM + combine) -> ``(y [T, H], o or None)``; shared like
    :func:`_fwd_layer0`."""
    return _launch_layer1(
        h,
        layout,
        w2,
        world,
        None if b2 is None else b2.contiguous(),
        wflat,
        row_slot,
        ws,
        k_dim=w2.shape[2],
        n_out=w2.shape[1],
        stride_wn=w2.stride(1),
        stride_wk=w2.stride(2),
        save_o=save_o,
        trace=trace,
    )


def _forward_body(x, topk_weights, w1, w2, b1, b2, world, layout, activation, need_grad):
    ws = _workspace(world, layout, x.shape[1], x.dtype)
    # One rank: the rows wgrad needs are gathered first and are layer 0's (TMA) A operand too.
    x_rows = _gather_rows(layout, x, ws.recv) if need_grad and world.world_size == 1 else None
    h, gu = _fwd_layer0(x, layout, w1, world, activation, b1, ws, save_gu=need_grad, a_rows=x_rows)
    row_slot = _row_slots(layout, ws.slot)
    if need_grad and x_rows is None:
        # The receive buffer is workspace (reused by the next op): copy the rows wgrad needs now.
        x_rows = _gather_rows(layout, x, ws.recv)
    wflat = topk_weights.contiguous().view(-1)
    y, o = _fwd_layer1(h, layout, wflat, w2, world, b2, row_slot, ws, save_o=need_grad)
    saved = None
    if need_grad:
        saved = dict(h=h, gu=gu, x_rows=x_rows, o=o, row_slot=row_slot)
        if warming_up():  # see _forward_impl
            _warm_backward(x, topk_weights, w1, w2, world, layout, activation, saved, ws)
    return y, saved


def _bwd_row_scale(layout: Layout, wflat, row_slot) -> torch.Tensor:
    """``[R]`` fp32: the combine weight of each local row (its dy row is scaled by it), 1 for
    rows peers send (already scaled there), 0 for padding. One kernel on the GPU and in the
    interpreter (``kernels/gather_rows.py``), else seven torch ops (the reference for it)."""
    if layout.row_tok.is_cuda or interpreted():
        with launch_lock():
            return _row_scale_kernel(
                layout.row_tok, row_slot, layout.sorted_assign, wflat, interpreted()
            )
    tok = layout.row_tok
    sent = (tok == -1).to(torch.float32)
    if not wflat.numel():
        return sent
    local = tok >= 0
    a = layout.sorted_assign.index_select(0, torch.where(local, row_slot, 0))
    return torch.where(local, wflat.index_select(0, a).to(torch.float32), sent)


def _dw_slot(layout: Layout, world: World, b2, dy, F: int):
    """The ``dw_slot`` argument of the backward's dispatch GEMM (the rows' slots), or None:
    whether the backward takes d topk_weights from that GEMM's epilogue partials
    (``kernels/row_dot.py``) instead of re-reading ``o`` with ``row_dot``. One rank, kernels
    only (GPU or the interpreter), no ``b2``, and only where the GEMM is narrower than the
    rows ``row_dot`` reads (``F < H``). The epilogue's extra work grows with ``R x F``,
    ``row_dot``'s traffic with ``T K x H``: measured on the H200 (2026-12-04, sweep_bwd.py) the
    dispatch GEMM took +0.09 ms at qwen3-30b-a3b (F 768, H 2048) against row_dot's 0.18 ms,
    but +0.30 ms at mixtral-8x7b (F 14336, H 4096) against ~0.08.
    Not in fp16: the GEMM's A rows are ``w * dy`` in the input dtype, and fp16's range turns
    them subnormal or zero for ordinary small weights (a 1e-6 weight gave d w = 0), where bf16
    and fp32 keep fp32's exponent range.
    ``MOE_OVERLAP_DW_EPILOGUE=0`` / ``1`` forces it off / on (A/B runs, tests)."""
    env = os.environ.get("MOE_OVERLAP_DW_EPILOGUE")
    if world.world_size != 1 or b2 is not None or not (dy.is_cuda or interpreted()):
        return None
    if env == "0" or dy.dtype not in (torch.bfloat16, torch.float32):
        return None
    return layout.row_slot if env == "1" or F < dy.shape[1] else None


def _ws_config(env: str) -> dict:
    cfg = dict(BM=128, BN=256, BK=64, STAGES=3, GM=8, EPI_REGS=184, MAXNREG=168)
    v = tuning.getenv(env)
    if v:
        try:
            parts = [int(q) for q in v.split(",")]
        except ValueError:
            parts = []
        ok = len(parts) == 5 and parts[0] in (64, 128, 256) and parts[1] in (32, 64, 128)
        if not ok or parts[2] < 2 or parts[3] < 1 or parts[4] % 8 or not 24 <= parts[4] <= 256:
            raise ValueError(
                f"{env}={v!r}: expected BN,BK,STAGES,GROUP_M,EPI_REGS with"
                " BN in 64/128/256, BK in 32/64/128, STAGES >= 2, EPI_REGS a multiple of 8"
                " in [24, 256]"
            )
        cfg.update(BN=parts[0], BK=parts[1], STAGES=parts[2], GM=parts[3], EPI_REGS=parts[4])
    carry = tuning.getenv("MOE_OVERLAP_WS_CARRY")
    if carry:
        if carry not in ("0", "1"):
            raise ValueError(f"MOE_OVERLAP_WS_CARRY must be 0 or 1, got {carry!r}")
        cfg["CARRY"] = carry == "1"
    split = tuning.getenv("MOE_OVERLAP_WS_SPLIT")
    if split:
        if split not in ("0", "1"):
            raise ValueError(f"MOE_OVERLAP_WS_SPLIT must be 0 or 1, got {split!r}")
        cfg["SPLIT"] = split == "1"
    # the ring of A and B tiles plus the hand-off tile, 16-bit: a block may have 227 KiB
    smem = 2 * (cfg["STAGES"] * (cfg["BM"] + cfg["BN"]) * cfg["BK"] + cfg["BM"] * cfg["BN"])
    if smem > 227 * 1024:
        raise ValueError(f"{env}={v!r}: needs {smem // 1024} KiB of shared memory, over 227")
    return cfg


def dact_ws_config() -> dict:
    """Block config of the warp-specialized backward dispatch GEMM (``kernels/moe_ws.py``).
    ``MOE_OVERLAP_DACT_WS_CONFIG=BN,BK,STAGES,GROUP_M,EPI_REGS`` pins one (A/B runs); the
    register split is checked by ptxas: at 128x256x64, 3 stages, the epilogue's 4 warps at 184
    registers and the MMA warp groups at 160 (``maxnreg`` 168 over 12 warps; Triton 3.6 ptxas:
    8 bytes of spills a thread, 438 at 152)."""
    return _ws_config("MOE_OVERLAP_DACT_WS_CONFIG")


def layer0_ws_config() -> dict:
    """Block config of the warp-specialized SwiGLU forward (``kernels/moe_ws.py``): ``BN``
    counts gate and up columns together (256: 128 of each). ``MOE_OVERLAP_L0_WS_CONFIG=BN,BK,
    STAGES,GROUP_M,EPI_REGS`` pins one. Triton 3.6 ptxas at the default (128x256x64, 3 stages,
    epilogue 184 / MMA 160 registers): no spills, 208 KiB of shared memory."""
    cfg = _ws_config("MOE_OVERLAP_L0_WS_CONFIG")
    if cfg["BN"] < 128:  # the epilogue takes each half in 64-column pieces
        raise ValueError("MOE_OVERLAP_L0_WS_CONFIG: BN must be 128 or 256 (gate + up columns)")
    return cfg


def layer1_ws_config() -> dict:
    """Block config of the warp-specialized layer-1 GEMM (``kernels/moe_ws.py``, rows to their
    slots; forward ``h @ w2^T`` and the backward's ``d gu @ w1``).
    ``MOE_OVERLAP_L1_WS_CONFIG=BN,BK,STAGES,GROUP_M,EPI_REGS`` pins one. Triton 3.6 ptxas at the
    default (128x256x64, 3 stages, epilogue 184 / MMA 160 registers): no spills."""
    return _ws_config("MOE_OVERLAP_L1_WS_CONFIG")


def _ws_common_ok(a, w, layout: Layout, world: World) -> bool:
    """What every warp-specialized kernel needs: one rank, a Hopper GPU, 16-bit operands of one
    dtype, 128-row expert tiles (the two MMA warp groups cover 128 rows), contiguous TMA-aligned
    operands, compiled (Gluon does not run in the interpreter)."""
    if interpreted() or world.world_size != 1 or not a.is_cuda:
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        return False
    if torch.cuda.get_device_capability(a.device)[0] != 9 or layout.block_m != 128:
        return False
    if a.shape[1] % 8 or not (_tma_usable(w) and _tma_usable(a)):
        return False
    from ..kernels import moe_ws

    return moe_ws.HAVE_GLUON


def _l0_ws_usable(x, w1, layout: Layout, world: World, act: str, bias, trace) -> bool:
    """Whether layer 0's forward takes the warp-specialized Gluon kernel: SwiGLU, what
    :func:`_ws_common_ok` says, no bias, no trace (its tiles record no timeline), int32-safe
    offsets, F >= 2. ``MOE_OVERLAP_L0_WS=0`` keeps the Triton kernel."""
    if tuning.getenv("MOE_OVERLAP_L0_WS") == "0" or bias is not None or trace is not None:
        return False
    if act != "swiglu" or not _ws_common_ok(x, w1, layout, world) or w1.dim() != 3:
        return False
    R, H = layout.rows_cap, x.shape[1]
    F = w1.shape[1] // 2
    if tuple(w1.shape[1:]) != (2 * F, H) or R == 0 or R * max(2 * F, H) >= 2**31:
        return False
    # F = 1 makes the kernel's N and h's row stride 1, which Triton turns into constants where
    # the kernel declares tensors: it would not compile.
    return F >= 2


def _dact_ws_usable(a_rows, w2, gu, layout: Layout, world: World, act: str) -> bool:
    """Whether the backward's dispatch GEMM takes the warp-specialized Gluon kernel: SwiGLU, what
    :func:`_ws_common_ok` says, the rows already gathered (its A operand comes by TMA), int32-safe
    offsets. ``MOE_OVERLAP_DACT_WS=0`` keeps the Triton kernel (A/B runs)."""
    if tuning.getenv("MOE_OVERLAP_DACT_WS") == "0" or a_rows is None:
        return False
    if act != "swiglu" or not _ws_common_ok(a_rows, w2, layout, world):
        return False
    R = a_rows.shape[0]
    F = w2.shape[2]
    if F % 8 or not gu.is_contiguous() or R * 2 * F >= 2**31 or gu.shape != (R, 2 * F):
        return False
    return True


def _l1_ws_usable(h, w, layout: Layout, world: World, bias, trace, k_dim, n_out, stride_wk):
    """Whether a layer-1 GEMM (``h [R, k_dim] @ B -> [., n_out]``, rows to their slots) takes
    the warp-specialized Gluon kernel: what :func:`_ws_common_ok` says, no bias, no trace,
    ``h`` exactly ``[rows_cap, k_dim]``, ``w`` contiguous as ``[El, n_out, k_dim]`` (K-major:
    ``stride_wk`` 1) or ``[El, k_dim, n_out]``, TMA-aligned widths, int32-safe rows. Returns
    ``None`` (not usable) or whether ``w`` is K-major. ``MOE_OVERLAP_L1_WS=0`` keeps Triton."""
    if tuning.getenv("MOE_OVERLAP_L1_WS") == "0" or bias is not None or trace is not None:
        return None
    if not _ws_common_ok(h, w, layout, world) or w.dim() != 3:
        return None
    R = layout.rows_cap
    if tuple(h.shape) != (R, k_dim) or R == 0 or k_dim % 8 or n_out % 8:
        return None
    kmajor = stride_wk == 1
    want = (n_out, k_dim) if kmajor else (k_dim, n_out)
    if tuple(w.shape[1:]) != want or R * max(k_dim, n_out) >= 2**31:
        return None
    return kmajor


def _launch_l1_ws(h, w, comb, row_slot, layout: Layout, world: World, kmajor: bool):
    """The Gluon path of :func:`_launch_layer1`'s GEMM at one rank: rows into ``comb``."""
    from ..kernels.moe_ws import rows_ws

    cfg = layer1_ws_config()
    n_n = -(-comb.shape[1] // cfg["BN"])
    grid = max(1, min(layout.tiles_cap * n_n, getattr(world, "max_programs", 132)))
    rows_ws(h, w, comb, row_slot, layout, cfg, grid, kmajor)


def _launch_dact_ws(a_rows, w2, gu, layout: Layout, world: World, dw_slot):
    """The Gluon path of :func:`_bwd_dispatch` -> ``(d_gu [R, 2F], partials or None)``."""
    from ..kernels.moe_ws import dact_swiglu_ws

    cfg = dact_ws_config()
    R, F = a_rows.shape[0], w2.shape[2]
    out = torch.empty(R, 2 * F, dtype=a_rows.dtype, device=a_rows.device)
    n_n = -(-F // cfg["BN"])
    part = None
    if dw_slot is not None:
        part = torch.empty(layout.slots_cap_max, n_n, dtype=torch.float32, device=out.device)
    grid = max(1, min(layout.tiles_cap * n_n, getattr(world, "max_programs", 132)))
    dact_swiglu_ws(a_rows, w2, gu, out, layout, part, dw_slot, cfg, grid)
    return out, part


def _bwd_dispatch(dy, layout, w2, world, wflat, row_scale, ws, gu, act, a_rows=None, dw_slot=None):
    """Backward of the combine and the activation: dispatch ``dy * w`` into a GEMM with ``w2``
    (-> d h) whose epilogue applies ``act``'s derivative at the saved ``gu`` -> ``d gu``
    (zeros on padding rows).

    The backward and :func:`_warm_backward` both call this, so the warm-up compiles exactly the
    variants the backward launches. ``dw_slot``: see :func:`_launch_layer0`; returns
    ``(d_gu, partials or None)``. One rank on a Hopper GPU: the warp-specialized kernel of
    ``kernels/moe_ws.py`` where :func:`_dact_ws_usable` allows it."""
    if _dact_ws_usable(a_rows, w2, gu, layout, world, act):
        return _launch_dact_ws(a_rows, w2, gu, layout, world, dw_slot)
    return _launch_layer0(
        dy,
        layout,
        w2,
        world,
        "none",
        scale=wflat,
        row_scale=row_scale,
        n_out=w2.shape[2],
        stride_wn=w2.stride(2),
        stride_wk=w2.stride(1),
        stage_ws=ws,
        dact=act,
        pre=gu,
        a_rows=a_rows,
        a_rows_scaled=True,
        dw_slot=dw_slot,
    )


def _bwd_combine(d_gu, layout, w1, world, row_slot, ws, H):
    """Backward of the dispatch: combine ``d gu @ w1`` back to the sources (unweighted)."""
    dx, _ = _launch_layer1(
        d_gu,
        layout,
        w1,
        world,
        None,
        None,
        row_slot,
        ws,
        k_dim=d_gu.shape[1],
        n_out=H,
        stride_wn=w1.stride(2),
        stride_wk=w1.stride(1),
    )
    return dx


def _warm_backward(x, topk_weights, w1, w2, world, layout, activation, saved, ws):
    """Compile and load the backward's kernel variants (called inside the forward's warm-up):
    the backward of emulated ranks runs on autograd's one CUDA worker thread, where no barrier
    can protect a lazy kernel load."""
    wflat = topk_weights.contiguous().view(-1)
    with warmup_only():
        row_scale = torch.empty(layout.rows_cap, dtype=torch.float32, device=x.device)
        _bwd_dispatch(
            torch.empty_like(x), layout, w2, world, wflat, row_scale, ws, saved["gu"], activation
        )
        d_gu = torch.empty_like(saved["gu"])
        _bwd_combine(d_gu, layout, w1, world, saved["row_slot"], ws, x.shape[1])
        # the backward's other kernels too: the first of them runs while peers may still spin
        _weights_grad(saved["o"], torch.empty_like(x), layout)
        _gather_rows(layout, torch.empty_like(x), ws.recv, row_scale=row_scale)
        x_rows, h = saved["x_rows"], saved["h"]
        if _wgrad_kernel_usable(d_gu, x_rows, layout, w1.dtype, wgrad_config()):
            _grouped_wgrad(d_gu, x_rows, layout, w1.dtype, world)
            _grouped_wgrad(torch.empty_like(x_rows), h, layout, w2.dtype, world)


def _backward_impl(dy, saved, topk_weights, w1, w2, b1, b2, world, layout, act, x_dtype):
    world.in_backward = True
    try:
        return _backward_body(dy, saved, topk_weights, w1, w2, b1, b2, world, layout, act, x_dtype)
    finally:
        world.in_backward = False


def _backward_body(dy, saved, topk_weights, w1, w2, b1, b2, world, layout, act, x_dtype):
    h, gu, x_rows, o, row_slot = (saved[k] for k in ("h", "gu", "x_rows", "o", "row_slot"))
    # An empty dy counts as contiguous whatever its strides: ``y.sum()``'s gradient on a rank
    # with no tokens has strides (0, 0), which the row kernels refuse. Make it dense.
    dy = dy.contiguous().to(x_dtype) if dy.numel() else dy.new_empty(dy.shape, dtype=x_dtype)
    T, H = dy.shape
    K = layout.top_k
    ws = _workspace(world, layout, H, dy.dtype)
    wflat = topk_weights.contiguous().view(-1)

    # layer 1: dispatch dy * w (mirror of the combine) into a GEMM with w2 -> d h
    row_scale = _bwd_row_scale(layout, wflat, row_slot)
    # Padding rows are zero in g_rows (gathered) and in h (layer 0's epilogue writes them): the
    # grouped wgrad can take whole padded expert ranges without a masking pass.
    if world.world_size == 1:
        # One rank: the scaled rows wgrad needs are the dispatch GEMM's (TMA) A operand too, as
        # in the forward; and d topk_weights comes from partials its epilogue writes, without
        # reading o again (a bias b2 adds <b2, dy>, which the partials do not hold).
        g_rows = _gather_rows(layout, dy, ws.recv, row_scale=row_scale)
        dw_slot = _dw_slot(layout, world, b2, dy, w2.shape[2])
        d_gu, part = _bwd_dispatch(
            dy,
            layout,
            w2,
            world,
            wflat,
            row_scale,
            ws,
            gu,
            act,
            a_rows=g_rows,
            dw_slot=dw_slot,
        )
        if dw_slot is not None:
            with launch_lock():
                d_w = weights_grad_from_partials(
                    part, wflat, o, dy, layout.slot_of, K, interpreted()
                ).view(T, K)
        else:
            d_w = _weights_grad(o, dy, layout).view(T, K)
    else:
        # layer 1: d topk_weights from the saved expert rows (peers' partials would carry
        # weights applied on their source rank)
        d_w = _weights_grad(o, dy, layout).view(T, K)
        # peers' rows are in the receive buffer only once the dispatch has run
        d_gu, _ = _bwd_dispatch(dy, layout, w2, world, wflat, row_scale, ws, gu, act)
        g_rows = _gather_rows(layout, dy, ws.recv, row_scale=row_scale)
    d_w2 = _grouped_wgrad(g_rows, h, layout, w2.dtype, world)
    d_b2 = _expert_sum(g_rows, layout).to(b2.dtype) if b2 is not None else None

    # layer 0: combine d gu @ w1 back to the sources -> dx
    dx = _bwd_combine(d_gu, layout, w1, world, row_slot, ws, H)
    d_w1 = _grouped_wgrad(d_gu, x_rows, layout, w1.dtype, world)
    # rows past the last tile are never written: mask them for the bias's row sum
    d_b1 = None
    if b1 is not None:
        d_b1 = _expert_sum(_mask_rows(d_gu, _valid_rows(layout)), layout).to(b1.dtype)
    return dx, d_w.to(topk_weights.dtype), d_w1, d_w2, d_b1, d_b2


class _FusedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, b1, b2, world, layout, activation):
        need = any(ctx.needs_input_grad[:6])
        y, saved = _forward_impl(x, topk_weights, w1, w2, b1, b2, world, layout, activation, need)
        if need:
            ctx.save_for_backward(topk_weights, w1, w2, b1, b2, *saved.values())
            ctx.saved_keys = list(saved)
        ctx.world, ctx.layout, ctx.activation = world, layout, activation
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    @once_differentiable  # the kernels' gradients carry no graph: a double backward must raise
    def backward(ctx, dy):
        topk_weights, w1, w2, b1, b2, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.saved_keys, rest))
        grads = _backward_impl(
            dy,
            saved,
            topk_weights,
            w1,
            w2,
            b1,
            b2,
            ctx.world,
            ctx.layout,
            ctx.activation,
            ctx.x_dtype,
        )
        return (*grads, None, None, None)


# ------------------------------------------------------------------------------- public API
def expert_sizes(x, El: int, K: int, max_tokens_per_rank) -> dict:
    """What every rank of an expert-parallel world must share: the row width and dtype its
    peers' rows arrive in, the experts a rank owns (the id -> rank map), top-k and the static
    sizing the buffers are carved from. Checked twice over: by ``World.agree`` before anything
    runs where the world checks (emulated worlds), and with the count exchange everywhere."""
    return dict(
        H=x.shape[1],
        dtype=x.dtype,
        local_experts=El,
        top_k=K,
        max_tokens_per_rank=int(max_tokens_per_rank or 0),
    )


def layer0(x, layout: Layout, w1, world: World, activation: str = "swiglu", b1=None, trace=None):
    """Layer 0 alone (benchmarks): dispatch + grouped GEMM + activation -> ``h [R, F]`` rows
    in this rank's receive order (padding rows inside an expert's tiles are zero). Remembers
    the row slots on ``layout`` for :func:`layer1`. ``trace``: optional int64 ``[n, 6]`` buffer
    that receives one (rank, program, tile, start, wait done, end) row per GEMM tile (off: zero
    cost)."""
    check_layer0_args(x, layout, w1, world, activation, b1)
    ws = _workspace(world, layout, x.shape[1], x.dtype)
    trace = _check_trace(trace, x.device)
    h, _ = _fwd_layer0(x.contiguous(), layout, w1, world, activation, b1, ws, trace=trace)
    layout._row_slot_full = _row_slots(layout, ws.slot)
    return h


def layer1(h, layout: Layout, topk_weights, w2, world: World, b2=None, trace=None):
    """Layer 1 alone (benchmarks): grouped GEMM + combine -> ``y [T, H]`` (``trace`` as in
    :func:`layer0`, one row per GEMM tile)."""
    check_layer1_args(h, layout, topk_weights, w2, world, b2)
    ws = _workspace(world, layout, w2.shape[1], h.dtype)
    row_slot = getattr(layout, "_row_slot_full", layout.row_slot)
    wflat = topk_weights.contiguous().view(-1)
    trace = _check_trace(trace, h.device)
    y, _ = _fwd_layer1(h, layout, wflat, w2, world, b2, row_slot, ws, trace=trace)
    return y


def fused_experts(
    x,
    topk_ids,
    topk_weights,
    w1,
    w2,
    world: World | None = None,
    activation: str = "swiglu",
    b1=None,
    b2=None,
    max_tokens_per_rank: int | None = None,
):
    """``y [T, H] = sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x)`` over an EP world.

    Args:
      x: ``[T, H]`` float32/float16/bfloat16, this rank's tokens.
      topk_ids: ``[T, K]`` int, *global* expert ids in ``[0, E)``; -1 drops the assignment.
      topk_weights: ``[T, K]`` float (any float dtype; used in fp32).
      w1: ``[El, 2F, H]`` for SwiGLU (gate rows first, then up rows), else ``[El, F, H]``.
      w2: ``[El, H, F]``. Global id of local expert i is ``world.rank * El + i``.
      world: the expert-parallel world (default: ``moe_overlap.init_world()``).
      activation: ``"swiglu"``, ``"gelu"`` (exact erf), ``"relu"`` or ``"silu"``.
      b1: ``[El, 2F or F]`` or None; b2: ``[El, H]`` or None.
      max_tokens_per_rank: static worst-case sizing (no host sync; CUDA-graph capturable).
    Differentiable in x, topk_weights, w1, w2, b1, b2.
    """
    from ..world import default_world

    world = world if world is not None else default_world()
    T, H, F, El, K, E = _check_inputs(x, topk_ids, topk_weights, w1, w2, world, activation, b1, b2)
    if world.device.type == "cuda":
        check_ids_on_device(topk_ids, E)
    if torch.compiler.is_compiling():
        from .ops import fused_experts_op

        # Dense inputs, as the eager path passes: inductor pins a custom op's input strides
        # to those it traced, and a transposed view it saved can come back re-laid out.
        return fused_experts_op(
            x.contiguous(),
            topk_ids.contiguous(),
            topk_weights.contiguous(),
            w1.contiguous(),
            w2.contiguous(),
            None if b1 is None else b1.contiguous(),
            None if b2 is None else b2.contiguous(),
            world.name,
            activation,
            int(max_tokens_per_rank or 0),
        )
    sizes = expert_sizes(x, El, K, max_tokens_per_rank)
    world.agree("fused_experts", **sizes)
    pinned = tuning.pinned(world.device, x.dtype, H, F, E, K)
    layout = dispatch_layout(topk_ids, E, world, max_tokens_per_rank, pinned, sizes)
    if not torch.is_grad_enabled():
        # Inference under no_grad: the Function would see needs_input_grad (the weights
        # require grad) and run the training forward (rows gathered, gate/up saved) for nothing.
        # (biases go to the kernels dense in _fwd_layer0 / _fwd_layer1, on every path)
        y, _ = _forward_impl(
            x.contiguous(), topk_weights, w1, w2, b1, b2, world, layout, activation, False
        )
        return y
    return _FusedExpertsFn.apply(
        x.contiguous(), topk_weights, w1, w2, b1, b2, world, layout, activation
    )
