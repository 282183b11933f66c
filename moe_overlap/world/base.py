"""The World protocol: what every fused op talks to.

A World is one rank's handle on a communicator group with symmetric memory:

* ``rank``, ``world_size``, ``device``, ``generator`` (a per-rank ``torch.Generator``);
* ``alloc(shape, dtype)`` -> :class:`SymmTensor` (local tensor + device int64 table of every rank's
  base address), ``signals(n)`` -> zeroed symmetric int32 flags;
* ``barrier()``, ``all_reduce(tensor)`` (sum, in place), ``all_gather_ints(values)``;
* ``workspace(nbytes)`` and ``signal_pad(n)``: one symmetric scratch area and one flag area per
  world shared by all ops, grown collectively (every rank must ask for the same size: ops derive
  sizes from data every rank knows, such as the exchanged token counts, or from static limits);
* ``run_fused(launch)``: runs a fused op's roles in the order this world needs (both at once on
  real hardware; producers of every rank before any consumer when ranks are emulated);
* ``check()``: raises :class:`CommTimeoutError` for a wait that timed out in an earlier op.

Op protocol (every fused op, same on every backend):

1. ``begin_op(nflags)`` zeroes the op's flags on this rank (the owner resets what it will wait
   on), then publishes "ready for epoch e" into every peer's pad (``kernels.signals``). Producers
   wait for their destination's ready epoch before writing into its workspace, so no buffer is
   overwritten while its owner still reads the previous op. No host sync, CUDA-graph safe (the
   epoch lives on the device).
2. ``run_fused(launch)`` launches ``launch(role)``: ``ROLE_BOTH`` where ranks run concurrently,
   else ``ROLE_PRODUCER`` on every rank, a barrier, then ``ROLE_CONSUMER``.
3. ``end_op()`` enqueues a non-blocking copy of the error record, read lazily by the next op.
   While a CUDA graph is being captured it enqueues nothing (a captured copy would replay
   unread, and an event recorded in a capture cannot be queried after it): a captured op's
   timeouts are raised by ``check()``.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import zlib
from dataclasses import dataclass

import torch

from ..errors import ERR_WORDS, CommTimeoutError
from .topology import TopologyMixin

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZE_WORDS = 8  # size_words: the op's tag and up to 7 sizes


def _size_code(v) -> int:
    if isinstance(v, torch.dtype):
        return -1 - (_DTYPES.index(v) if v in _DTYPES else len(_DTYPES))
    return int(v)


def _size_name(code: int, like) -> str:
    if isinstance(like, torch.dtype):
        i = -1 - code
        return str(_DTYPES[i]).replace("torch.", "") if 0 <= i < len(_DTYPES) else "other"
    return str(bool(code)) if isinstance(like, bool) else str(code)


def size_words(op: str, sizes: dict) -> list[int]:
    """``SIZE_WORDS`` int32-safe ints that stand for ``op`` called with ``sizes`` (ints, bools,
    dtypes): the op's tag, then the sizes, zero-padded. One length for every op, so ranks in
    different ops still exchange alike (an NCCL all-gather of different lengths would not
    return)."""
    if len(sizes) >= SIZE_WORDS:
        raise ValueError(f"at most {SIZE_WORDS - 1} sizes, got {len(sizes)}")
    words = [zlib.crc32(op.encode()) & 0x7FFFFFFF] + [_size_code(v) for v in sizes.values()]
    return words + [0] * (SIZE_WORDS - len(words))


def check_size_rows(op: str, rank: int, sizes: dict, rows) -> None:
    """Raise ``ValueError`` unless every rank's :func:`size_words` (``rows[r]``) equal this
    rank's; the message names the sizes that differ, per rank. Every rank sees the same rows
    and raises alike."""
    mine = size_words(op, sizes)
    rows = [list(map(int, v)) for v in rows]
    if all(v == mine for v in rows):
        return
    if any(v[0] != mine[0] for v in rows):
        raise ValueError(
            f"rank {rank}: {op}: the ranks are not all in this op (collective calls out of "
            f"order, or a rank skipped one)"
        )
    names = list(sizes)
    differ = [i for i, k in enumerate(names) if len({v[1 + i] for v in rows}) > 1]
    per_rank = "; ".join(
        f"rank {r}: "
        + ", ".join(f"{names[i]} {_size_name(v[1 + i], sizes[names[i]])}" for i in differ)
        for r, v in enumerate(rows)
    )
    raise ValueError(
        f"rank {rank}: {op}: the ranks disagree on {', '.join(names[i] for i in differ)} "
        f"({per_rank}); every rank must call it with the same sizes"
    )


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


ROLE_BOTH, ROLE_PRODUCER, ROLE_CONSUMER = 0, 1, 2

# Slots at the start of every signal pad hold the peers' ready epochs (one per rank).
READY_SLOTS = 64
MAX_WORLD = READY_SLOTS

_ALIGN = 256


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (read at import time by Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The Triton interpreter keeps one global grid index and patches triton.language per launch:
# launches from several threads (emulated ranks) must not interleave.
_LAUNCH_LOCK = threading.RLock()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def launch_lock():
    """Context manager every host launcher wraps its Triton launches in."""
    return _LAUNCH_LOCK if interpreted() else _NoLock()


def default_wait_budget(device: torch.device) -> int:
    """Wait budget: nanoseconds on the GPU, poll iterations in the interpreter.

    ``MOE_OVERLAP_WAIT_TIMEOUT_S`` sets the GPU budget (default 20 s: a peer's first JIT compile
    must fit in it). ``MOE_OVERLAP_WAIT_ITERS`` sets the interpreter budget (default 200: in the
    emulated sequential mode every producer has finished before a consumer polls, so a wait that
    polls more than once is already a protocol error).
    """
    gpu = device.type == "cuda" and not interpreted()
    name = "MOE_OVERLAP_WAIT_TIMEOUT_S" if gpu else "MOE_OVERLAP_WAIT_ITERS"
    text = os.environ.get(name, "20" if gpu else "200")
    try:
        v = float(text) if gpu else int(text)
    except ValueError:
        v = -1
    if v <= 0:
        raise ValueError(f"{name} must be a positive {'number' if gpu else 'int'}, got {text!r}")
    return int(v * 1e9) if gpu else v


@dataclass
class SymmTensor:
    """One rank's piece of a symmetric allocation.

    ``local`` is this rank's tensor; ``ptrs`` is an int64 tensor ``[world_size]`` on the world's
    device holding the base address of every rank's piece (same shape, dtype and offset).
    """

    local: torch.Tensor
    ptrs: torch.Tensor
    # Emulated worlds: the peers' tensors, so no rank frees memory a peer still addresses.
    keep: tuple = ()

    def view(self, offset_bytes: int, shape, dtype: torch.dtype) -> SymmTensor:
        """A typed sub-view at the same byte offset on every rank (for workspace carving)."""
        if offset_bytes % _ALIGN:
            raise ValueError(f"offset_bytes must be a multiple of {_ALIGN}, got {offset_bytes}")
        numel = math.prod(shape)
        esize = torch.empty((), dtype=dtype).element_size()
        raw = self.local.view(torch.uint8).reshape(-1)
        if offset_bytes + numel * esize > raw.numel():
            raise ValueError("view exceeds the symmetric buffer")
        loc = raw[offset_bytes : offset_bytes + numel * esize].view(dtype).view(shape)
        return SymmTensor(loc, self.ptrs + offset_bytes, self.keep)


class WorkspacePlan:
    """Carves aligned regions of a workspace: ``off = plan.add(nbytes)``; ``plan.total``."""

    def __init__(self):
        self.total = 0

    def add(self, shape, dtype: torch.dtype) -> int:
        off = self.total
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return off


class World(TopologyMixin):
    """Base class. Backends implement the ``_``-prefixed hooks."""

    backend = "base"

    def __init__(self, rank: int, world_size: int, device: torch.device, seed: int = 0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if world_size > MAX_WORLD:
            raise ValueError(f"world_size {world_size} exceeds the supported {MAX_WORLD}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed * 1000003 + rank)
        self.wait_budget = default_wait_budget(self.device)
        self.use_timer = self.device.type == "cuda" and not interpreted()
        self.debug = os.environ.get("MOE_OVERLAP_DEBUG", "0") == "1"
        self._err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=self.device)
        self._err_host = None
        self._err_event = None
        self._epoch = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._ws: SymmTensor | None = None
        # Set while this rank runs a backward op: no host barrier may be used then (autograd's
        # CUDA worker thread is shared by every emulated rank).
        self.in_backward = False
        self.producer_delay_cycles = 0
        self._pad: SymmTensor | None = None
        # Custom ops carry worlds by name (a World is no schema type); register eagerly so a
        # traced graph never has to mutate the registry.
        from . import _register

        self.name: str = _register(self)

    # ----------------------------------------------------------------- backend hooks
    def _alloc_symmetric(self, nbytes: int) -> SymmTensor:  # collective
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather_ints(self, values) -> list[list[int]]:
        """Host-side all-gather of a short list of ints: result[r] is rank r's list."""
        raise NotImplementedError

    @property
    def checks_sizes(self) -> bool:
        """Whether :meth:`agree` exchanges sizes: with ``MOE_OVERLAP_DEBUG=1`` or
        ``MOE_OVERLAP_CHECK_SIZES=1`` (a host all-gather and sync per op; off by default, where
        the kernels trust the collective contract as NCCL does). Emulated worlds always check:
        their exchange is a host handshake between threads, with no device sync."""
        return self.debug or os.environ.get("MOE_OVERLAP_CHECK_SIZES", "0") == "1"

    def _exchange_sizes(self, values: list[int]) -> list[list[int]]:
        return self.all_gather_ints(values)

    def agree(self, op: str, **sizes) -> None:
        """Raise ``ValueError`` on every rank unless every rank calls ``op`` with the same
        ``sizes`` (ints, bools or dtypes), where :attr:`checks_sizes` says to look.

        The fused kernels size their flags, tiles and peers' buffer offsets from the caller's
        shapes, so ranks that disagree would write past each other's buffers, silently. Every
        call exchanges (never "only sizes not seen before": that decision would be each rank's
        own, and a rank with new sizes would then wait in an exchange its peers skip). The op's
        name travels along, so ranks in different ops fail too rather than pair up. Skipped at
        one rank, in a backward (its sizes come from the forward, and a backward must not block
        on peers' host progress) and in warm-up."""
        from ..kernels.launch import warming_up

        if self.world_size == 1 or self.in_backward or warming_up() or not self.checks_sizes:
            return
        check_size_rows(op, self.rank, sizes, self._exchange_sizes(size_words(op, sizes)))

    def all_to_all(self, send: list) -> list:
        """Host-driven tensor all-to-all (baselines, not the fused path): ``send[d]`` goes to
        rank d; returns ``recv`` with ``recv[s]`` from rank s. Dim 0 may differ per pair; the
        other dims and the dtype must agree. Not differentiable by itself."""
        raise NotImplementedError

    @property
    def concurrent(self) -> bool:
        """True when every rank's kernels run at the same time (ROLE_BOTH launches)."""
        return True

    # ----------------------------------------------------------------- memory
    def alloc(self, shape, dtype: torch.dtype) -> SymmTensor:
        """Collective: a new symmetric tensor (uninitialized) of ``shape`` and ``dtype``."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative, got {shape}")
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(math.prod(shape) * esize, _ALIGN)
        raw = self._alloc_symmetric(nbytes)
        return raw.view(0, shape, dtype)

    def signals(self, n: int) -> SymmTensor:
        """Collective: ``n`` zeroed symmetric int32 flags."""
        s = self.alloc((n,), torch.int32)
        s.local.zero_()
        self.barrier()
        return s

    def workspace(self, nbytes: int) -> SymmTensor:
        """The world's shared symmetric scratch area, at least ``nbytes`` long.

        Collective when it grows: every rank must pass the same ``nbytes`` (ops compute it from
        data every rank knows). Growth rounds up to 1.5x, so a growing workload re-allocates
        rarely; previous views become invalid, so ops fetch the workspace on every call.
        """
        nbytes = int(nbytes)
        if self._ws is None or self._ws.local.numel() < nbytes:
            old = 0 if self._ws is None else self._ws.local.numel()
            size = max(nbytes, int(old * 1.5), 1 << 20)
            size = (size + (1 << 20) - 1) >> 20 << 20
            self._ws = None
            self._ws = self._alloc_symmetric(size)
        return self._ws

    def signal_pad(self, n: int) -> SymmTensor:
        """The world's flag area: ``READY_SLOTS`` ready words, then at least ``n`` op flags."""
        need = READY_SLOTS + int(n)
        if self._pad is None or self._pad.local.numel() // 4 < need:
            old = 0 if self._pad is None else self._pad.local.numel() // 4
            words = max(need, int(old * 1.5), 4096)
            pad = self._alloc_symmetric(words * 4)
            # The ready epochs must survive growth: peers compare against our epoch counter.
            pad.local.zero_()
            if self._pad is not None:
                pad.local[: self._pad.local.numel()].copy_(self._pad.local)
            self._pad = pad
            self.barrier()
        return self._pad.view(0, (self._pad.local.numel() // 4,), torch.int32)

    # ----------------------------------------------------------------- transports
    def _put_peers(self) -> tuple[bool, ...]:
        """Per rank: True where this rank moves data to it by puts. Cached per topology (every
        op asks, and reachability changes only with the topology)."""
        topo = self.topology
        cached = self.__dict__.get("_put_peers_cache")
        if cached is None or cached[0] is not topo:
            key = tuple(not self.peer_reachable(r) for r in range(self.world_size))
            cached = (topo, key, None)
            self.__dict__["_put_peers_cache"] = cached
        return cached[1]

    @property
    def has_puts(self) -> bool:
        """True when some peer is reachable only by puts (another node; see ``topology``)."""
        return any(self._put_peers())

    @property
    def uses_nvshmem(self) -> bool:
        """True when the put path runs NVSHMEM's device library (kernels compile with
        ``nvshmem_device.compile_options()``); False where puts are emulated by copies."""
        return False

    @property
    def put_mask(self) -> torch.Tensor:
        """int32 ``[W]`` on the device: 1 where this rank moves data to that rank by puts.

        Built when the topology is set (a host-to-device copy, so never inside a CUDA-graph
        capture) and again only when the topology changes."""
        key = self._put_peers()
        topo, _, mask = self.__dict__["_put_peers_cache"]
        if mask is None:
            mask = torch.tensor([int(k) for k in key], dtype=torch.int32, device=self.device)
            self.__dict__["_put_peers_cache"] = (topo, key, mask)
        return mask

    # ----------------------------------------------------------------- op protocol
    def begin_op_signals(self, nflags: int, nsig: int) -> tuple[SymmTensor, SymmTensor]:
        """``begin_op`` for an op with a put path: ``nflags`` int32 flags plus ``nsig`` int64
        signal words (the put path's arrival counters), both zeroed by their owner here.

        The signal words follow the flags in the op's slice of the pad (256-byte aligned) and
        never alias them (``kernels/put.py``)."""
        n32 = -(-max(int(nflags), 1) // (_ALIGN // 4)) * (_ALIGN // 4)
        flags = self.begin_op(n32 + 2 * max(int(nsig), 1), puts=True)
        sig = flags.view(n32 * 4, (max(int(nsig), 1),), torch.int64)
        return flags.view(0, (max(int(nflags), 1),), torch.int32), sig

    def begin_op(self, nflags: int, puts: bool = False) -> SymmTensor:
        """Reset this op's flags, publish readiness; returns the op flags (after ready slots).

        ``puts``: the op has a put path (``kernels/put.py``). An op without one refuses a world
        where some peer is reachable only by puts: its stores would go nowhere."""
        from ..kernels.launch import warming_up

        if not puts and self.has_puts:
            far = [r for r in range(self.world_size) if not self.peer_reachable(r)]
            raise RuntimeError(
                f"rank {self.rank}: ranks {far} are on other nodes (reachable only by puts) and "
                "this op has no put path: run it within one node"
            )
        pad = self.signal_pad(nflags)
        flags = pad.view(READY_SLOTS * 4, (max(nflags, 1),), torch.int32)
        if warming_up():  # an earlier op's kernels may still wait on these flags
            return flags
        self._poll_errors()
        flags.local.zero_()
        with launch_lock():
            self._publish_ready(pad)
        return flags

    def _publish_ready(self, pad: SymmTensor) -> None:
        """Launch the op-start handshake (the nvshmem world adds a put path)."""
        from ..kernels import signals as sig

        sig.publish_ready(pad.ptrs, self._epoch, self.rank, self.world_size)

    def ready_args(self):
        """(pad base pointer, epoch tensor) that producers pass to their ready waits."""
        return self._pad.local.view(torch.int32), self._epoch

    def run_fused(self, launch, split: bool = False) -> None:
        """Run ``launch(role)`` for this world: both roles at once, or phased when emulated.

        ``split``: the op's consumer is a separate kernel issued after the producer on the same
        stream (e.g. the combine's reduction); concurrent worlds launch both without a barrier.
        """
        from ..kernels.launch import warming_up, warmup_only

        def roles():
            if split:
                launch(ROLE_PRODUCER)
                launch(ROLE_CONSUMER)
            else:
                launch(ROLE_BOTH)

        if warming_up():  # compile + load only (see kernels/launch.py)
            roles() if self.concurrent else (launch(ROLE_PRODUCER), launch(ROLE_CONSUMER))
            return
        if self.concurrent:
            if self._needs_load_barrier():
                # Every rank compiles and loads its variants, then all meet: no rank spins
                # while a peer's thread is still loading kernel code.
                with warmup_only():
                    roles()
                self._warm_delay()
                self.barrier()
            self._inject_delay()
            with launch_lock():
                roles()
        else:
            if self.in_backward and self.device.type == "cuda" and self.world_size > 1:
                raise RuntimeError(
                    "emulated backward on one GPU needs spawn(..., mode='concurrent'): autograd "
                    "runs every rank's CUDA backward on one worker thread, so phased launches "
                    "with host barriers cannot meet"
                )
            self.barrier()  # every rank's ready epoch is published
            with launch_lock():
                launch(ROLE_PRODUCER)
            self.barrier()  # every rank's producers have finished
            with launch_lock():
                launch(ROLE_CONSUMER)

    @contextlib.contextmanager
    def backward_scope(self):
        """Marks this rank's backward ops: they must not use host barriers (see
        ``in_backward``)."""
        prev = self.in_backward
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = prev

    def _needs_load_barrier(self) -> bool:
        return False

    def _warm_delay(self) -> None:
        """Load the sleep kernel of the delay hook before the barrier: CUDA loads kernels lazily,
        and a first ``torch.cuda._sleep`` issued while peers' kernels already spin waits for them,
        which wait for this rank. The likely cause of a ``CommTimeoutError`` the toy op raised
        once in two H200 runs with a delayed rank (the first delay of the process); unverified."""
        if self.producer_delay_cycles and self.device.type == "cuda":
            torch.cuda._sleep(1)

    def _inject_delay(self) -> None:
        """Test hook: ``world.producer_delay_cycles`` sleeps this rank's stream before a launch,
        so peers' waits really wait (GPU only)."""
        if self.producer_delay_cycles and self.device.type == "cuda":
            torch.cuda._sleep(int(self.producer_delay_cycles))

    def end_op(self) -> None:
        from ..kernels.launch import warming_up

        if warming_up():
            return
        if self.device.type == "cuda" and _capturing():
            # A captured copy and event record would replay blind, any later query of an event
            # recorded in a capture raises, and a sync (debug mode) is illegal there: graphs
            # report through check() only.
            return
        if self.debug or self.device.type != "cuda":
            # On the CPU everything already ran: checking costs nothing.
            self.check()
            return
        if self.device.type == "cuda":
            if self._err_host is None:
                self._err_host = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=True)
                self._err_event = torch.cuda.Event()
            self._err_host.copy_(self._err, non_blocking=True)
            self._err_event.record()

    def _poll_errors(self) -> None:
        """Raise for an error recorded by an earlier op if its copy has landed (no sync)."""
        if self.device.type != "cuda":
            if int(self._err[0]) != 0:
                self._raise()
            return
        if _capturing():  # querying an event is illegal while the stream is being captured
            return
        if self._err_event is not None and self._err_event.query():
            if int(self._err_host[0]) != 0:
                self._raise()

    def check(self) -> None:
        """Synchronize and raise :class:`CommTimeoutError` if any wait of this rank timed out."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if int(self._err[0]) != 0:
            self._raise()

    def _raise(self):
        rec = self._err.cpu().tolist()
        self._err.zero_()
        if self._err_host is not None:
            self._err_host.zero_()
        raise CommTimeoutError(
            rank=rec[1], stage=rec[2], index=rec[3], expected=rec[4], seen=rec[5]
        )

    @property
    def error_buffer(self) -> torch.Tensor:
        return self._err

    def __repr__(self):
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device})"
        )
