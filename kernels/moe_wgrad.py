"""The experts' weight gradients: ``out[l] = a[rows of l]^T @ b[rows of l]`` per local expert,
each expert's contraction stopped at its last real row.

The layout pads every expert's rows to a multiple of ``BLOCK_M`` (a GEMM tile never spans two
experts) and the padding rows are zero, so ``torch._grouped_mm`` can take whole padded ranges,
as ``fused._grouped_wgrad`` does by default: right, but the padding is work. The unfused
pipeline contracts over the real rows only. With random top-k routing the padded rows are
1.254x the real ones at deepseek-v3 (256 rows an expert on average, so about half the experts
take a third 128-row tile), 1.065x at qwen3-30b-a3b, 1.034x at olmoe, 1.016x at mixtral-8x7b
(BENCHMARKS.md, 2026-12-04). This kernel runs each expert's K loop to ``cdiv(rows, BK)``
steps: past the last real row it reads only the zero padding of its own range (``BK`` divides
``BLOCK_M``), so it needs no mask.

When it wins: where the padding is a large share (deepseek-v3's d w1 and d w2 took 10.2 + 5.2
ms in ``grouped_mm``, ~370 TFLOP/s on the real FLOPs); elsewhere it has to match
``grouped_mm``'s kernel on the same shapes. Measured on the H200 (2026-12-05, ``MoELayer``
forward+backward at deepseek-v3): 43.3 ms with it, 42.7 with ``grouped_mm``, 41.3 with the
warp-specialized Gluon kernel (``moe_ws.py``). So the default (``MOE_OVERLAP_WGRAD=auto``) takes
the Gluon kernel at one rank on Hopper and ``grouped_mm`` elsewhere; this one runs with
``MOE_OVERLAP_WGRAD=kernel`` (or ``ws`` where the Gluon kernel cannot).

How: one persistent program per SM walks (expert, M tile, N tile), expert-major so one expert's
rows stay in L2 while its tiles are made (``GROUP_M`` orders the tiles inside an expert). A
tiles come from ``a [R, M]`` as ``[BK, BM]`` TMA boxes read transposed by the dot (the wgmma
takes an M-major A from shared memory for 16-bit types), B tiles from ``b [R, N]`` as
``[BK, BN]`` boxes; the fp32 tile is rounded to the output dtype and stored by TMA through a
``[El, M, N]`` descriptor (a partial tile is clipped at the expert's M and N, never written
into the next expert). An expert without rows gets zeros. The store is asynchronous: it drains
while the next tile's main loop runs (its shared memory is waited on only at the next store),
but the next tile's first loads are issued after it, and with ~4 K steps a tile (deepseek-v3)
that bubble is a large share. Triton's loop fusion (``tl.range(flatten=True)``, as layer 1
uses) does not take this loop (the inner trip count is the expert's; the PTX is unchanged,
Triton 3.6 and 3.9). What may hide it instead is two programs an SM (``MOE_OVERLAP_WGRAD_GRID
=tiles`` with a config that fits twice in shared memory, e.g. ``128,128,64,8,2``), or the
warp-specialized Gluon kernel's ``WGRAD`` mode (``moe_ws.py``, ``MOE_OVERLAP_WGRAD=ws``), whose
loads run ahead across tiles and whose stores sit in their own partition: to be measured.

Budget (sm_90a, Triton 3.6 and 3.9 ptxas): 128x256x64, 3 stages, 8 warps: 208 KiB of shared
memory (3 x 48 KiB + the 64 KiB output tile), 154 registers, no spills.
"""

import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _wgrad_kernel(
    a_desc,
    b_desc,
    o_desc,
    start_ptr,
    end_ptr,
    El,
    M,
    N,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per = n_m * n_n
    for t in range(pid, El * per, nprog):
        le = t // per
        r = t - le * per
        group = GROUP_M * n_n
        first_m = (r // group) * GROUP_M
        gsize = tl.minimum(n_m - first_m, GROUP_M)
        mt = first_m + (r % group) % gsize
        nt = (r % group) // gsize
        s = tl.load(start_ptr + le)
        n_rows = tl.load(end_ptr + le) - s
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, n_rows, BK):
            a = a_desc.load([s + k0, mt * BM])
            b = b_desc.load([s + k0, nt * BN])
            acc = tl.dot(a.T, b, acc)
        o = acc.to(o_desc.dtype)
        o_desc.store([le, mt * BM, nt * BN], tl.reshape(o, (1, BM, BN)))


def grouped_wgrad(a_RM, b_RN, starts, ends, out, cfg: dict, n_programs: int):
    """Launch :func:`_wgrad_kernel`: ``out[l] = a_RM[starts[l]:ends[l]]^T @ b_RN[...]``.

    a_RM     ``[R, M]`` contiguous, 16-byte aligned rows; zero on every row of an expert's
             padded range past ``ends[l]`` (read up to the next multiple of ``BK``).
    b_RN     ``[R, N]``, same dtype and conditions.
    starts   ``[El]`` int32, first row of each expert's range (a multiple of ``BK``).
    ends     ``[El]`` int32, one past its last real row.
    out      ``[El, M, N]`` contiguous (fp32 accumulation, rounded to ``out.dtype``); every
             element is written.
    cfg      ``BM``, ``BN``, ``BK``, ``GM``, ``num_warps``, ``num_stages``.
    n_programs  persistent programs (each walks tiles ``pid, pid + n_programs, ...``).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    El, M, N = out.shape
    a_desc = TensorDescriptor.from_tensor(a_RM, [BK, BM])
    b_desc = TensorDescriptor.from_tensor(b_RN, [BK, BN])
    o_desc = TensorDescriptor.from_tensor(out, [1, BM, BN])
    launch(
        _wgrad_kernel,
        (n_programs,),
        a_desc,
        b_desc,
        o_desc,
        starts,
        ends,
        El,
        M,
        N,
        BM=BM,
        BN=BN,
        BK=BK,
        GROUP_M=cfg["GM"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


__all__ = ["grouped_wgrad"]
