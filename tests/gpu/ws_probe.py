"""Probe (not a pytest file): does Triton's automatic warp specialization pay for layer 0's
one-rank grouped SwiGLU GEMM on the H200?

python tests/gpu/ws_probe.py [PRESET ...]
A self-contained grouped GEMM with the SwiGLU epilogue (A rows staged contiguously, experts
padded to BM, both operands by device-side tensor descriptors, persistent grouped tile order),
compiled with and without ``warp_specialize`` on its tile loop, against ``torch._grouped_mm``
on the same GEMM. Checks each variant against a float32 torch twin first.

Measured on the H200 (torch 2.11, Triton 3.6, 2026-12-04): Triton does specialize the loop
(the kernel runs with 12 warps: a producer warpgroup beside two consumers) only at
``num_warps=4``, and the specialized kernel's output was wrong (NaN rows of the poisoned output
stayed, on every shape). Timed anyway it was 1.017x ``grouped_mm`` at qwen3-30b-a3b against
0.972x without it, 0.961-0.974x against 0.958x at olmoe, and slower at mixtral-8x7b (0.981x
against 0.999x) and deepseek-v3 (1.077x against 1.103x). Not worth a wrong kernel; the fused
kernels stay unspecialized. Run it again on a newer Triton.
"""

import functools
import sys

import torch
import triton
import triton.language as tl

from moe_overlap.bench.presets import get_moe_shape


@triton.jit
def _swiglu_gemm(a_ptr, w_ptr, out_ptr, row_l_ptr, exp_end_ptr, n_tiles_ptr, R, N, K, El,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 WS: tl.constexpr):  # fmt: skip
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[El * 2 * N, K], strides=[K, 1], block_shape=[BN, BK]
    )
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.load(n_tiles_ptr)
    n_n = tl.cdiv(N, BN)
    total = n_m * n_n
    for t in tl.range(pid, total, nprog, warp_specialize=WS):
        group = GROUP_M * n_n
        first_m = (t // group) * GROUP_M
        gsize = tl.minimum(n_m - first_m, GROUP_M)
        mt = first_m + (t % group) % gsize
        nt = (t % group) // gsize
        m0 = mt * BM
        n0 = nt * BN
        le = tl.load(row_l_ptr + m0)
        end = tl.load(exp_end_ptr + le)
        acc = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([m0, k0])
            b = w_desc.load([le * 2 * N + n0, k0])
            acc = tl.dot(a, b.T, acc)
            bu = w_desc.load([le * 2 * N + N + n0, k0])
            acc_u = tl.dot(a, bu.T, acc_u)
        h = acc * tl.sigmoid(acc) * acc_u
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        h = tl.where((rows < end)[:, None], h, 0.0)
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
            h.to(out_ptr.dtype.element_ty),
            mask=(cols < N)[None, :],
        )


def _layout(T, K, E, BM, gen):
    ids = torch.randint(0, E, (T * K,), generator=gen, device="cuda")
    cnt = torch.bincount(ids, minlength=E)
    pad = (cnt + BM - 1) // BM * BM
    start = torch.cumsum(pad, 0) - pad
    R = int(pad.sum())
    row_l = torch.repeat_interleave(torch.arange(E, device="cuda", dtype=torch.int32), pad)
    exp_end = (start + cnt).to(torch.int32)
    n_tiles = torch.tensor([R // BM], dtype=torch.int32, device="cuda")
    return cnt, start, R, row_l, exp_end, n_tiles


def main(presets):
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for name in presets:
        s = get_moe_shape(name)
        T, H, F, E, K = s.tokens, s.hidden, s.ffn, s.experts, s.topk
        gen = torch.Generator(device="cuda").manual_seed(0)
        BM = 128
        cnt, start, R, row_l, exp_end, n_tiles = _layout(T, K, E, BM, gen)
        a = torch.randn(R, H, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(E, 2 * F, H, device="cuda", generator=gen) * 0.02).bfloat16()
        # floor: grouped_mm on the unpadded rows
        rows = torch.cat(
            [torch.arange(int(st), int(st) + int(c), device="cuda") for st, c in zip(start, cnt)]
        )
        a_real = a[rows]
        offs = torch.cumsum(cnt, 0).to(torch.int32)
        fl = 2.0 * a_real.shape[0] * 2 * F * H
        wt = w.transpose(1, 2)
        t_gmm = triton.testing.do_bench(
            lambda a_real=a_real, wt=wt, offs=offs: torch._grouped_mm(a_real, wt, offs=offs),
            warmup=50,
            rep=300,
        )
        print(
            f"== {name}: R {R} H {H} 2F {2 * F} E {E}; grouped_mm {t_gmm:.3f} ms"
            f" ({fl / t_gmm / 1e9:.0f} TFLOP/s)"
        )
        # twin on a few experts
        ref = {}
        for e in (0, E // 2, E - 1):
            st, c = int(start[e]), int(cnt[e])
            gu = a[st : st + c].float() @ w[e].float().t()
            ref[e] = (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:], st, c)
        out = torch.empty(R, F, device="cuda", dtype=torch.bfloat16)
        for ws, warps, BN, stages, GM in [
            (False, 8, 128, 4, 8),
            (False, 8, 128, 3, 8),
            (True, 4, 128, 3, 8),
            (True, 4, 128, 4, 8),
            (True, 4, 128, 2, 8),
            (True, 4, 64, 4, 8),
            (True, 4, 128, 3, 16),
        ]:
            n_n = triton.cdiv(F, BN)
            grid = (min(nsm, (R // BM) * n_n),)

            run = functools.partial(
                _swiglu_gemm[grid], a, w, out, row_l, exp_end, n_tiles, R, F, H, E, BM=BM,
                BN=BN, BK=64, GROUP_M=GM, WS=ws, num_warps=warps, num_stages=stages,
            )  # fmt: skip
            try:
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                err = max(
                    ((out[st : st + c].float() - r).norm() / r.norm()).item()
                    for r, st, c in ref.values()
                )
                t = triton.testing.do_bench(run, warmup=50, rep=300)
                nw = run().metadata.num_warps
                print(
                    f"   ws={ws!s:5} warps {warps} (ran {nw}) BN {BN} stages {stages} GM {GM}:"
                    f" {t:.3f} ms"
                    f" {fl / t / 1e9:.0f} TFLOP/s, {t_gmm / t:.3f}x grouped_mm, rel err {err:.1e}"
                )
            except Exception as e:  # noqa: BLE001
                print(
                    f"   ws={ws} warps {warps} BN {BN} stages {stages}: FAILED"
                    f" {type(e).__name__}: {str(e)[:300]}"
                )


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b", "olmoe", "mixtral-8x7b"])
