"""Which grouped-GEMM structure closes the gap to ``torch._grouped_mm`` on the H200?

A device experiment, not a test: one kernel with constexpr switches for the choices the MoE
layers make (A rows gathered by pointer or loaded by TMA from contiguous rows; B by pointer or
by TMA; persistent tile loop or one tile per program; the persistent loop flattened with the
K loop; SwiGLU's two accumulators; rows scattered to slots in the epilogue), each timed against
``torch._grouped_mm`` on the same GEMM, on the Mixtral-8x7B and Qwen3-30B-A3B shapes (EP = 1,
16k tokens, bf16). Usage there: ``python tests/gpu/gemm_variants.py [--quick] > log``; writes
``gemm_variants.json`` under ``$OUT``.
"""

import json
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

DT = torch.float16 if "--cpu" in sys.argv else torch.bfloat16


@triton.jit
def _coords(t, n_m, n_n, GROUP_M: tl.constexpr):
    group = GROUP_M * n_n
    first_m = (t // group) * GROUP_M
    gsize = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (t % group) % gsize, (t % group) // gsize


@triton.jit
def _v_kernel(
    a_ptr,
    a_desc,
    row_tok_ptr,
    tile_le_ptr,
    exp_end_ptr,
    n_m,
    w_ptr,
    w_desc,
    out_ptr,
    slot_ptr,
    K,
    N,
    NW,
    stride_a,
    stride_we,
    stride_om,
    SWIGLU: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    PERSIST: tl.constexpr,
    FLAT: tl.constexpr,
    SCATTER: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    total = n_m * n_n
    step = total
    if PERSIST:
        step = tl.num_programs(0)
    for t in tl.range(pid, total, step, flatten=FLAT):
        mt, nt = _coords(t, n_m, n_n, GROUP_M)
        r0 = mt * BM
        le = tl.load(tile_le_ptr + mt)
        end = tl.load(exp_end_ptr + le)
        rows = r0 + tl.arange(0, BM)
        rmask = rows < end
        cols = nt * BN + tl.arange(0, BN)
        cmask = cols < N
        if not A_TMA:
            tok = tl.load(row_tok_ptr + rows, mask=rmask, other=0)
            a_row = a_ptr + tok.to(tl.int64) * stride_a
        w_base = w_ptr + le.to(tl.int64) * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            if A_TMA:
                a = a_desc.load([r0, k0])
            else:
                a = tl.load(a_row[:, None] + ks[None, :], mask=rmask[:, None], other=0.0)
            if B_TMA:
                b = w_desc.load([le * NW + nt * BN, k0]).T
            else:
                b = tl.load(
                    w_base + cols[None, :] * K + ks[:, None], mask=cmask[None, :], other=0.0
                )
            acc = tl.dot(a, b, acc)
            if SWIGLU:
                if B_TMA:
                    bu = w_desc.load([le * NW + N + nt * BN, k0]).T
                else:
                    bu = tl.load(
                        w_base + (cols[None, :] + N) * K + ks[:, None],
                        mask=cmask[None, :],
                        other=0.0,
                    )
                acc_u = tl.dot(a, bu, acc_u)
        if SWIGLU:
            h = acc * tl.sigmoid(acc) * acc_u
        else:
            h = acc
        h = h.to(out_ptr.dtype.element_ty)
        if SCATTER:
            slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(
                out_ptr + slot[:, None] * stride_om + cols[None, :],
                h,
                mask=rmask[:, None] & cmask[None, :],
            )
        else:
            tl.store(
                out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                tl.where(rmask[:, None], h, 0.0),
                mask=cmask[None, :],
            )


def make_problem(T, H, F, E, K, BM, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, dtype=DT, generator=g)
    logits = torch.randn(T, E, device=dev, generator=g)
    ids = logits.softmax(-1).topk(K, -1).indices.flatten()
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=E).cpu().tolist()
    padded = [-(-c // BM) * BM for c in counts]
    R = sum(padded)
    row_tok = torch.full((R,), -1, dtype=torch.int32)
    slot = torch.zeros(R, dtype=torch.int32)
    tile_le, exp_end, offs = [], [], []
    o, j, srt = 0, 0, order.cpu()
    for e in range(E):
        c = counts[e]
        row_tok[o : o + c] = (srt[j : j + c] // K).int()
        slot[o : o + c] = srt[j : j + c].int()
        exp_end.append(o + c)
        tile_le += [e] * (padded[e] // BM)
        j += c
        o += padded[e]
        offs.append(j)
    w1 = torch.randn(E, 2 * F, H, device=dev, dtype=DT, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, device=dev, dtype=DT, generator=g) / F**0.5
    rt = row_tok.to(dev)
    a_cont = torch.where((rt >= 0)[:, None], x[rt.clamp(min=0).long()], 0)
    h_cont = torch.randn(R, F, device=dev, dtype=DT, generator=g)
    h_cont[rt < 0] = 0
    return dict(
        T=T,
        H=H,
        F=F,
        E=E,
        K=K,
        R=R,
        x=x,
        w1=w1,
        w2=w2,
        row_tok=rt,
        slot=slot.to(dev),
        tile_le=torch.tensor(tile_le, dtype=torch.int32, device=dev),
        exp_end=torch.tensor(exp_end, dtype=torch.int32, device=dev),
        offs=torch.tensor(offs, dtype=torch.int32, device=dev),
        n_m=len(tile_le),
        sorted_x=x[(srt // K).to(dev)],
        valid=rt >= 0,
        a_cont=a_cont,
        h_cont=h_cont,
        counts=counts,
        ids=ids,
    )


def run_variant(p, layer, v):
    BM, BN, BK = 128, v["BN"], v["BK"]
    if layer == 0:
        N, Kd, NW, w = p["F"], p["H"], 2 * p["F"], p["w1"]
        a_full = p["a_cont"] if v["A_TMA"] else p["x"]
        out = torch.empty(p["R"], N, device=w.device, dtype=DT)
    else:
        N, Kd, NW, w = p["H"], p["F"], p["H"], p["w2"]
        a_full = p["h_cont"]
        out = torch.empty(p["T"] * p["K"], N, device=w.device, dtype=DT)
    a_desc = TensorDescriptor.from_tensor(a_full, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w.view(-1, Kd), [BN, BK])
    row_tok = p["row_tok"]
    if layer == 1:  # layer 1 reads h's rows in place
        row_tok = torch.arange(p["R"], device=w.device, dtype=torch.int32)
    n_n = -(-N // BN)
    total = p["n_m"] * n_n
    grid = (min(total, 132),) if v["PERSIST"] else (total,)

    def fn():
        _v_kernel[grid](
            a_full,
            a_desc,
            row_tok,
            p["tile_le"],
            p["exp_end"],
            p["n_m"],
            w,
            w_desc,
            out,
            p["slot"],
            Kd,
            N,
            NW,
            a_full.stride(0),
            w.stride(0),
            out.stride(0),
            SWIGLU=layer == 0,
            A_TMA=v["A_TMA"],
            B_TMA=v["B_TMA"],
            PERSIST=v["PERSIST"],
            FLAT=v["FLAT"],
            SCATTER=layer == 1,
            BM=BM,
            BN=BN,
            BK=BK,
            GROUP_M=v.get("GM", 8),
            num_warps=v["w"],
            num_stages=v["s"],
        )
        return out

    return fn


def reference(p, layer):
    if layer == 0:
        gu = torch._grouped_mm(p["sorted_x"], p["w1"].transpose(1, 2), offs=p["offs"])
        F = p["F"]
        return torch.nn.functional.silu(gu[:, :F].float()) * gu[:, F:].float()
    hv = p["h_cont"][p["valid"]]
    y = torch._grouped_mm(hv, p["w2"].transpose(1, 2), offs=p["offs"])
    out = torch.empty(p["T"] * p["K"], p["H"], device=y.device, dtype=y.dtype)
    out[p["slot"][p["valid"]].long()] = y
    return out.float()


def lib_fn(p, layer):
    """``moe_overlap.experts.fused.layer0`` / ``layer1`` (with its combine reduction)."""
    from moe_overlap import init_world
    from moe_overlap.experts.fused import dispatch_layout, layer0, layer1

    world = init_world("local")
    ids = p["ids"].view(p["T"], p["K"])
    lay = dispatch_layout(ids, p["E"], world)
    if layer == 0:
        return lambda: layer0(p["x"], lay, p["w1"], world, activation="swiglu")
    h = layer0(p["x"], lay, p["w1"], world, activation="swiglu")
    w = torch.rand(p["T"], p["K"], device=h.device)
    return lambda: layer1(h, lay, w, p["w2"], world)


def grouped_mm_fn(p, layer):
    if layer == 0:
        a, b = p["sorted_x"], p["w1"].transpose(1, 2)
    else:
        a, b = p["h_cont"][p["valid"]], p["w2"].transpose(1, 2)
    return lambda: torch._grouped_mm(a, b, offs=p["offs"])


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main():
    quick = "--quick" in sys.argv
    cpu = "--cpu" in sys.argv  # logic check in the interpreter: TRITON_INTERPRET=1, tiny, fp16
    out_dir = os.environ.get("OUT", ".")
    dev = "cpu" if cpu else "cuda"
    shapes = {
        "mixtral-8x7b": (16384, 4096, 14336, 8, 2),
        "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    }
    if cpu:
        shapes = {"tiny": (100, 128, 192, 4, 2)}
    V = lambda **k: dict(
        dict(A_TMA=False, B_TMA=False, PERSIST=True, FLAT=False, BN=128, BK=64, w=8, s=3), **k
    )  # noqa: E731
    l0 = [
        ("ptrA ptrB persist s3 (=lib)", V()),
        ("ptrA tmaB persist s3", V(B_TMA=True)),
        ("ptrA tmaB persist s4", V(B_TMA=True, s=4)),
        ("ptrA tmaB grid s3", V(B_TMA=True, PERSIST=False)),
        ("ptrA tmaB grid s4", V(B_TMA=True, PERSIST=False, s=4)),
        ("ptrA tmaB flat s3", V(B_TMA=True, FLAT=True)),
        ("ptrA ptrB grid s3", V(PERSIST=False)),
        ("tmaA tmaB persist s3", V(A_TMA=True, B_TMA=True)),
        ("tmaA tmaB grid s4", V(A_TMA=True, B_TMA=True, PERSIST=False, s=4)),
        ("tmaA tmaB flat s3", V(A_TMA=True, B_TMA=True, FLAT=True)),
        ("ptrA tmaB grid BN64 w4 s4", V(B_TMA=True, PERSIST=False, BN=64, w=4, s=4)),
    ]
    l1 = [
        ("ptrA ptrB persist BN256 s3 (=lib)", V(BN=256)),
        ("tmaA tmaB persist BN256 s3", V(A_TMA=True, B_TMA=True, BN=256)),
        ("tmaA tmaB grid BN256 s3", V(A_TMA=True, B_TMA=True, BN=256, PERSIST=False)),
        ("tmaA tmaB flat BN256 s3", V(A_TMA=True, B_TMA=True, BN=256, FLAT=True)),
        ("tmaA tmaB grid BN256 s4", V(A_TMA=True, B_TMA=True, BN=256, PERSIST=False, s=4)),
        ("ptrA tmaB grid BN256 s3", V(B_TMA=True, BN=256, PERSIST=False)),
        ("tmaA tmaB grid BN128 s4", V(A_TMA=True, B_TMA=True, PERSIST=False, s=4)),
    ]
    if quick:
        l0, l1 = l0[:2], l1[:2]
    results = []
    t_start = time.time()
    for sname, (T, H, F, E, K) in shapes.items():
        p = make_problem(T, H, F, E, K, 128, dev)
        for layer, variants in ((0, l0), (1, l1)):
            flops = 2 * T * K * H * F * (2 if layer == 0 else 1)
            ref = reference(p, layer)
            t_g = 1.0 if cpu else bench(grouped_mm_fn(p, layer))
            print(
                f"{sname} layer{layer} grouped_mm {t_g:.3f} ms {flops / t_g / 1e9:.0f} TFLOP/s",
                flush=True,
            )
            results.append(dict(shape=sname, layer=layer, name="grouped_mm", ms=t_g))
            try:  # the library's own op on the same routing, to calibrate this script
                t_lib = bench(lib_fn(p, layer))
                print(
                    f"  {'library layer' + str(layer):34s} {t_lib:.3f} ms "
                    f"{flops / t_lib / 1e9:.0f} TFLOP/s {t_g / t_lib:.3f}x",
                    flush=True,
                )
                results.append(
                    dict(shape=sname, layer=layer, name="library", ms=t_lib, vs_gmm=t_g / t_lib)
                )
            except Exception as e:
                print(f"  library FAILED {repr(e)[:300]}", flush=True)
            for name, v in variants:
                if time.time() - t_start > float(os.environ.get("BUDGET_S", 400)):
                    print("budget spent", flush=True)
                    break
                try:
                    fn = run_variant(p, layer, v)
                    o = fn().float()
                    if layer == 0:
                        o = o[p["valid"]]
                    err = ((o - ref).norm() / ref.norm()).item()
                    t = 1.0 if cpu else bench(fn)
                    r = dict(shape=sname, layer=layer, name=name, ms=t, vs_gmm=t_g / t, err=err)
                    print(
                        f"  {name:34s} {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s "
                        f"{t_g / t:.3f}x err {err:.1e}",
                        flush=True,
                    )
                except Exception as e:  # one variant failing must not end the experiment
                    r = dict(shape=sname, layer=layer, name=name, error=repr(e)[:300])
                    print(f"  {name:34s} FAILED {repr(e)[:300]}", flush=True)
                    traceback.print_exc(limit=2)
                results.append(r)
                with open(os.path.join(out_dir, "gemm_variants.json"), "w") as f:
                    json.dump(results, f, indent=1)
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
