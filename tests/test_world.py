"""World protocol on emulated worlds (CPU, Triton interpreter), W in {1, 2, 3, 4, 8}.

Pointer tables are checked by writing through them from a Triton kernel and reading the data
back from the owner's tensor; host collectives against values every rank can recompute.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time
import weakref

import pytest
import torch
import triton
import triton.language as tl

import moe_overlap
from moe_overlap import CommTimeoutError, MissingBackendError, init_world, local_world
from moe_overlap.kernels.signals import peer_ptr
from moe_overlap.testing import spawn
from moe_overlap.world.base import READY_SLOTS, SymmTensor, World
from moe_overlap.world.emulated import EmulatedWorld, _Group

WORLD_SIZES = [1, 2, 3, 4, 8]


# ------------------------------------------------------------------------------ tiny kernels
@triton.jit(do_not_specialize=["rank"])
def _put_rows_kernel(src_ptr, table_ptr, rank, N: tl.constexpr, BN: tl.constexpr):
    # Program p writes row p of src into row [rank] of peer p's buffer.
    p = tl.program_id(0)
    cols = tl.arange(0, BN)
    mask = cols < N
    vals = tl.load(src_ptr + p * N + cols, mask=mask)
    dst = peer_ptr(table_ptr, p, src_ptr.dtype.element_ty)
    tl.store(dst + rank * N + cols, vals, mask=mask)


@triton.jit
def _get_first_kernel(table_ptr, out_ptr, DTYPE: tl.constexpr):
    # Program p reads element 0 of peer p's buffer.
    p = tl.program_id(0)
    src = peer_ptr(table_ptr, p, DTYPE)
    tl.store(out_ptr + p, tl.load(src))


def put_rows(src_WN: torch.Tensor, table: torch.Tensor, rank: int):
    """Row d of ``src_WN [W, N]`` lands in row ``rank`` of peer d's symmetric buffer."""
    W, N = src_WN.shape
    with moe_overlap.world.launch_lock():
        _put_rows_kernel[(W,)](src_WN, table, rank, N=N, BN=triton.next_power_of_2(N))


def get_first(table: torch.Tensor, world_size: int, dtype=torch.int32) -> torch.Tensor:
    out = torch.empty(world_size, dtype=dtype)
    tl_dtype = {torch.int32: tl.int32, torch.float32: tl.float32}[dtype]
    with moe_overlap.world.launch_lock():
        _get_first_kernel[(world_size,)](table, out, DTYPE=tl_dtype)
    return out


def payload(src: int, dst: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """What rank ``src`` sends to rank ``dst``: fresh random data any rank can recompute."""
    g = torch.Generator().manual_seed(7919 * src + dst + 1)
    return torch.randn(n, generator=g).to(dtype)


# ------------------------------------------------------------------------------ pointer tables
@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_pointer_table_addresses_the_right_peer(W, dtype):
    N = 13

    def fn(world):
        buf = world.alloc((W, N), dtype)
        assert buf.local.shape == (W, N) and buf.local.dtype == dtype
        assert buf.ptrs.dtype == torch.int64 and buf.ptrs.shape == (W,)
        assert buf.ptrs.device == world.device
        assert int(buf.ptrs[world.rank]) == buf.local.data_ptr()
        buf.local.fill_(-1)
        world.barrier()
        src = torch.stack([payload(world.rank, d, N, dtype) for d in range(W)])
        put_rows(src, buf.ptrs, world.rank)
        world.barrier()
        return buf.local.clone(), buf.ptrs.tolist()

    res = spawn(W, fn)
    tables = [t for _, t in res]
    assert all(t == tables[0] for t in tables), "ranks disagree on the pointer table"
    assert len(set(tables[0])) == W, "two ranks share a base address"
    for d, (local, _) in enumerate(res):
        for s in range(W):
            assert torch.equal(local[s], payload(s, d, N, dtype)), f"rank {d} row {s}"


@pytest.mark.parametrize("W", [2, 3])
def test_workspace_view_at_offset_addresses_the_peer(W):
    # SymmTensor.view shifts the whole table by the offset: a write through the view's table
    # lands at that offset of the peer's workspace and nowhere else.
    N, off = 9, 3 * 256

    def fn(world):
        ws = world.workspace(4096)
        ws.local.fill_(0)
        view = ws.view(off, (W, N), torch.float32)
        assert view.local.data_ptr() == ws.local.data_ptr() + off
        assert torch.equal(view.ptrs, ws.ptrs + off)
        world.barrier()
        src = torch.stack([payload(world.rank, d, N) for d in range(W)])
        put_rows(src, view.ptrs, world.rank)
        world.barrier()
        raw = ws.local.clone()
        return raw, view.local.clone()

    for d, (raw, got) in enumerate(spawn(W, fn)):
        for s in range(W):
            assert torch.equal(got[s], payload(s, d, N))
        end = off + W * N * 4
        assert not raw[:off].any() and not raw[end:].any(), "write outside the view"


# ------------------------------------------------------------------------------ alloc, signals
@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((0,), torch.float32),
        ((1,), torch.int64),
        ((3, 5, 7), torch.float16),
        ((4, 33), torch.bfloat16),
        ((2, 2), torch.uint8),
    ],
)
def test_alloc_shapes_and_dtypes(W, shape, dtype):
    def fn(world):
        t = world.alloc(shape, dtype)
        assert isinstance(t, SymmTensor)
        assert t.local.shape == shape and t.local.dtype == dtype
        assert t.local.is_contiguous() and t.local.device == world.device
        assert t.local.data_ptr() % 16 == 0  # vector loads need 16 B; CPU allocs give 64
        return t.ptrs.tolist()

    tables = spawn(W, fn)
    assert all(t == tables[0] for t in tables)


@pytest.mark.parametrize("W", [1, 4])
def test_signals_are_zeroed_symmetric_int32(W):
    def fn(world):
        first = world.signals(10)
        first.local.fill_(5)  # dirty memory the next allocation may reuse
        del first
        s = world.signals(37)
        return s.local.clone(), s.ptrs.tolist()

    res = spawn(W, fn)
    for local, table in res:
        assert local.dtype == torch.int32 and local.shape == (37,)
        assert not local.any()
        assert table == res[0][1]


def test_alloc_rejects_bad_arguments():
    w = local_world(device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        w.alloc((4,), "float32")
    with pytest.raises(TypeError, match="dtype"):
        w.alloc((4,), float)
    with pytest.raises(ValueError, match="shape"):
        w.alloc((4, -1), torch.float32)
    with pytest.raises(TypeError):
        w.alloc(None, torch.float32)
    with pytest.raises(ValueError):
        w.alloc(("x",), torch.float32)


def test_alloc_bad_arguments_raise_on_every_rank_without_hanging():
    def fn(world):
        try:
            world.alloc((2, -3), torch.float32)
        except ValueError as e:
            return str(e)
        return None

    msgs = spawn(3, fn, timeout=30)
    assert all(m is not None and "shape" in m for m in msgs)


@pytest.mark.parametrize("W", [1, 2, 4])
def test_workspace_growth_stays_symmetric(W):
    def fn(world):
        ws1 = world.workspace(1000)
        again = world.workspace(10)
        sizes = [ws1.local.numel()]
        same = again.local.data_ptr() == ws1.local.data_ptr()
        ws2 = world.workspace(3 << 20)
        ws3 = world.workspace(5 << 20)  # grows by >= 1.5x the old size
        sizes += [ws2.local.numel(), ws3.local.numel()]
        views = []
        for ws in (ws3,):
            assert int(ws.ptrs[world.rank]) == ws.local.data_ptr()
            views.append(ws.ptrs.tolist())
        # The grown buffer is addressable: write this rank's id through every peer's table.
        src = torch.full((W, 4), float(world.rank))
        v = ws3.view((5 << 20) - 4096, (W, 4), torch.float32)
        put_rows(src, v.ptrs, world.rank)
        world.barrier()
        return sizes, same, views[0], v.local.clone()

    res = spawn(W, fn)
    sizes0 = res[0][0]
    assert sizes0[0] == 1 << 20 and sizes0[1] == 3 << 20 and sizes0[2] >= 5 << 20
    assert all(s % (1 << 20) == 0 for s in sizes0)
    for sizes, same, table, got in res:
        assert sizes == sizes0, "workspace sizes differ across ranks"
        assert same, "a smaller request re-allocated the workspace"
        assert table == res[0][2]
        assert torch.equal(got, torch.arange(W, dtype=torch.float32)[:, None].expand(W, 4))


@pytest.mark.parametrize("W", [1, 3])
def test_ready_slots_survive_signal_pad_growth(W):
    from moe_overlap.kernels import signals as sig

    def fn(world):
        pad = world.signal_pad(8)
        small = pad.local.numel()
        with moe_overlap.world.launch_lock():
            sig.publish_ready(pad.ptrs, world._epoch, world.rank, W)
            sig.publish_ready(pad.ptrs, world._epoch, world.rank, W)
        world.barrier()
        before = pad.local[:READY_SLOTS].clone()
        pad.local[READY_SLOTS:].fill_(3)  # op flags: growth need not keep them, ready words must
        world.barrier()
        big = world.signal_pad(2 * small)
        again = world.signal_pad(16)
        return before, big.local.clone(), small, again.local.data_ptr() == big.local.data_ptr()

    for before, big, small, same in spawn(W, fn):
        assert before[:W].tolist() == [2] * W and not before[W:].any()
        assert big.numel() >= 2 * small + READY_SLOTS
        assert torch.equal(big[:READY_SLOTS], before), "ready epochs lost in signal_pad growth"
        assert same


def test_peer_buffers_outlive_a_finished_rank():
    # A rank that has finished drops its world while peers still hold its addresses (a peer's
    # next ready publish writes into its pad): the emulated world must keep every rank's
    # symmetric buffers alive for as long as any rank holds a table pointing at them, or the
    # write lands in freed memory (seen here as a heap-corruption abort of the test process).
    shared = {}

    def fn(world):
        world.signal_pad(1)
        if world.rank == 0:
            shared["pad0"] = weakref.ref(world._pad.local)
        world.barrier()
        if world.rank == 0:
            return True
        for _ in range(20):  # rank 0's thread ends within a few ms; refcounting frees at once
            if shared["pad0"]() is None:
                return False
            time.sleep(0.01)
        gc.collect()
        return shared["pad0"]() is not None

    assert spawn(2, fn) == [True, True], "rank 0's pad was freed while rank 1 held its address"


# ------------------------------------------------------------------------------ collectives
@pytest.mark.parametrize("W", WORLD_SIZES)
def test_barrier_orders_host_writes(W):
    # Round k: every rank writes k*W + rank into its symmetric word, barrier, reads every peer's
    # word through the table, barrier (nobody overwrites before all have read). Random sleeps
    # shuffle thread timing so a barrier that does not order would show.
    rounds = 4

    def fn(world):
        rng = random.Random(world.rank)
        cell = world.alloc((1,), torch.int32)
        seen = []
        for k in range(rounds):
            time.sleep(rng.random() * 0.002)
            cell.local.fill_(k * W + world.rank)
            world.barrier()
            seen.append(get_first(cell.ptrs, W).tolist())
            world.barrier()
        return seen

    for seen in spawn(W, fn):
        assert seen == [[k * W + s for s in range(W)] for k in range(rounds)]


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_all_reduce_sums_bitwise_equal_on_every_rank(W, dtype):
    shape = (5, 7)

    def inp(r):
        g = torch.Generator().manual_seed(100 + r)
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 10
        return t.to(dtype)

    def fn(world):
        t = inp(world.rank)
        out = world.all_reduce(t)
        assert out is t, "all_reduce works in place and returns its argument"
        return t

    outs = spawn(W, fn)
    ref = sum(inp(r).to(torch.float64) for r in range(W))
    for r, o in enumerate(outs):
        assert o.dtype == dtype
        assert torch.equal(o, outs[0]), f"rank {r} differs bitwise from rank 0"
    if dtype.is_floating_point:
        torch.testing.assert_close(outs[0].double(), ref, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(outs[0], ref.to(dtype))


def test_all_reduce_rejects_non_tensor():
    with pytest.raises(TypeError):
        spawn(2, lambda w: w.all_reduce([1.0, 2.0]), timeout=30)


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_all_gather_ints(W):
    def fn(world):
        r = world.rank
        first = world.all_gather_ints([r, r * r, 7, -(2**40) + r])
        empty = world.all_gather_ints([])
        from_tensor = world.all_gather_ints(torch.tensor([r + 1]))
        return first, empty, from_tensor

    for first, empty, from_tensor in spawn(W, fn):
        assert first == [[s, s * s, 7, -(2**40) + s] for s in range(W)]
        assert all(isinstance(v, int) for row in first for v in row)
        assert empty == [[] for _ in range(W)]
        assert from_tensor == [[s + 1] for s in range(W)]


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_all_to_all_ragged(W):
    H = 3

    def chunk(s, d):  # ragged dim 0, zero rows for some pairs
        rows = (s + 2 * d) % 3
        return payload(s, d, rows * H).view(rows, H)

    def fn(world):
        send = [chunk(world.rank, d) for d in range(W)]
        return world.all_to_all(send)

    for d, recv in enumerate(spawn(W, fn)):
        assert len(recv) == W
        for s in range(W):
            assert torch.equal(recv[s], chunk(s, d)), f"rank {d} from {s}"


def test_all_to_all_rejects_wrong_length():
    with pytest.raises(ValueError, match="all_to_all"):
        spawn(2, lambda w: w.all_to_all([torch.zeros(1)]), timeout=30)


# ------------------------------------------------------------------------------ generators
def test_generators_differ_per_rank_and_reproduce():
    draw = lambda w: torch.randn(8, generator=w.generator)
    a = spawn(4, draw, seed=3)
    b = spawn(4, draw, seed=3)
    c = spawn(4, draw, seed=4)
    for r in range(4):
        assert torch.equal(a[r], b[r]), "same seed, same rank: same stream"
        assert not torch.equal(a[r], c[r]), "another seed gives another stream"
        for s in range(r):
            assert not torch.equal(a[r], a[s]), f"ranks {r} and {s} share a stream"


def test_generators_do_not_depend_on_thread_timing():
    def draw(world):
        time.sleep(random.random() * 0.003)
        return [torch.rand(3, generator=world.generator) for _ in range(3)]

    a, b = spawn(3, draw), spawn(3, draw)
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))


# ------------------------------------------------------------------------------ construction
@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None])
def test_spawn_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        spawn(bad, lambda w: None)


def test_spawn_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        spawn(2, lambda w: None, mode="parallel")
    with pytest.raises(ValueError, match="concurrent"):
        spawn(2, lambda w: None, mode="concurrent", device="cpu")


@pytest.mark.parametrize("rank,world_size", [(2, 2), (-1, 2), (0, 0), (0, -3), (0, 65)])
def test_world_rejects_bad_rank_and_size(rank, world_size):
    with pytest.raises(ValueError, match="rank|world_size"):
        World(rank, world_size, torch.device("cpu"))


def test_emulated_world_rejects_rank_outside_group():
    group = _Group(2, torch.device("cpu"), "sequential", timeout=5.0)
    with pytest.raises(ValueError, match="rank"):
        EmulatedWorld(group, 2)


def test_world_basics():
    def fn(world):
        assert world.backend == "emulated"
        assert world.device == torch.device("cpu")
        assert not world.concurrent, "CPU emulation runs roles phased"
        assert world.wait_budget > 0
        assert not world.use_timer, "the interpreter budgets in iterations"
        assert repr(world).startswith("EmulatedWorld(rank=")
        world.check()  # nothing pending
        return world.rank, world.world_size

    assert spawn(3, fn) == [(0, 3), (1, 3), (2, 3)]


# ------------------------------------------------------------------------------ init_world
def test_init_world_local_when_not_distributed(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = init_world()
    assert (w.rank, w.world_size, w.device.type) == (0, 1, "cpu")
    w2 = init_world("local")
    assert w2.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_world().world_size == 1


def test_init_world_rejects_bad_backend_name():
    with pytest.raises(ValueError, match="backend"):
        init_world("mpi")
    with pytest.raises(ValueError, match="backend"):
        init_world("emulated")


def test_init_world_nvshmem_missing_names_the_install_command(monkeypatch):
    # A None entry in sys.modules makes `import nvshmem.core` raise ImportError even where the
    # package is installed.
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(MissingBackendError) as ei:
        init_world("nvshmem")
    assert isinstance(ei.value, ImportError)
    assert "pip install nvshmem4py-cu13" in str(ei.value)


def test_init_world_refuses_silent_single_rank(monkeypatch):
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        init_world()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        init_world("torch_symm")


def test_init_world_on_a_one_rank_gloo_group(monkeypatch):
    import torch.distributed as dist

    if not dist.is_available() or torch.cuda.is_available():
        pytest.skip("checks the CPU-only branch of init_world")
    from moe_overlap.testing import free_port

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        w = init_world()
        assert (w.rank, w.world_size, w.device.type) == (0, 1, "cpu")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ spawn failures
def test_spawn_reraises_a_rank_exception_with_its_rank():
    class Boom(Exception):
        pass

    def fn(world):
        world.barrier()
        if world.rank == 1:
            raise Boom("rank one failed")
        world.barrier()
        return world.rank

    with pytest.raises(Boom, match="rank one failed") as ei:
        spawn(3, fn, timeout=30)
    assert any("rank 1" in n for n in getattr(ei.value, "__notes__", []))


@pytest.mark.parametrize("W", [2, 4])
def test_spawn_does_not_hang_when_a_rank_dies_before_a_barrier(W):
    # The dying rank aborts the group's barrier: the others leave at once with the real error
    # re-raised, long before the (generous) barrier timeout would fire.
    def fn(world):
        if world.rank == W - 1:
            raise KeyError("dead before the barrier")
        world.barrier()
        world.all_gather_ints([1])
        return world.rank

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="dead before the barrier"):
        spawn(W, fn, timeout=120)
    assert time.monotonic() - t0 < 60, "spawn waited for the barrier timeout"


def test_spawn_raises_timeout_when_a_rank_skips_a_barrier():
    def fn(world):
        if world.rank == 0:
            return "left early"
        world.barrier()

    with pytest.raises(TimeoutError, match="barrier"):
        spawn(2, fn, timeout=0.5)


def test_spawn_single_rank_reraises():
    def fn(world):
        raise CommTimeoutError(0, 8, 1, 2, 0)

    with pytest.raises(CommTimeoutError):
        spawn(1, fn)


def test_comm_timeout_error_pickles_and_names_the_peer_of_a_handshake():
    import pickle

    e = CommTimeoutError(rank=1, stage=6, index=3, expected=1, seen=0)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CommTimeoutError and str(back) == str(e)
    assert (back.rank, back.stage, back.index, back.expected, back.seen) == (1, 6, 3, 1, 0)
    assert "flag 3 expected >= 1" in str(e)
    assert "rank 2's ready flag expected >= 5" in str(CommTimeoutError(0, 1, 2, 5, 4))


def test_prefer_eager_module_loading(monkeypatch):
    from moe_overlap.world import emulated

    monkeypatch.setattr(emulated, "_driver_loading_mode", lambda: None)
    monkeypatch.setattr(emulated.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    emulated.prefer_eager_module_loading()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    # the user's own choice is kept, with a warning that names the fix
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.warns(RuntimeWarning, match="CUDA_MODULE_LOADING=EAGER"):
        emulated.prefer_eager_module_loading()
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    # the driver already started lazily: too late to ask, so warn (or stay quiet on request)
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    monkeypatch.setattr(emulated, "_driver_loading_mode", lambda: 2)
    with pytest.warns(RuntimeWarning, match="lazy CUDA module loading"):
        emulated.prefer_eager_module_loading()
    assert "CUDA_MODULE_LOADING" not in os.environ
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emulated.prefer_eager_module_loading(warn=False)
        monkeypatch.setattr(emulated, "_driver_loading_mode", lambda: 1)
        emulated.prefer_eager_module_loading()


def test_spawn_runs_each_ranks_backward_on_its_own_thread():
    # autograd's shared CUDA worker would serialize the ranks' backward host code (see
    # world/emulated.py, "Backward threads"); spawn turns it off per rank thread.
    from moe_overlap.testing import spawn

    def fn(world):
        x = torch.ones(3, requires_grad=True)
        seen = []
        x.register_hook(lambda g: seen.append(threading.get_ident()) or g)
        (x * 2).sum().backward()
        return torch._C._is_multithreading_enabled(), seen[0] == threading.get_ident()

    assert spawn(2, fn) == [(False, True), (False, True)]
    assert torch._C._is_multithreading_enabled()


def test_concurrent_gpu_ranks_meet_before_every_op_in_backward_too():
    # Lockstep (world/emulated.py): a GPU rank meets its peers before each fused op, in
    # backward too where the rank runs its own backward, never on autograd's shared worker.
    from moe_overlap.testing import spawn

    def fn(world):
        world.device = torch.device("cuda")  # only the decision is asked for, nothing runs
        seen = [world._needs_load_barrier()]
        world.in_backward = True
        seen.append(world._needs_load_barrier())
        with torch.autograd.set_multithreading_enabled(True):
            seen.append(world._needs_load_barrier())
        world.device = torch.device("cpu")
        seen.append(world._needs_load_barrier())
        return seen

    assert spawn(2, fn) == [[True, True, False, False]] * 2


def test_dist_collectives_on_a_gloo_group():
    # The host collectives torch_symm and nvshmem share, on a one-process CPU group.
    import torch.distributed as dist

    from moe_overlap.world.dist_collectives import DistCollectives

    class Host(DistCollectives):
        device, world_size = torch.device("cpu"), 1

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        h = Host()
        h.group = dist.group.WORLD
        t = torch.arange(4.0)
        assert h.all_reduce(t) is t and torch.equal(t, torch.arange(4.0))
        assert h.all_gather_ints([3, -1, 7]) == [[3, -1, 7]]
        rows = torch.randn(5, 3)
        (got,) = h.all_to_all([rows])
        assert torch.equal(got, rows)
        with pytest.raises(ValueError, match="all_to_all needs 1 tensors"):
            h.all_to_all([rows, rows])
    finally:
        dist.destroy_process_group()


def test_no_error_copy_or_event_query_while_a_graph_is_captured(monkeypatch):
    """Capturing a W > 1 op into a CUDA graph: begin_op's error poll must not query the event
    (illegal during capture), and end_op must not record one into the graph (any later query
    of it raises). Host logic only: a CUDA device is faked, capture reported on."""
    from moe_overlap.world import base

    world = local_world("cpu")
    world.device = torch.device("cuda", 0)

    class Boom:
        def query(self):
            raise AssertionError("event queried during capture")

        def record(self):
            raise AssertionError("event recorded during capture")

    world._err_event, world._err_host = Boom(), torch.zeros(8, dtype=torch.int64)
    monkeypatch.setattr(base, "_capturing", lambda: True)
    world._poll_errors()
    world.end_op()
    monkeypatch.setattr(base, "_capturing", lambda: False)
    with pytest.raises(AssertionError, match="queried"):
        world._poll_errors()  # outside a capture the poll does look
