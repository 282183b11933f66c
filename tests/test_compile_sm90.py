"""The MoE kernels compile for sm_90 (the H200) on this CPU-only machine.

Triton's own ``ptxas`` runs without a GPU, so front-end and type errors that the interpreter
cannot see (non-constexpr globals, int32 tables cast to pointers, atomics on mismatched types)
fail here instead of on the device. Every role / world-size / activation variant the host code
can launch is compiled with the GPU block configs. Runs in a subprocess: this process has
``TRITON_INTERPRET=1``.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

# Shared by the compile scripts below (each runs in a subprocess of its own).
_HELPERS = textwrap.dedent(
    """
    def signature(fn, types, consts):
        # (signature, constexprs) of fn for triton.compile
        sig, cx = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name], cx[(i,)] = "constexpr", consts[name]
            else:
                sig[name] = types[name]
        return sig, cx


    def ptxas_v(ptx):
        # ptxas -v's report on ptx for sm_90a (fails on a ptxas error)
        import subprocess
        import tempfile
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.TemporaryDirectory() as d:
            open(f"{d}/k.ptx", "w").write(ptx)
            r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o",
                                f"{d}/k.o"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stderr
    """
)

_SCRIPT = textwrap.dedent(
    """
    import itertools
    import os
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_overlap.kernels import (gather_rows, moe_counts, moe_layer0, moe_layer1, moe_layout,
                                     router_topk, row_dot)

    TARGET = GPUTarget("cuda", 90, 32)
    # This process compiles every SHARDS-th variant from SHARD on (the test runs the shards
    # side by side: one core each).
    SHARD, SHARDS = map(int, os.environ.get("COMPILE_SHARD", "0/1").split("/"))
    calls = [0]

    def build(fn, types, consts, warps=8, stages=3):
        calls[0] += 1
        if (calls[0] - 1) % SHARDS != SHARD:
            return False
        names = fn.arg_names
        # constexpr parameters left out take their defaults (PUT, USE_NVSHMEM, ...)
        consts = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                      **consts)
        sig, cx = {}, {}
        for i, n in enumerate(names):
            if n in consts:
                sig[n] = "constexpr"
                cx[(i,)] = consts[n]
            else:
                sig[n] = types[n]
        src = ASTSource(fn=fn, signature=sig, constexprs=cx)
        triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
        return True

    def types_for(fn, ptr_types, default_int="i32"):
        out = {}
        for n in fn.arg_names:
            out[n] = ptr_types.get(n, default_int)
        return out

    n = 0
    dt = "bf16"
    l0_ptrs = dict(
        x_ptr="*" + dt, scale_ptr="*fp32", sorted_ptr="*i32", chunk_ptr="*i32",
        n_chunks_ptr="*i32", recv_table="*i64", slot_table="*i64", flag_table="*i64",
        pad_local="*i32", epoch_ptr="*i32", recv_local="*" + dt, row_tok_ptr="*i32",
        row_l_ptr="*i32", exp_end_ptr="*i32", n_tiles_ptr="*i32", slice_off_ptr="*i32",
        slice_cnt_ptr="*i32", flags_local="*i32", row_scale_ptr="*fp32", w_ptr="*" + dt,
        b_ptr="*" + dt, out_ptr="*" + dt, gu_ptr="*" + dt, err_ptr="*i64", budget="i64",
        trace_ptr="*i64", dw_ptr="*fp32", dw_slot_ptr="*i32",
    )
    t0 = types_for(moe_layer0._layer0_kernel, l0_ptrs)
    # forward (SwiGLU, saves gu) and the backward's dispatch GEMM with the SwiGLU / GELU
    # derivative in its epilogue (DACT)
    # B_MODE (weight tiles): 0 pointer loads, 1 TMA k-contiguous, 2 TMA n-contiguous
    # (backward), 3 SwiGLU's gate and up tiles in one 3-d box (forward); descriptor arguments
    # are None where unused.
    desc = {1: f"tensordesc<{dt}[128, 64]>", 2: f"tensordesc<{dt}[64, 128]>",
            3: f"tensordesc<{dt}[2, 128, 64]>"}
    variants = ((0, False, -1), (4, True, 0), (4, True, 1))
    for role, W, (act, scale, dact), tma in itertools.product(
        (0, 1, 2), (1, 2), variants, (False, True)
    ):
        if W == 1 and role != 0:
            continue
        mode = (2 if scale else 3) if tma else 0
        types = dict(t0, w_desc=desc.get(mode, "i32"))
        build(moe_layer0._layer0_kernel, types, dict(
            W=W, El=4, ROLE=role, ACT=act, HAS_BIAS=not scale, SAVE_GU=not scale,
            HAS_SCALE=scale, ROW_SCALE=scale, EVEN_K=True, BM=128, BN=128, BK=64, CH=64,
            BH=128, GROUP_M=8, USE_TIMER=True, TRACE=role == 0, DACT=dact, B_MODE=mode,
            a_desc=None, A_TMA=False, FLAT=False, **({} if mode else {"w_desc": None})))
        n += 1
    # One rank: A rows staged contiguously and loaded by TMA, tile loop flattened (no trace)
    # or not (trace on)
    for (act, scale, dact), flat in itertools.product(variants, (True, False)):
        mode = 2 if scale else 3
        types = dict(t0, w_desc=desc[mode], a_desc=f"tensordesc<{dt}[128, 64]>")
        build(moe_layer0._layer0_kernel, types, dict(
            W=1, El=4, ROLE=0, ACT=act, HAS_BIAS=not scale, SAVE_GU=not scale,
            HAS_SCALE=scale, ROW_SCALE=scale, EVEN_K=True, BM=128, BN=128,
            BK=64, CH=64, BH=128, GROUP_M=8, USE_TIMER=True, TRACE=not flat, DACT=dact,
            B_MODE=mode, A_TMA=True, FLAT=flat))
        n += 1
    # the training forward's SwiGLU epilogue in 1, 2 or 4 column slices (EPI_SUB), gate and up
    # tiles paired (mode 3) or apart (MOE_OVERLAP_L0_PAIR=0), h and gate/up stored by TMA
    # (O_TMA, as launched: 4 stages need 2 slices to fit) or by pointers
    for epi, mode, o_tma in itertools.product((1, 2, 4), (1, 3), (False, True)):
        if epi == 1 and not o_tma:
            continue  # the plain epilogue, compiled above
        bn = 128 // epi
        types = dict(t0, w_desc=desc[mode], a_desc=f"tensordesc<{dt}[128, 64]>",
                     out_desc=f"tensordesc<{dt}[128, {bn}]>",
                     gu_desc=f"tensordesc<{dt}[128, 1, {bn}]>")
        build(moe_layer0._layer0_kernel, types, dict(
            W=1, El=4, ROLE=0, ACT=0, HAS_BIAS=True, SAVE_GU=True, HAS_SCALE=False,
            ROW_SCALE=False, EVEN_K=True, BM=128, BN=128, BK=64, CH=64, BH=128, GROUP_M=16,
            USE_TIMER=True, TRACE=False, DACT=-1, EPI_SUB=epi, B_MODE=mode, A_TMA=True,
            FLAT=False, O_TMA=o_tma, **({} if o_tma else {"out_desc": None, "gu_desc": None})),
            stages=3 if epi == 1 else 4)
        n += 1
    # several ranks: TMA stores with the pointer-gathered rows (no staging), inference
    types = dict(t0, w_desc=desc[3], out_desc=f"tensordesc<{dt}[128, 64]>")
    build(moe_layer0._layer0_kernel, types, dict(
        W=2, El=4, ROLE=0, ACT=0, HAS_BIAS=False, SAVE_GU=False, HAS_SCALE=False,
        ROW_SCALE=False, EVEN_K=True, BM=128, BN=128, BK=64, CH=64, BH=128, GROUP_M=8,
        USE_TIMER=True, TRACE=True, DACT=-1, EPI_SUB=2, B_MODE=3, A_TMA=False, a_desc=None,
        FLAT=False, O_TMA=True, gu_desc=None), stages=4)
    n += 1
    # the one-rank backward's dispatch GEMM as launched: staged rows that carry the scale
    # already (ROW_SCALE off), no trace, unflattened, the "dact" config (4 stages)
    for dact in (0, 1):
        types = dict(t0, w_desc=desc[2], a_desc=f"tensordesc<{dt}[128, 64]>")
        build(moe_layer0._layer0_kernel, types, dict(
            W=1, El=4, ROLE=0, ACT=4, HAS_BIAS=False, SAVE_GU=False, HAS_SCALE=True,
            ROW_SCALE=False, EVEN_K=True, BM=128, BN=128, BK=64, CH=64, BH=128, GROUP_M=8,
            USE_TIMER=True, TRACE=False, DACT=dact, B_MODE=2, A_TMA=True, FLAT=False),
            stages=4)
        n += 1
    # ... and its 128x256 configs with the epilogue in 2, 4 or 8 column slices, writing the
    # d topk_weights partials (DW) as one rank launches it
    for dact, epi in itertools.product((0, 1), (2, 4, 8)):
        types = dict(t0, w_desc=f"tensordesc<{dt}[64, 256]>", a_desc=f"tensordesc<{dt}[128, 64]>")
        build(moe_layer0._layer0_kernel, types, dict(
            W=1, El=4, ROLE=0, ACT=4, HAS_BIAS=False, SAVE_GU=False, HAS_SCALE=True,
            ROW_SCALE=False, EVEN_K=True, BM=128, BN=256, BK=64, CH=64, BH=128, GROUP_M=8,
            USE_TIMER=True, TRACE=False, DACT=dact, EPI_SUB=epi, B_MODE=2, A_TMA=True,
            FLAT=False, DW=epi >= 4))
        n += 1
    l1_ptrs = dict(
        h_ptr="*" + dt, w_ptr="*" + dt, b_ptr="*" + dt, row_l_ptr="*i32", exp_end_ptr="*i32",
        n_tiles_ptr="*i32", row_src_ptr="*i32", row_slot_ptr="*i32", comb_local="*" + dt,
        comb_table="*i64", done_table="*i64", pad_local="*i32", epoch_ptr="*i32",
        err_ptr="*i64", budget="i64", trace_ptr="*i64",
    )
    t1 = types_for(moe_layer1._layer1_gemm_kernel, l1_ptrs)
    desc1 = {1: f"tensordesc<{dt}[256, 64]>", 2: f"tensordesc<{dt}[64, 256]>"}
    for W, bias, mode in itertools.product((1, 2), (False, True), (0, 1, 2)):
        types = dict(t1, h_desc=f"tensordesc<{dt}[128, 64]>", w_desc=desc1.get(mode, "i32"))
        none = {} if mode else {"h_desc": None, "w_desc": None}
        build(moe_layer1._layer1_gemm_kernel, types, dict(
            W=W, HAS_BIAS=bias, EVEN_K=True, ES=2, BM=128, BN=256, BK=64, GROUP_M=8,
            USE_TIMER=True, TRACE=bias, A_TMA=mode > 0, B_MODE=mode,
            FLAT=W == 1 and mode > 0 and not bias, **none))
        n += 1
    c_ptrs = dict(
        comb_local="*" + dt, slot_of_ptr="*i32", wts_ptr="*fp32", y_ptr="*" + dt,
        o_ptr="*" + dt, done_local="*i32", n_kept_ptr="*i32", err_ptr="*i64", budget="i64",
    )
    tc = types_for(moe_layer1._combine_kernel, c_ptrs)
    for W, has_w in itertools.product((1, 2), (False, True)):
        build(moe_layer1._combine_kernel, tc, dict(
            K_top=8 if W == 1 else 2, W=W, HAS_W=has_w, SAVE_O=has_w and W > 1, BT=32,
            BN=128 if W == 1 else 256, USE_TIMER=True), warps=4, stages=2)
        n += 1
    k_ptrs = dict(
        counts_ptr="*i32", out_ptr="*i32", buf_local="*i32", buf_table="*i64",
        flags_local="*i32", flag_table="*i64", pad_local="*i32", epoch_ptr="*i32",
        err_ptr="*i64", budget="i64",
    )
    tk = types_for(moe_counts._count_exchange_kernel, k_ptrs)
    for role in (0, 1, 2):
        build(moe_counts._count_exchange_kernel, tk, dict(W=2, ROLE=role, BE=16,
                                                           USE_TIMER=True), warps=4, stages=2)
        n += 1
    # Put path (kernels/put.py): emulated copies compile to a cubin; the NVSHMEM calls lower to
    # PTX that names them (linking needs libnvshmem_device.bc: tests/test_nvshmem.py).
    put = dict(put_mask_ptr="*i32", sig_local="*i64", sig_table="*i64",
               stage_rows="*" + dt, stage_slots="*i32", stage_out="*" + dt)

    class _Stop(Exception):
        pass

    def stop_at_ptx(*args):
        if not args:
            return ("moe_overlap_stop_at_ptx", "1")
        def stop(src, metadata):
            raise _Stop(src)
        args[1]["cubin"] = stop

    def build_put(fn, types, consts, nv, **kw):
        types = dict(types, **{k: v for k, v in put.items() if k in fn.arg_names})
        consts = dict(consts, PUT=True, USE_NVSHMEM=nv)
        if not nv:
            return build(fn, types, consts, **kw)
        triton.knobs.runtime.add_stages_inspection_hook = stop_at_ptx
        try:
            compiled = build(fn, types, consts, **kw)
        except _Stop as e:
            want = ("nvshmem_signal_wait_until" if fn is moe_layer1._combine_kernel
                    else "nvshmemx_putmem_signal_nbi_block")
            assert want in e.args[0], (fn, want)
        else:
            assert not compiled, "expected to stop at PTX"
        finally:
            triton.knobs.runtime.add_stages_inspection_hook = None

    for nv in (False, True):
        for role in (0,):  # both roles' code (the role split is a runtime branch)
            build_put(moe_layer0._layer0_kernel, dict(t0, w_desc=desc[1]), dict(
                W=2, El=4, ROLE=role, ACT=0, HAS_BIAS=False, SAVE_GU=True, HAS_SCALE=False,
                ROW_SCALE=False, EVEN_K=True, BM=128, BN=128, BK=64, CH=64, BH=128,
                GROUP_M=8, USE_TIMER=True, TRACE=False, DACT=-1, B_MODE=1, a_desc=None,
                A_TMA=False, FLAT=False), nv)
            build_put(moe_counts._count_exchange_kernel, tk, dict(
                W=2, ROLE=role, BE=16, USE_TIMER=True), nv, warps=4, stages=2)
            n += 2
        build_put(moe_layer1._layer1_gemm_kernel, dict(
            t1, h_desc=f"tensordesc<{dt}[128, 64]>", w_desc=desc1[1]), dict(
            W=2, HAS_BIAS=True, EVEN_K=True, ES=2, BM=128, BN=256, BK=64, GROUP_M=8,
            USE_TIMER=True, TRACE=False, A_TMA=True, B_MODE=1, FLAT=False), nv)
        build_put(moe_layer1._combine_kernel, tc, dict(
            K_top=2, W=2, HAS_W=True, SAVE_O=True, BT=32, BN=256, USE_TIMER=True), nv, warps=4,
            stages=2)
        n += 2
    g_ptrs = dict(x_ptr="*" + dt, recv_ptr="*" + dt, tok_ptr="*i32", scale_ptr="*fp32",
                  out_ptr="*" + dt)
    tg = types_for(gather_rows._gather_rows_kernel, g_ptrs)
    for recv, scale in ((True, True), (False, False)):
        build(gather_rows._gather_rows_kernel, tg, dict(HAS_RECV=recv, HAS_SCALE=scale, BR=32,
                                                        BH=128), warps=4, stages=2)
        n += 1
    tr = types_for(row_dot._row_dot_kernel, dict(o_ptr="*" + dt, dy_ptr="*" + dt,
                                                 slot_of_ptr="*i32", out_ptr="*fp32"))
    build(row_dot._row_dot_kernel, tr, dict(BA=32, BH=128), warps=4, stages=2)
    n += 1
    tp = types_for(row_dot._dw_from_partials_kernel, dict(
        part_ptr="*fp32", w_ptr="*fp32", o_ptr="*" + dt, dy_ptr="*" + dt, slot_of_ptr="*i32",
        out_ptr="*fp32", w_min="fp32"))
    build(row_dot._dw_from_partials_kernel, tp, dict(BA=64, BH=128), warps=4, stages=2)
    n += 1
    # the one-rank layout, int64 and int32 ids, at E 128 (EB 256) and 256 (EB 512)
    for idt, EB in itertools.product(("*i64", "*i32"), (256, 512)):
        build(moe_layout._hist_kernel, dict(ids_ptr=idt, hist_ptr="*i32", TK="i32", E="i32"),
              dict(BLK=128, EB=EB), warps=8, stages=1)
        build(moe_layout._place_kernel, types_for(moe_layout._place_kernel, dict(
            ids_ptr=idt, hist_ptr="*i32", cnt_ptr="*i32", sorted_ptr="*i32",
            slot_of_ptr="*i32", counts_ptr="*i32", start_ptr="*i32", end_ptr="*i32",
            n_kept_ptr="*i32", n_tiles_ptr="*i32")), dict(BLK=128, EB=EB), warps=4, stages=1)
        n += 2
    for EB in (256, 512):
        for per_tile in (True, False):
            build(moe_layout._rows_kernel, types_for(moe_layout._rows_kernel, dict(
                cnt_ptr="*i32", sorted_ptr="*i32", row_tok_ptr="*i32", row_src_ptr="*i32",
                row_l_ptr="*i32", row_slot_ptr="*i32")), dict(BR=128, EB=EB,
                PER_TILE=per_tile), warps=4, stages=1)
        build(moe_layout._key_start_kernel, dict(cnt_ptr="*i32", E="i32"), dict(EB=EB),
              warps=4, stages=1)
        n += 3
    for wt in ("*fp32", "*bf16"):
        build(gather_rows._row_scale_kernel, dict(tok_ptr="*i32", slot_ptr="*i32",
              sorted_ptr="*i32", w_ptr=wt, out_ptr="*fp32", R="i32"), dict(BR=1024), warps=4,
              stages=1)
        n += 1
    build(moe_layout._scan_kernel, dict(hist_ptr="*i32", cnt_ptr="*i32", NB="i32", E="i32"),
          dict(RB=64, EC=32), warps=4, stages=1)
    n += 1
    # the router's top-k, forward and backward, at E 128 (BT 32) and 256 (BT 16), K 8 and 6
    rf = dict(logits_ptr="*fp32", bias_ptr="*fp32", ids_ptr="*i64", w_ptr="*fp32",
              counts_ptr="*i64", scale="fp32")
    rb = dict(logits_ptr="*fp32", ids_ptr="*i64", dw_ptr="*fp32", dl_in_ptr="*fp32",
              out_ptr="*bf16", scale="fp32")
    for (BE, BT, K), sig, flag in itertools.product(((128, 32, 8), (256, 16, 6)), (False, True),
                                                    (False, True)):
        build(router_topk._topk_fwd_kernel, types_for(router_topk._topk_fwd_kernel, rf), dict(
            K=K, KP=8, BT=BT, BE=BE, SIGMOID=sig, HAS_BIAS=flag, NORM=not flag), warps=4,
            stages=1)
        build(router_topk._topk_bwd_kernel, types_for(router_topk._topk_bwd_kernel, dict(
            rb, out_ptr="*bf16" if flag else "*fp32")), dict(K=K, KP=8, BT=BT, BE=BE,
            SIGMOID=sig, NORM=not flag, HAS_DW=True, HAS_DL=flag, SPLIT=flag), warps=4,
            stages=1)
        n += 2
    print(f"compiled {n} MoE kernel variants for sm_90 (shard {SHARD} of {SHARDS}: "
          f"{len(range(SHARD, calls[0], SHARDS))} of {calls[0]} compiles)")
    """
)


def _compile_in_subprocess(script: str, tmp_path, shards: int = 1) -> str:
    """Run a compile script without the interpreter, in ``shards`` processes side by side (a
    script that reads ``COMPILE_SHARD``); their stdout joined (skips where no ptxas)."""
    procs = []
    for i in range(shards):
        env = dict(os.environ, COMPILE_SHARD=f"{i}/{shards}")
        env.pop("TRITON_INTERPRET", None)
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton-cache-{i}")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=600)
            if p.returncode != 0 and "ptxas" in stderr and "No such file" in stderr:
                pytest.skip("this Triton build ships no ptxas")
            assert p.returncode == 0, f"sm_90 compile failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
            out.append(stdout)
    finally:
        # a skip, a failure or a timeout in one shard must not leave the others compiling
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return "".join(out)


def _compiled(out: str, what: str) -> int:
    """Variants the shards of one compile test report together ("compiled N <what> ...")."""
    return sum(int(n) for n in re.findall(rf"compiled (\d+) {what} variants", out))


def test_moe_kernels_compile_for_sm90(tmp_path):
    # two processes: the CPU suite's machines have two cores, and this is its longest test
    out = _compile_in_subprocess(_SCRIPT, tmp_path, shards=2)
    assert out.count("compiled") == 2, out


_WS_SCRIPT = _HELPERS + textwrap.dedent(
    """
    import itertools
    import os
    import re
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type
    from moe_overlap.experts.fused import dact_ws_config
    from moe_overlap.kernels import moe_ws as m

    if not m.HAVE_GLUON:
        print("no gluon")
        raise SystemExit(0)
    from triton.experimental.gluon._runtime import GluonASTSource

    gl, fn = m.gl, m._moe_ws_kernel
    lay = gl.NVMMASharedLayout.get_default_for
    n = 0
    # the default config and the A/B ones the GPU tests run; backward (DW on/off; CARRY off, its
    # default, and on), forward (SAVE_GU on/off, bf16 and fp16), layer 1's rows (both weight
    # orientations: w2's K-major tiles, the backward combine's w1)
    D = (256, 64, 3, 8, 184)
    cases = [(c, "dact", dw, False, "bf16", False) for c, dw in itertools.product(
        (D, (128, 64, 4, 8, 152), (256, 64, 2, 16, 128)), (False, True))]
    cases += [(D, "dact", True, False, "bf16", True)]
    cases += [(c, "swiglu", False, save, dt, True) for c, save, dt in (
        (D, True, "bf16"), (D, False, "fp16"),
        ((128, 64, 4, 8, 152), True, "bf16"), ((256, 64, 2, 16, 128), False, "bf16"))]
    cases += [(c, mode, False, False, dt, carry) for c, mode, dt, carry in (
        (D, "rows_t", "bf16", True), (D, "rows", "bf16", True), (D, "rows_t", "fp16", False),
        ((128, 64, 4, 8, 152), "rows_t", "bf16", True),
        ((64, 64, 4, 8, 128), "rows", "bf16", True))]
    cases += [(D, "wgrad", False, False, "bf16", True),
              ((128, 64, 4, 8, 152), "wgrad", False, False, "fp16", True)]
    cases = [c + (False,) for c in cases]
    # SPLIT (one partition per MMA warp group, MOE_OVERLAP_WS_SPLIT): every row mode
    cases += [(D, "dact", True, False, "bf16", False, True),
              (D, "swiglu", False, True, "bf16", True, True),
              (D, "rows_t", False, False, "bf16", True, True),
              ((256, 64, 2, 16, 128), "rows", False, False, "fp16", True, True)]
    # every SHARDS-th case from SHARD on (the test runs its shards side by side)
    SHARD, SHARDS = map(int, os.environ.get("COMPILE_SHARD", "0/1").split("/"))
    for (BN, BK, ST, GM, ER), mode, DW, SAVE, dt, CARRY, SPLIT in cases[SHARD::SHARDS]:
        FWD, ROWS, KMAJ = mode == "swiglu", mode.startswith("rows"), mode in ("swiglu", "rows_t")
        WG = mode == "wgrad"
        cfg = dact_ws_config()
        BM = cfg["BM"]
        tdt, gdt = {"bf16": (torch.bfloat16, gl.bfloat16), "fp16": (torch.float16, gl.float16)}[dt]
        a = torch.empty(1024, 512, dtype=tdt)
        ad = m.TensorDescriptor.from_tensor(a, [BM, BK], lay([BM, BK], gdt))
        if WG:  # rows [R, M] / [R, N]: A boxes [BK, BM] (read transposed), B boxes [BK, BN]
            ad = m.TensorDescriptor.from_tensor(a, [BK, BM], lay([BK, BM], gdt))
            w = torch.empty(1024, 768, dtype=tdt)
            bd = m.TensorDescriptor.from_tensor(w, [BK, BN], lay([BK, BN], gdt))
        elif FWD:  # w1 [El * 2F, H], gate and up boxes of BN / 2 rows
            w = torch.empty(4 * 1536, 512, dtype=tdt)
            bd = m.TensorDescriptor.from_tensor(w, [BN // 2, BK], lay([BN // 2, BK], gdt))
        elif KMAJ:  # layer 1's w2 [El * H, F], [BN, BK] boxes
            w = torch.empty(4 * 2048, 512, dtype=tdt)
            bd = m.TensorDescriptor.from_tensor(w, [BN, BK], lay([BN, BK], gdt))
        else:  # w2 [El * H, F] (dact), w1 [El * 2F, H] (rows)
            w = torch.empty(4 * 512, 768, dtype=tdt)
            bd = m.TensorDescriptor.from_tensor(w, [BK, BN], lay([BK, BN], gdt))
        types = dict(a_desc=mangle_type(ad), b_desc=mangle_type(bd), pre_ptr="*" + dt,
                     out_ptr="*" + dt, row_l_ptr="*i32", exp_end_ptr="*i32", n_tiles_ptr="*i32",
                     dw_ptr="*fp32", dw_slot_ptr="*i32", KD="i32", N="i32", stride_pm="i32",
                     stride_om="i32", n_exp="i32")
        warps = 4 if SPLIT else 8  # SPLIT's default partition is one warp group
        consts = dict(BM=BM, BN=BN, BK=BK, STAGES=ST, GROUP_M=GM, DW=DW, FWD=FWD, SAVE_GU=SAVE,
                      ROWS=ROWS, B_KMAJOR=KMAJ, CARRY=CARRY, WGRAD=WG, EPI_WARPS=4,
                      EPI_REGS=ER, num_warps=warps, SPLIT=SPLIT, MMA_REGS=160)
        sig, cx = signature(fn, types, consts)
        # what a launch specializes on the GPU: 16-byte aligned pointers, sizes and strides
        # divisible by 16 (the row stores vectorize only so)
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name.endswith("_ptr") or name in ("KD", "N", "stride_pm", "stride_om")}
        src = GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "maxnreg": cfg["MAXNREG"]})
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared
        ptx = k.asm["ptx"]
        assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx
        assert ".reqntid 384" in ptx, "12 warps in all, split or not"
        if SPLIT:  # the second MMA warp group's own partition, at MMA_REGS
            assert "setmaxnreg.inc.sync.aligned.u32 \t160;" in ptx
        # the forward's B tile is K-major (w1's rows): wgmma reads it transposed, still n = BN
        assert f"m64n{BN}k16" in ptx, (BN, FWD)
        # the K loop keeps one wgmma group in flight: ptxas must not have to drain them (C7517,
        # "warpgroup.wait is injected ... to allow use of registers defined by GMMA")
        report = ptxas_v(ptx)
        assert "C7517" not in report, (BN, mode, DW, SAVE, report[-2000:])
        # nor serialize them (C7515: a non-wgmma instruction defines the accumulator)
        assert "C7515" not in report, (BN, mode, DW, SAVE, SPLIT, report[-2000:])
        spill = [ln for ln in report.splitlines() if "spill" in ln]
        print(mode, BN, ST, ER, DW, SAVE, dt, CARRY, SPLIT, spill)
        if (BN, BK, ST, GM, ER) == D:  # the default split keeps (nearly) every value in registers
            stores = int(re.search(r"(\\d+) bytes spill stores", report).group(1))
            assert stores <= 32, (mode, DW, SAVE, dt, spill)
        n += 1
    print(f"compiled {n} warp-specialized variants for sm_90")
    """
)


def test_warp_specialized_kernel_compiles_for_sm90(tmp_path):
    # The Gluon kernel (kernels/moe_ws.py: layer 0's forward and backward, layer 1's rows)
    # against the installed Triton's Gluon API, which still moves between releases (Triton 3.6
    # on the H200, 3.9 here): a renamed builtin fails here, not in the first GPU run. Every
    # variant fits in shared memory and keeps its register split (setmaxnreg) and wgmmas.
    out = _compile_in_subprocess(_WS_SCRIPT, tmp_path, shards=2)
    if "no gluon" in out:
        pytest.skip("this Triton has no Gluon")
    assert _compiled(out, "warp-specialized") == 22, out[-2000:]


_WGRAD_SCRIPT = _HELPERS + textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_overlap.kernels import moe_wgrad

    fn = moe_wgrad._wgrad_kernel
    n = 0
    # the default (one program an SM) and the two-programs-an-SM candidate
    for (BM, BN, BK, stages), smem_max in (((128, 256, 64, 3), 227), ((128, 128, 64, 2), 113)):
        types = dict(a_desc=f"tensordesc<bf16[{BK}, {BM}]>", b_desc=f"tensordesc<bf16[{BK}, {BN}]>",
                     o_desc=f"tensordesc<bf16[1, {BM}, {BN}]>", start_ptr="*i32", end_ptr="*i32",
                     El="i32", M="i32", N="i32")
        consts = dict(BM=BM, BN=BN, BK=BK, GROUP_M=8)
        sig, cx = signature(fn, types, consts)
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name in ("start_ptr", "end_ptr", "M", "N")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": stages})
        assert k.metadata.shared <= smem_max * 1024, (BN, k.metadata.shared)
        ptx = k.asm["ptx"]
        # wgmma on TMA tiles (A read transposed from shared memory), the output stored by TMA
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.3d.global.shared" in ptx
        report = ptxas_v(ptx)
        stores = int(re.search(r"(\\d+) bytes spill stores", report).group(1))
        assert stores == 0, report[-2000:]
        n += 1
    print(f"compiled {n} wgrad variants for sm_90")
    """
)


def test_wgrad_kernel_compiles_for_sm90(tmp_path):
    # kernels/moe_wgrad.py as launched on the H200: fits in shared memory (the two-programs
    # candidate twice), no spills, TMA loads and stores, wgmma
    assert "compiled 2 wgrad" in _compile_in_subprocess(_WGRAD_SCRIPT, tmp_path)


_WAIT_SCRIPT = textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_overlap.kernels import signals

    fn = signals._wait_kernel
    sig = dict(flag_ptr="*i32", target="i32", err_ptr="*i64", out_ptr="*i32", rank="i32",
               stage="constexpr", index="i32", budget="i64", USE_TIMER="constexpr")
    for warps in (4, 8):
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={(5,): 1, (8,): True}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        # the timer tensor's layout: one CTA tile of it (size x threads x warps) must fit in
        # the tensor, or warps hold replicas and reduce only their own reads
        n = int(re.search(r"tensor<(\\d+)xi64, #blocked>", ttgir).group(1))
        lay = re.search(r"#blocked = #ttg.blocked<\\{sizePerThread = \\[(\\d+)\\], "
                        r"threadsPerWarp = \\[(\\d+)\\], warpsPerCTA = \\[(\\d+)\\]", ttgir)
        size, threads, w = map(int, lay.groups())
        assert w == warps and size * threads * w <= n, (warps, n, lay.group(0))
        # the earlier timeout record is read once and shared, never by each thread
        assert "ld.volatile" not in ptx
        print("wait", warps, n, size, threads, w)
    """
)


def test_timed_waits_leave_their_loop_together(tmp_path):
    """A timed-out wait's exit must be one decision for the whole program: the loop body
    holds CTA barriers (the acquire poll's broadcast), so a warp leaving an iteration early
    pairs them with the wrong barriers (illegal instruction or a hang on the H200). Its
    inputs are the global timer, reduced over every warp, and the error record, read once."""
    out = _compile_in_subprocess(_WAIT_SCRIPT, tmp_path)
    assert "wait 4" in out and "wait 8" in out, out


_TP_SCRIPT = textwrap.dedent(
    """
    import itertools
    import os
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_overlap.kernels import ag_matmul, matmul_rs

    SHARD, SHARDS = map(int, os.environ.get("COMPILE_SHARD", "0/1").split("/"))
    seen = 0

    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16", gout_ptr="*bf16",
                g_local="*bf16", buf_local="*bf16", g_table="*i64", buf_table="*i64",
                flag_table="*i64", flags_local="*i32", ctr_ptr="*i32", pad_local="*i32",
                epoch_ptr="*i32", err_ptr="*i64", budget="i64")
    n = 0
    for fn, extra in ((ag_matmul._ag_matmul_kernel, dict(COPY_BLOCK=4096, SAVE_A=True,
                                                          DO_GEMM=True)),
                      (matmul_rs._matmul_rs_kernel, {})):
        for role, W, w64 in itertools.product((0, 1, 2), (1, 2), (False, True)):
            if W == 1 and role != 0:
                continue
            seen += 1
            if (seen - 1) % SHARDS != SHARD:
                continue
            consts = dict(W=W, ROLE=role, BM=128, BN=128, BK=64, HAS_BIAS=True, W64=w64,
                          USE_TIMER=True, **extra)
            sig, cx = {}, {}
            for i, name in enumerate(fn.arg_names):
                if name in consts:
                    sig[name], cx[(i,)] = "constexpr", consts[name]
                else:
                    sig[name] = ptrs.get(name, "i32")
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": 3})
            n += 1
    print(f"compiled {n} TP variants for sm_90")
    """
)


def test_tp_kernels_compile_for_sm90(tmp_path):
    # all_gather_matmul's and matmul_reduce_scatter's kernels in every role, with int32 and
    # int64 (W64: weights past 2**31 elements) tile offsets: the compiled front end refused
    # W64's offset helper (two return types) where the interpreter ran it (H100, 2026-12-05)
    out = _compile_in_subprocess(_TP_SCRIPT, tmp_path, shards=2)
    assert _compiled(out, "TP") == 16, out[-2000:]
