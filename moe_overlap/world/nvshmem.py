"""World on NVSHMEM (nvshmem4py): one process per GPU, on one node or several.

Which NVSHMEM runtime (decision)
--------------------------------
A process must never run two NVSHMEM runtimes: two bootstraps of one host library (or two
copies of it) disagree on teams, heaps and device state, and the failure is a hang or a fault far
from its cause. Two candidates exist: nvshmem4py's (``nvshmem.core.init``) and PyTorch's own
NVSHMEM backend of SymmetricMemory (``TORCH_SYMMMEM=NVSHMEM`` or
``torch.distributed._symmetric_memory.set_backend("NVSHMEM")``). **This world initializes
nvshmem4py's runtime and refuses to start when PyTorch's is, or will be, active.** Why:

* nvshmem4py is NVIDIA's public, versioned binding and the one our extras install
  (``nvshmem4py-cu12`` / ``-cu13``, the extras ``nvshmem-cu12|cu13``). It lets us bootstrap
  from our own torch.distributed group (unique id broadcast), query ``nvshmem_ptr`` per peer
  (NVLink-reachable or not), barrier on a stream, initialize Triton modules (``cumodule_init``)
  and finalize.
* PyTorch's backend lives in a private module, starts implicitly at the first symmetric
  allocation, is fixed process-wide from then on, has no finalize, does not say how it maps peers
  on other nodes in ``buffer_ptrs``, and is missing from many torch builds
  (``is_nvshmem_available()`` is False on CPU/ROCm wheels and some CUDA ones).
* The device bitcode must match the host library that filled the device state; nvshmem4py's
  wheel and the ``nvidia-nvshmem`` wheel it depends on ship both.

Detection (:func:`runtime_conflicts`, run on every rank and agreed collectively before anything
starts, so all ranks refuse together instead of some hanging in the bootstrap):

* ``TORCH_SYMMMEM=NVSHMEM`` in the environment, or ``get_backend(device) == "NVSHMEM"``: torch
  would start its runtime at its next symmetric allocation (torch_symm worlds, async-TP);
* Triton's ``jit_post_compile_hook`` is torch's NVSHMEM module-init hook (torch's NVSHMEM Triton
  kernels are in use);
* the NVSHMEM host library reports itself initialized (``nvshmemx_init_status``) before we start:
  someone else bootstrapped it (torch, or nvshmem4py used outside moe_overlap);
* two different ``libnvshmem_host.so`` files are mapped into the process;
* another live ``NvshmemWorld`` in this process.

After start, every symmetric allocation re-checks the torch side (an environment variable or
``set_backend`` issued later) and raises instead of continuing next to a second runtime.
A torch_symm world on PyTorch's default CUDA backend can live beside this one.

Lifecycle
---------
``NvshmemWorld(group)``: ``torch.distributed`` must be initialized (NCCL) and the process's GPU
current (``torch.cuda.set_device``). Rank 0 of ``group`` creates the unique id; it is broadcast
with ``broadcast_object_list``; every rank calls ``nvshmem.core.init(device, uid, rank, nranks,
"uid")`` with its group rank as PE. ``finalize()`` (collective) frees every symmetric buffer and
stops the runtime; call it before ``dist.destroy_process_group()``. The world also works as a
context manager.

Memory and peers
----------------
Symmetric buffers are ``nvshmem.core.tensor`` allocations (uint8, collective). The int64 peer
table holds this rank's own address for itself, ``nvshmem_ptr`` for every peer that address maps
to (NVLink on one node) and **0** for peers reachable only by puts; kernels branch on it (see
``kernels/nvshmem_device.py``). The entries come from ``nvshmem.bindings.ptr`` (``nvshmem_ptr``)
rather than ``nvshmem.core.get_peer_tensor``, which wraps the same call but raises for an
unreachable peer and tracks a child buffer per peer. ``MOE_OVERLAP_NVSHMEM_FORCE_PUT=1`` zeroes
every entry but our own, so one node exercises the inter-node (put) path. Workspace and
signal-pad buffers replaced by growth are freed at once (after a device sync and a barrier:
growth is collective, so every rank frees in the same order); other allocations live until
``finalize``. Buffers are made with ``except_on_del=False``: one dropped without a free logs
instead of raising from a destructor at exit. The symmetric heap has a fixed size:
``NVSHMEM_SYMMETRIC_SIZE`` (default 1 GiB per PE).
Sub-views of such a table keep its 0 entries at 0 (``_PutTableSymmTensor``). The ready
handshake's put path needs ``World.begin_op`` to publish through the ``_publish_ready`` hook
(overridden here).

Ops with put paths announce it: ``begin_op(nflags, puts=True)``. ``begin_op`` of an op without
one raises a clear error on a world with unreachable peers (a store through a 0 table entry
would fault the GPU). The op-start ready handshake itself has a put path
(``nvshmem_device.publish_ready``: int32 atomic set on unreachable peers). The MoE ops (count
exchange, dispatch, combine) have put paths (``kernels/put.py``: ``World.put_mask`` picks the
transport per peer, kernels compile with the device library when ``uses_nvshmem``); the TP ops
do not and refuse such a world.

Host side
---------
``barrier()``: NVSHMEM barrier on the current stream (orders and completes this PE's puts), then
``dist.barrier``. ``all_reduce`` / ``all_gather_ints`` / ``all_to_all``: the torch.distributed
group, as in ``torch_symm``. ``NVSHMEM_DISABLE_NVLS`` defaults to 1 (this library never uses
NVLink multicast; the lent machines require it off).
"""

from __future__ import annotations

import os
import socket
import threading

import torch
import torch.distributed as dist

from ..errors import MissingBackendError
from .base import SymmTensor, World
from .dist_collectives import DistCollectives
from .topology import Topology, TopologyMixin, spans_nodes_from_env

_ACTIVE_LOCK = threading.Lock()
_ACTIVE: NvshmemWorld | None = None

_AFTER_FINALIZE: dict = {"status": None}

FORCE_PUT_ENV = "MOE_OVERLAP_NVSHMEM_FORCE_PUT"


# ----------------------------------------------------------------------------- availability
def install_hint() -> str:
    """The pip command for this torch's CUDA major version."""
    cuda = getattr(torch.version, "cuda", None) or ""
    major = cuda.split(".")[0]
    # The packages themselves (what the extras nvshmem-cu12 / -cu13 pull in): moe-overlap is
    # installed from a checkout, where `pip install -e '.[nvshmem-cu13]'` does the same.
    if major == "12":
        return (
            "pip install nvshmem4py-cu12 (torch here is built for CUDA 12; "
            "nvshmem4py-cu13 for CUDA 13)"
        )
    return "pip install nvshmem4py-cu13 (or nvshmem4py-cu12 for CUDA 12)"


def import_nvshmem():
    """The ``nvshmem`` package with ``core`` and ``bindings`` imported, or MissingBackendError."""
    try:
        import nvshmem
        import nvshmem.bindings  # noqa: F401
        import nvshmem.core  # noqa: F401
    except ImportError as e:
        raise MissingBackendError(
            f"the nvshmem backend needs nvshmem4py: {install_hint()} ({e})"
        ) from e
    except Exception as e:  # noqa: BLE001 - a broken install (missing CUDA libs) is "missing" too
        raise MissingBackendError(
            f"nvshmem4py is installed but failed to import ({type(e).__name__}: {e}); "
            f"reinstall it for this CUDA version: {install_hint()}"
        ) from e
    return nvshmem


def nvshmem_available() -> bool:
    """True when nvshmem4py imports (the nvshmem backend can be tried)."""
    try:
        import_nvshmem()
    except MissingBackendError:
        return False
    return True


def gather_hostnames(group=None) -> list[str]:
    """Every rank's host name in group-rank order (collective over ``group``)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, socket.gethostname(), group=group)
    return [str(h) for h in out]


def job_spans_nodes(group=None, environ=None) -> bool:
    """Whether ``group`` (default: the whole job) spans several nodes.

    For the whole job the launcher's variables decide when they say (``LOCAL_WORLD_SIZE <
    WORLD_SIZE``, Slurm, Open MPI); otherwise, and always for a subgroup, the host names of the
    group's ranks do (collective over the group: every rank must call it, as every rank calls
    ``init_world``). Without torch.distributed a job is one node.
    """
    initialized = dist.is_available() and dist.is_initialized()
    whole = group is None or (initialized and group is dist.group.WORLD)
    if whole:
        said = spans_nodes_from_env(environ)
        if said is not None:
            return said
    if not initialized:
        return False
    return Topology.from_hostnames(gather_hostnames(group)).multi_node


# ----------------------------------------------------------------------------- conflicts
def loaded_nvshmem_host_libs() -> list[str]:
    """Distinct ``libnvshmem_host`` files mapped into this process (Linux; [] elsewhere)."""
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                if "libnvshmem_host" in line:
                    path = line.split(None, 5)[-1].strip()
                    real = os.path.realpath(path)
                    if real not in found:
                        found.append(real)
    except OSError:
        pass
    return found


def torch_nvshmem_conflicts(device=None, environ=None) -> list[str]:
    """Reasons to believe PyTorch's NVSHMEM runtime is, or will be, active ([] when none)."""
    env = os.environ if environ is None else environ
    reasons = []
    if str(env.get("TORCH_SYMMMEM", "")).upper() == "NVSHMEM":
        reasons.append(
            "TORCH_SYMMMEM=NVSHMEM selects PyTorch's NVSHMEM backend for symmetric memory"
        )
    if device is not None and torch.cuda.is_available():
        try:
            from torch.distributed import _symmetric_memory as symm

            backend = symm.get_backend(torch.device(device))
        except Exception:  # noqa: BLE001 - builds without SymmetricMemory: nothing to conflict
            backend = None
        if backend is not None and str(backend).upper() == "NVSHMEM":
            reasons.append(
                "torch.distributed._symmetric_memory.set_backend('NVSHMEM') is in effect"
            )
    try:
        import triton

        hook = triton.knobs.runtime.jit_post_compile_hook
        mod = getattr(hook, "__module__", "") or ""
        if "torch.distributed._symmetric_memory" in mod:
            reasons.append("PyTorch's NVSHMEM Triton kernels (@requires_nvshmem) are registered")
    except Exception:  # noqa: BLE001 - no triton knobs: no torch NVSHMEM Triton kernels either
        pass
    return reasons


def runtime_conflicts(device=None, nvshmem=None, environ=None) -> list[str]:
    """Every reason this process must not start an NVSHMEM runtime now ([] when it may)."""
    reasons = torch_nvshmem_conflicts(device, environ)
    libs = loaded_nvshmem_host_libs()
    if len(libs) > 1:
        reasons.append(f"two NVSHMEM host libraries are loaded: {', '.join(libs)}")
    with _ACTIVE_LOCK:
        if _ACTIVE is not None:
            reasons.append(
                f"another NvshmemWorld is active in this process ({_ACTIVE!r}); "
                "finalize() it first or reuse it"
            )
    if nvshmem is not None:
        status = _init_status(nvshmem)
        if status is not None and status not in (0, _AFTER_FINALIZE["status"]):
            reasons.append(
                f"the NVSHMEM host library is already initialized (nvshmemx_init_status = "
                f"{status}): PyTorch's NVSHMEM backend or nvshmem4py used outside moe_overlap"
            )
    return reasons


def _init_status(nv) -> int | None:
    """``nvshmemx_init_status`` as an int (0 = not initialized), or None when unknown."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvshmem_host")  # what nvshmem4py does before a raw binding
    except Exception:  # noqa: BLE001 - older stacks: the binding loads the library itself
        pass
    try:
        return int(nv.bindings.init_status())
    except Exception:  # noqa: BLE001
        return None


def _uid_payload(uid):
    """What travels from rank 0: the id's raw bytes (its ``_data`` record) when it has them."""
    import numpy as np

    data = getattr(uid, "_data", None)
    return ("bytes", data.view(np.uint8).tobytes()) if data is not None else ("obj", uid)


def _uid_from_payload(nv, payload):
    import numpy as np

    kind, value = payload
    if kind == "obj":
        return value
    uid = nv.core.get_unique_id(empty=True)
    raw = np.frombuffer(value, dtype=np.uint8)
    dst = uid._data.view(np.uint8)
    if dst.size != raw.size:
        raise RuntimeError(
            f"NVSHMEM unique id of {raw.size} bytes received, {dst.size} expected "
            "(different nvshmem4py versions on different ranks?)"
        )
    dst[...] = raw
    return uid


def _broadcast_unique_id(nv, rank: int, group):
    """Rank 0 of ``group`` creates the NVSHMEM unique id; every rank returns it.

    The id travels as raw bytes, so pickling can never fail on rank 0 alone and leave the
    others waiting in the broadcast (nvshmem4py's own torchrun example pickles the object: the
    fallback for a binding without ``_data``).
    """
    uid = nv.core.get_unique_id() if rank == 0 else None
    payload = [_uid_payload(uid) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return uid if rank == 0 else _uid_from_payload(nv, payload[0])


def _world_device() -> torch.device:
    """The process's GPU (torchrun scripts call ``torch.cuda.set_device(LOCAL_RANK)`` first)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the nvshmem world needs CUDA GPUs")
    return torch.device("cuda", torch.cuda.current_device())


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    dev = Device(index)
    dev.set_current()
    return dev


# ----------------------------------------------------------------------------- the world
class _PutTableSymmTensor(SymmTensor):
    """A SymmTensor whose peer table has 0 entries (peers reachable only by puts): sub-views keep
    them 0, where ``SymmTensor.view`` would turn them into ``offset`` (a bogus address)."""

    def view(self, offset_bytes: int, shape, dtype: torch.dtype) -> SymmTensor:
        sub = super().view(offset_bytes, shape, dtype)
        ptrs = torch.where(self.ptrs != 0, sub.ptrs, self.ptrs)
        return _PutTableSymmTensor(sub.local, ptrs, sub.keep)


class NvshmemWorld(DistCollectives, World, TopologyMixin):
    backend = "nvshmem"

    def __init__(self, group=None, seed: int = 0):
        global _ACTIVE
        nv = import_nvshmem()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "the nvshmem world needs torch.distributed initialized "
                "(dist.init_process_group('nccl') under torchrun)"
            )
        device = _world_device()
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)

        # Agree before anything starts: one rank refusing alone would leave the others hanging
        # in the bootstrap.
        mine = (socket.gethostname(), runtime_conflicts(device, nv))
        every: list = [None] * world_size
        dist.all_gather_object(every, mine, group=group)
        problems = [f"rank {r}: {why}" for r, (_, whys) in enumerate(every) for why in whys]
        if problems:
            raise RuntimeError(
                "refusing to start NVSHMEM (one process must never run two NVSHMEM runtimes): "
                + "; ".join(problems)
                + ". Unset TORCH_SYMMMEM / do not call set_backend('NVSHMEM') in a job that uses "
                "the nvshmem world (torch_symm on the default CUDA backend is fine)."
            )
        topology = Topology.from_hostnames([h for h, _ in every])  # uneven nodes: ValueError

        super().__init__(rank, world_size, device, seed=seed)
        self.set_topology(topology)
        self.group = group
        self._nv = nv
        self._keep: list[torch.Tensor] = []
        self._closed = False
        if device.type == "cuda":
            self.max_programs = torch.cuda.get_device_properties(device).multi_processor_count
        else:  # CPU tests on a fake nvshmem4py
            self.max_programs = 1 << 30
        self._force_put = os.environ.get(FORCE_PUT_ENV, "0") == "1"

        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        self._cuda_device = _cuda_core_device(device.index) if device.type == "cuda" else None
        uid = _broadcast_unique_id(nv, rank, group)
        nv.core.init(
            device=self._cuda_device,
            uid=uid,
            rank=rank,
            nranks=world_size,
            initializer_method="uid",
        )
        with _ACTIVE_LOCK:
            _ACTIVE = self
        try:
            pe, npes = int(nv.core.my_pe()), int(nv.core.n_pes())
            if (pe, npes) != (rank, world_size):
                raise RuntimeError(
                    f"NVSHMEM made this process PE {pe} of {npes}, expected {rank} of "
                    f"{world_size} (the group's rank): was NVSHMEM already bootstrapped?"
                )
            self._reachable = self._probe_reachability()
            if not all(self._reachable):
                self.put_mask  # noqa: B018 - built now, not lazily inside a graph capture
            from ..kernels import nvshmem_device as nvd

            nvd.install_module_init_hook()
            nvd.set_runtime_ready(True)
        except BaseException:
            self._shutdown(free=False)
            raise

    # ------------------------------------------------------------------ topology
    def peer_reachable(self, r: int) -> bool:
        """True when ``nvshmem_ptr`` maps rank ``r``'s symmetric memory (loads/stores work)."""
        self.topology._rank("r", r)
        return self._reachable[r]

    @property
    def all_peers_reachable(self) -> bool:
        return all(self._reachable)

    @property
    def uses_nvshmem(self) -> bool:
        return not all(self._reachable)

    def _probe_reachability(self) -> list[bool]:
        t = self._nv_tensor(256)
        try:
            base = t.data_ptr()
            return [self._peer_address(base, r) != 0 for r in range(self.world_size)]
        finally:
            self._nv.core.free_tensor(t)

    def _peer_address(self, base: int, r: int) -> int:
        if r == self.rank:
            return base
        if self._force_put:
            return 0
        ptr = getattr(self._nv.bindings, "ptr", None)
        if ptr is not None:
            return int(ptr(base, r) or 0)
        raise RuntimeError("nvshmem4py lacks bindings.ptr (nvshmem_ptr); upgrade nvshmem4py")

    # ------------------------------------------------------------------ memory
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this NvshmemWorld was finalized")
        again = torch_nvshmem_conflicts(self.device)
        if again:
            raise RuntimeError(
                "PyTorch's NVSHMEM backend became active next to this world's NVSHMEM runtime: "
                + "; ".join(again)
            )

    def _nv_tensor(self, nbytes: int) -> torch.Tensor:
        nv = self._nv
        try:
            try:
                # except_on_del=False: a buffer dropped without free logs instead of raising
                # from a destructor at interpreter exit.
                return nv.core.tensor((int(nbytes),), dtype=torch.uint8, except_on_del=False)
            except TypeError:  # nvshmem4py without the keyword
                return nv.core.tensor((int(nbytes),), dtype=torch.uint8)
        except Exception as e:
            if isinstance(e, TypeError):
                raise
            raise RuntimeError(
                f"NVSHMEM could not allocate {nbytes} symmetric bytes ({type(e).__name__}: "
                f"{getattr(e, 'msg', e)}); the symmetric heap is NVSHMEM_SYMMETRIC_SIZE bytes "
                "per PE (default 1 GiB): raise it in the environment of every rank"
            ) from e

    def _alloc_symmetric(self, nbytes: int) -> SymmTensor:  # collective
        self._check_open()
        t = self._nv_tensor(nbytes)
        base = t.data_ptr()
        table = torch.tensor(
            [self._peer_address(base, r) for r in range(self.world_size)],
            dtype=torch.int64,
            device=self.device,
        )
        self._keep.append(t)
        return SymmTensor(t, table) if self.all_peers_reachable else _PutTableSymmTensor(t, table)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _retire(self, local: torch.Tensor) -> None:
        """Free a workspace/pad buffer that growth replaced (collective, same order everywhere)."""
        for i, t in enumerate(self._keep):
            if t.data_ptr() == local.data_ptr():
                self._sync()  # our kernels no longer touch it
                self.barrier()  # nor do the peers' (each synced before arriving)
                self._nv.core.free_tensor(self._keep.pop(i))
                return

    def workspace(self, nbytes: int) -> SymmTensor:
        old = self._ws
        ws = super().workspace(nbytes)
        if old is not None and ws is not old:
            self._retire(old.local)
        return ws

    def signal_pad(self, n: int) -> SymmTensor:
        old = self._pad
        pad = super().signal_pad(n)
        if old is not None and self._pad is not old:
            self._retire(old.local)  # its contents were copied into the new pad
        return pad

    # ------------------------------------------------------------------ op protocol
    def begin_op(self, nflags: int, puts: bool = False) -> SymmTensor:
        """``World.begin_op``, after two checks: the op must have a put path (``puts``) when
        some peer is reachable only by puts, and PyTorch's NVSHMEM must not have started."""
        if not puts and not self.all_peers_reachable:
            far = [r for r, ok in enumerate(self._reachable) if not ok]
            why = f"{FORCE_PUT_ENV}=1" if self._force_put else "other nodes"
            raise RuntimeError(
                f"rank {self.rank}: ranks {far} are reachable only by NVSHMEM puts ({why}) and "
                "this op has no put path yet: it would store through a 0 peer address"
            )
        self._check_open()
        if not self.all_peers_reachable and "_publish_ready" not in vars(World):
            raise RuntimeError(
                "World.begin_op does not call _publish_ready yet, so the ready handshake would "
                "store through a 0 peer address (moe_overlap/world/base.py needs the hook)"
            )
        return super().begin_op(nflags, puts=puts)

    def _publish_ready(self, pad: SymmTensor) -> None:
        """The ready handshake with a put path: NVSHMEM int32 atomics for unreachable peers."""
        from ..kernels import nvshmem_device as nvd

        nvd.publish_ready(
            pad.ptrs,
            self._epoch,
            self.rank,
            self.world_size,
            use_nvshmem=not self.all_peers_reachable,
        )

    # ------------------------------------------------------------------ host collectives
    def barrier(self) -> None:
        if self._closed:
            raise RuntimeError("this NvshmemWorld was finalized")
        nv = self._nv
        cur = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        nv.core.barrier(nv.core.Teams.TEAM_WORLD, stream=nv.core.NvshmemStream(cur))
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------ lifecycle
    @property
    def finalized(self) -> bool:
        return self._closed

    def finalize(self) -> None:
        """Collective: free every symmetric buffer and stop the NVSHMEM runtime. Idempotent."""
        if self._closed:
            return
        self._sync()
        self.barrier()
        self._shutdown(free=True)

    def _shutdown(self, free: bool) -> None:
        global _ACTIVE
        from ..kernels import nvshmem_device as nvd

        nvd.set_runtime_ready(False)
        self._ws = None
        self._pad = None
        if free:
            while self._keep:
                self._nv.core.free_tensor(self._keep.pop())
        self._keep.clear()
        self._closed = True
        try:
            self._nv.core.finalize()
        finally:
            # What the host library reports once we stopped it (it may keep its bootstrap): not
            # a foreign runtime for a later world of this process.
            _AFTER_FINALIZE["status"] = _init_status(self._nv)
            with _ACTIVE_LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()
        return False


def active_world() -> NvshmemWorld | None:
    """The live NvshmemWorld of this process, if any (for other backends' conflict checks)."""
    return _ACTIVE


def make_nvshmem_world(group=None, seed: int = 0) -> World:
    """``init_world('nvshmem')``: an :class:`NvshmemWorld` over ``group`` (default: WORLD)."""
    return NvshmemWorld(group=group, seed=seed)
