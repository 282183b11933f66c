"""The nvshmem world on one CUDA GPU: one process, one PE (compiled Triton, nvshmem4py).

Run with ``MOE_OVERLAP_COMPILED=1 python -m pytest -m "gpu or multigpu" tests`` on a machine with
nvshmem4py installed (``pip install nvshmem4py-cu13``); skipped, with that command as
the reason, where it is not.

One world for the whole module (one NVSHMEM runtime per process; re-initializing after finalize
is not something this library relies on), over a one-process NCCL group made here:

* init and topology (one node, every peer reachable), refusal of a second world and of
  PyTorch's NVSHMEM backend appearing next to ours;
* symmetric allocation: peer table, stores through it, flags, workspace growth that frees the
  replaced buffer, host collectives;
* a Triton kernel that puts tiles to itself through ``libnvshmem_device.bc``
  (``putmem_signal_nbi_block``, SET per tile and ADD on one counter) while another program of the
  same launch waits for the signals (``wait_signal_geq``) and copies the data out: the data is
  checked, not only the flags;
* thread-scoped AMOs issued exactly once per program (4 warps), ``nvshmem_ptr`` to self,
  ``my_pe``/``n_pes``;
* a bounded wait that times out: ``CommTimeoutError`` from ``world.check()``;
* the toy op and the MoE layer forward on this world against the emulated one;
* finalize last: idempotent, and the world refuses work afterwards.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import triton
import triton.language as tl

from moe_overlap import CommTimeoutError, MoEConfig, MoELayer, init_world, local_world
from moe_overlap.kernels import nvshmem_device as nvd
from moe_overlap.kernels.signals import peer_ptr
from moe_overlap.testing import assert_close, free_port
from moe_overlap.toy import push_allreduce
from moe_overlap.world import interpreted, launch_lock
from moe_overlap.world import nvshmem as nvw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(interpreted(), reason="GPU tests run compiled (without TRITON_INTERPRET)"),
    pytest.mark.skipif(
        not nvw.nvshmem_available(), reason=f"nvshmem4py is not installed: {nvw.install_hint()}"
    ),
]

STAGE_TEST = 8
BUDGET_NS = 50_000_000  # 50 ms: the timeout test's wait budget


def _input(call, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(zlib.crc32(repr((call, tuple(shape))).encode()))
    return torch.randn(shape, generator=g).to(dtype)


@pytest.fixture(scope="module")
def nv_world():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "TORCH_SYMMMEM")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.pop("TORCH_SYMMMEM", None)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    os.environ.update(WORLD_SIZE="1", RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    world = None
    try:
        world = nvw.make_nvshmem_world()
        yield world
    finally:
        torch.cuda.synchronize()
        if world is not None:
            world.finalize()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------ init
def test_init_and_topology(nv_world):
    w = nv_world
    assert w.backend == "nvshmem"
    assert (w.rank, w.world_size, w.device.type) == (0, 1, "cuda")
    assert w.concurrent and w.use_timer and not w.finalized
    assert (w.node, w.local_rank, w.local_world_size, w.num_nodes) == (0, 0, 1, 1)
    assert w.peer_reachable(0) and w.all_peers_reachable and w.transport(0) == "store"
    assert (int(w._nv.core.my_pe()), int(w._nv.core.n_pes())) == (0, 1)
    assert nvd.runtime_ready()
    assert nvw.active_world() is w
    assert os.environ.get("NVSHMEM_DISABLE_NVLS") == "1"


def test_second_world_refused(nv_world):
    # init_world('nvshmem') reaches the same constructor; it must refuse, not re-bootstrap.
    with pytest.raises(RuntimeError, match="another NvshmemWorld is active"):
        init_world("nvshmem")
    assert nvw.active_world() is nv_world


def test_torch_nvshmem_backend_refused_after_start(nv_world, monkeypatch):
    monkeypatch.setenv("TORCH_SYMMMEM", "NVSHMEM")
    with pytest.raises(RuntimeError, match="PyTorch's NVSHMEM backend became active"):
        nv_world.alloc((4,), torch.float32)
    monkeypatch.delenv("TORCH_SYMMMEM")
    nv_world.alloc((4,), torch.float32)  # and the world goes on once it is gone


# ------------------------------------------------------------------------------ memory
@triton.jit(do_not_specialize=["rank"])
def _put_rows_kernel(src_ptr, table_ptr, rank, N: tl.constexpr, BN: tl.constexpr):
    # Program p writes row p of src into row [rank] of peer p's buffer (store path).
    p = tl.program_id(0)
    cols = tl.arange(0, BN)
    mask = cols < N
    vals = tl.load(src_ptr + p * N + cols, mask=mask)
    dst = peer_ptr(table_ptr, p, src_ptr.dtype.element_ty)
    tl.store(dst + rank * N + cols, vals, mask=mask)


@pytest.mark.parametrize(
    "shape,dtype",
    [((1, 1), torch.float32), ((1, 33), torch.float16), ((1, 1000), torch.bfloat16)],
    ids=str,
)
def test_symmetric_alloc(nv_world, shape, dtype):
    w = nv_world
    buf = w.alloc(shape, dtype)
    assert buf.local.shape == shape and buf.local.dtype == dtype and buf.local.is_cuda
    assert buf.ptrs.dtype == torch.int64 and buf.ptrs.device == w.device
    assert int(buf.ptrs[0]) == buf.local.data_ptr()
    src = _input(1, shape, dtype).cuda()
    buf.local.fill_(float("nan"))
    with launch_lock():
        _put_rows_kernel[(1,)](src, buf.ptrs, 0, N=shape[1], BN=triton.next_power_of_2(shape[1]))
    w.barrier()
    assert torch.equal(buf.local.cpu(), src.cpu())
    flags = w.signals(37)
    assert flags.local.dtype == torch.int32 and int(flags.local.abs().sum()) == 0


def test_workspace_growth_frees_the_old_buffer(nv_world):
    w = nv_world
    ws = w.workspace(1 << 20)
    kept = len(w._keep)
    ws.local.fill_(7)
    bigger = w.workspace(ws.local.numel() * 3)
    assert bigger.local.numel() >= ws.local.numel() * 3
    assert len(w._keep) == kept  # replaced, not accumulated
    assert bigger.local.data_ptr() != ws.local.data_ptr()  # (ws's memory is freed: not read)
    bigger.local.fill_(3)
    torch.cuda.synchronize()
    assert int(bigger.local[-1]) == 3
    assert int(bigger.ptrs[0]) == bigger.local.data_ptr()


def test_host_collectives(nv_world):
    w = nv_world
    assert w.all_gather_ints([3, -4, 1 << 40]) == [[3, -4, 1 << 40]]
    t = _input(2, (5, 7)).cuda()
    ref = t.clone()
    assert torch.equal(w.all_reduce(t), ref)
    recv = w.all_to_all([ref[:3]])
    assert len(recv) == 1 and torch.equal(recv[0], ref[:3])
    with pytest.raises(ValueError, match="all_to_all needs 1 tensors"):
        w.all_to_all([ref, ref])


# ------------------------------------------------------------------------------ device library
@triton.jit(do_not_specialize=["N", "n_tiles", "pe", "budget"])
def _put_tiles_kernel(
    src_ptr,
    dst_ptr,
    sig_ptr,
    out_ptr,
    err_ptr,
    N,
    n_tiles,
    pe,
    budget,
    SIG_OP: tl.constexpr,
    BN: tl.constexpr,
):
    # Programs 0..n_tiles-1 put tile t of src into dst on `pe` and signal; program n_tiles
    # waits for every tile's signal, then copies dst to out (the data, not only the flags).
    pid = tl.program_id(0)
    if pid < n_tiles:
        n = tl.minimum(BN, N - pid * BN)
        if SIG_OP == 9:  # SET: tile t raises its own word to t + 1
            nvd.putmem_signal_nbi_block(
                dst_ptr + pid * BN,
                src_ptr + pid * BN,
                n * 4,
                sig_ptr + 1 + pid,
                pid + 1,
                nvd.SIGNAL_SET,
                pe,
            )
        else:  # ADD: every tile adds 1 to one counter
            nvd.putmem_signal_nbi_block(
                dst_ptr + pid * BN, src_ptr + pid * BN, n * 4, sig_ptr, 1, nvd.SIGNAL_ADD, pe
            )
        nvd.quiet()
    else:
        nbad = tl.zeros((), tl.int32)
        if SIG_OP == 9:
            for t in range(n_tiles):
                ok = nvd.wait_signal_geq(
                    sig_ptr + 1 + t, t + 1, err_ptr, 0, 8, t, budget, True, True
                )
                nbad += tl.where(ok, 0, 1)
        else:
            ok = nvd.wait_signal_geq(sig_ptr, n_tiles, err_ptr, 0, 8, 0, budget, True, True)
            nbad += tl.where(ok, 0, 1)
        for t in range(n_tiles):
            cols = t * BN + tl.arange(0, BN)
            mask = cols < N
            vals = tl.load(dst_ptr + cols, mask=mask, volatile=True)
            vals = tl.where(nbad == 0, vals, float("nan"))
            tl.store(out_ptr + cols, vals, mask=mask)


@pytest.mark.parametrize(
    "sig_op", [nvd.NVSHMEM_SIGNAL_SET, nvd.NVSHMEM_SIGNAL_ADD], ids=["set", "add"]
)
@pytest.mark.parametrize("N", [1, 1000, 4096 + 17])
def test_put_with_signal_to_self(nv_world, sig_op, N):
    w = nv_world
    BN = 1024
    n_tiles = triton.cdiv(N, BN)
    src = w.alloc((N,), torch.float32)  # a put's source must be symmetric memory
    dst = w.alloc((N,), torch.float32)
    sig = w.alloc((n_tiles + 1,), torch.int64)
    src.local.copy_(_input(3, (N,)).cuda())
    dst.local.fill_(float("nan"))
    sig.local.zero_()
    out = torch.full((N,), float("nan"), device=w.device)
    w.barrier()
    with launch_lock():
        _put_tiles_kernel[(n_tiles + 1,)](
            src.local,
            dst.local,
            sig.local,
            out,
            w.error_buffer,
            N,
            n_tiles,
            0,
            w.wait_budget,
            SIG_OP=sig_op,
            BN=BN,
            **nvd.compile_options(),
        )
    w.check()
    assert torch.equal(out.cpu(), src.local.cpu())
    sigs = sig.local.cpu().tolist()
    if sig_op == nvd.NVSHMEM_SIGNAL_SET:
        assert sigs == [0] + [t + 1 for t in range(n_tiles)]
    else:
        assert sigs[0] == n_tiles and sigs[1:] == [0] * n_tiles


@triton.jit
def _amo_kernel(sig_ptr, i32_ptr, out_ptr, pe):
    # Thread-scoped AMOs from every program of a 4-warp launch: each must count once.
    nvd.signal_op(sig_ptr, 1, nvd.SIGNAL_ADD, pe)
    nvd.int32_atomic_add(i32_ptr, 1, pe)
    if tl.program_id(0) == 0:
        nvd.signal_op(sig_ptr + 1, 5, nvd.SIGNAL_SET, pe)
        nvd.int32_atomic_set(i32_ptr + 1, 7, pe)
        nvd.quiet()
        tl.store(out_ptr, nvd.peer_address(sig_ptr, pe))
        tl.store(out_ptr + 1, nvd.my_pe().to(tl.int64))
        tl.store(out_ptr + 2, nvd.n_pes().to(tl.int64))


@pytest.mark.parametrize("programs", [1, 5])
def test_thread_scoped_amos_count_once(nv_world, programs):
    w = nv_world
    sig = w.alloc((2,), torch.int64)
    i32 = w.alloc((2,), torch.int32)
    sig.local.zero_()
    i32.local.zero_()
    out = torch.full((3,), -1, dtype=torch.int64, device=w.device)
    w.barrier()
    with launch_lock():
        _amo_kernel[(programs,)](sig.local, i32.local, out, 0, num_warps=4, **nvd.compile_options())
    w.barrier()
    torch.cuda.synchronize()
    assert sig.local.cpu().tolist() == [programs, 5]
    assert i32.local.cpu().tolist() == [programs, 7]
    assert out.cpu().tolist() == [sig.local.data_ptr(), 0, 1]


@triton.jit(do_not_specialize=["budget"])
def _lonely_wait_kernel(sig_ptr, err_ptr, out_ptr, budget):
    ok = nvd.wait_signal_geq(sig_ptr, 1, err_ptr, 0, 8, 3, budget, True, True)
    tl.store(out_ptr, ok.to(tl.int32))


def test_signal_wait_times_out(nv_world):
    w = nv_world
    sig = w.alloc((1,), torch.int64)
    sig.local.zero_()
    out = torch.full((1,), -1, dtype=torch.int32, device=w.device)
    with launch_lock():
        _lonely_wait_kernel[(1,)](
            sig.local, w.error_buffer, out, BUDGET_NS, **nvd.compile_options()
        )
    with pytest.raises(CommTimeoutError) as ei:
        w.check()
    assert (ei.value.rank, ei.value.stage, ei.value.index) == (0, STAGE_TEST, 3)
    assert (ei.value.expected, ei.value.seen) == (1, 0)
    assert int(out[0]) == 0
    w.check()  # the record was consumed


# ------------------------------------------------------------------------------ ops on the world
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_toy_op(nv_world, dtype):
    for call, shape in enumerate([(1, 1), (17, 33), (300, 500)]):
        x = _input(10 + call, shape, dtype).cuda()
        assert torch.equal(push_allreduce(x, nv_world).cpu(), x.cpu()), shape
    nv_world.check()


@pytest.mark.parametrize(
    "T,H,F,E,K,act",
    [(64, 256, 384, 4, 2, "swiglu"), (129, 128, 200, 8, 3, "gelu"), (1, 64, 96, 2, 1, "silu")],
)
def test_moe_layer_matches_emulated(nv_world, T, H, F, E, K, act):
    dev = nv_world.device
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, activation=act)
    g = torch.Generator().manual_seed(1234 + T)
    ref = MoELayer(cfg, world=local_world(dev), dtype=torch.bfloat16, device=dev, generator=g)
    lay = MoELayer(cfg, world=nv_world, dtype=torch.bfloat16, device=dev)
    lay.load_state_dict(ref.state_dict())
    x = _input(20 + T, (T, H), torch.bfloat16).to(dev)
    with torch.no_grad():
        y_ref = ref(x)
        y = lay(x)
        y_again = lay(x)
    nv_world.check()
    assert torch.isfinite(y.float()).all()
    assert_close(y.float(), y_ref.double(), dtype=torch.bfloat16, name="nvshmem vs emulated")
    assert torch.equal(y_again, y)


# ------------------------------------------------------------------------------ finalize (last)
def test_finalize_last(nv_world):
    w = nv_world
    w.finalize()
    assert w.finalized and not nvd.runtime_ready() and nvw.active_world() is None
    w.finalize()  # idempotent
    with pytest.raises(RuntimeError, match="finalized"):
        w.alloc((4,), torch.float32)
    with pytest.raises(RuntimeError, match="finalized"):
        w.barrier()
