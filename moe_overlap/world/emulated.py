"""Emulated world: W virtual ranks in one process (threads), on the CPU or on one GPU.

Peers are ordinary tensors; pointer tables hold their ``data_ptr()``s, so the *same kernels*
run as on real symmetric memory.

Modes
-----
* ``sequential`` (CPU always; GPU default): ``run_fused`` launches the producer role of every
  rank, a barrier, then the consumer role. No launch ever waits on a launch that has not
  completed, so the interpreter (one program at a time, launches serialized by a lock) and a
  single stream cannot deadlock. On the GPU every rank enqueues on the same stream, so device
  order is host order and host barriers order device work.
* ``concurrent`` (GPU only): each rank has its own stream and launches both roles at once, so
  waits really wait on another stream's producers. Grids must be co-resident (ops size them from
  ``world.max_programs``). This is the race detector available without several GPUs. It is also
  the mode for emulated *backward* on the GPU: autograd runs every CUDA backward node of every
  thread on one device worker thread, so a host barrier inside a backward node can never be met
  (measured on the H200: two threads, a ``threading.Barrier`` in a custom backward, broke only on
  its timeout). In concurrent mode no op blocks on the host.

Backward threads
----------------
Even without host barriers, one shared worker serializes the ranks' backward *host* code: a
rank whose backward waits on the host after launching a fused kernel (a torch op that syncs its
stream, a first cuBLAS call on the thread, an allocator free) holds the worker, and the peer
launch its kernel spins for is queued behind it. Seen on the H200 (2026-12-02): concurrent
W = 2 TP and MoE backward steps hit ``CommTimeoutError`` (an RS owner waiting for a peer's
tiles, ready handshakes) or ran past 200 s, with eager module loading on as well. So
``testing.spawn`` runs each rank with ``torch.autograd.set_multithreading_enabled(False)``
(thread-local): autograd runs that rank's backward on the rank's own thread, and a host wait
delays that rank alone. On the H200 that alone did not end the timeouts (see Lockstep).
The ops still avoid host barriers in backward, for emulated ranks driven from threads spawn
did not make.

Lockstep
--------
Before every fused op a concurrent world syncs each rank's stream and meets at a host barrier
(``run_fused``): forward and, on ``spawn``'s per-rank backward threads, backward too. Measured
on the H200 (2026-12-02) with the per-rank threads but without the barrier in backward: W = 2
MoE backward still timed out in the ready handshake of the 5th op (rank 0's combine kernel
spinning for rank 1's epoch while rank 1 sat between two ops: its weight-gradient matmuls and a
first cuBLAS use on its thread run behind kernels that hold the SMs), and so did the TP
backward tests. With lockstep, kernels that wait only ever wait on kernels of the same op,
all launched and co-resident, and every host wait (module loads, allocator calls, cuBLAS
handles) happens while no kernel spins. The delay hook still runs after the barrier, so waits
inside an op really wait.

Lazy module loading
-------------------
CUDA loads a kernel's code at its first launch by default (torch sets
``CUDA_MODULE_LOADING=LAZY``), and a load can wait for the device's running kernels: a torch
kernel met for the first time by one rank while a peer's fused kernel spins for that rank's
launch stalls both until the spin budget ends. Our own Triton kernels are compiled and loaded
before any launch (``warmup_only``), but torch's own kernels (a cuBLAS variant for a new shape)
cannot all be known in advance, so a concurrent world asks for eager loading before CUDA starts
(``prefer_eager_module_loading``; the GPU suite checks it took effect) and warns where CUDA
already started lazily.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import torch

from .base import SymmTensor, World


def _driver_loading_mode() -> int | None:
    """``cuModuleGetLoadingMode``: 1 eager, 2 lazy; None where the driver has not started (the
    variable is read when it starts) or cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        mode = ctypes.c_int(0)
        return mode.value if lib.cuModuleGetLoadingMode(ctypes.byref(mode)) == 0 else None
    except (OSError, AttributeError):
        return None


def prefer_eager_module_loading(warn: bool = True) -> None:
    """Ask CUDA to load every kernel when a context is made, where the driver has not started
    yet (see the module docstring); otherwise, if it loads lazily, warn (``warn=True``)."""
    mode = _driver_loading_mode()
    if mode == 1:
        return
    if mode is None and not torch.cuda.is_initialized():
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        if os.environ["CUDA_MODULE_LOADING"].upper() == "EAGER":
            return
    if warn:
        warnings.warn(
            "concurrent emulated ranks on one GPU with lazy CUDA module loading: a torch kernel "
            "loaded for the first time during backward can stall every rank until the spin "
            "budget ends (CommTimeoutError). Set CUDA_MODULE_LOADING=EAGER before CUDA starts.",
            RuntimeWarning,
            stacklevel=3,
        )


class _Group:
    """State shared by the virtual ranks of one emulated world."""

    def __init__(self, world_size: int, device: torch.device, mode: str, timeout: float):
        self.world_size = world_size
        self.device = device
        self.mode = mode
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots = [None] * world_size
        self.streams = None
        if device.type == "cuda" and mode == "concurrent":
            self.streams = [torch.cuda.Stream(device) for _ in range(world_size)]


class EmulatedWorld(World):
    backend = "emulated"

    def __init__(self, group: _Group, rank: int, seed: int = 0):
        super().__init__(rank, group.world_size, group.device, seed=seed)
        self._group = group
        # Programs one rank's fused kernel may use so that every rank's grid is co-resident.
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.max_programs = max(1, sms // group.world_size)
        else:
            self.max_programs = 1 << 30

    @property
    def concurrent(self) -> bool:
        return self._group.mode == "concurrent"

    def _needs_load_barrier(self) -> bool:
        # Concurrent ranks share one device: a lazy kernel load by one thread can wait on
        # another rank's spinning kernel, and so can any host wait between two ops (see
        # "Lockstep"). In backward a host barrier can meet only where each rank runs its own
        # backward (``spawn`` does that); on autograd's shared worker it never could.
        if self.device.type != "cuda" or self.world_size == 1:
            return False
        return not self.in_backward or not torch.autograd.is_multithreading_enabled()

    @property
    def stream(self):
        if self._group.streams is None:
            return None
        return self._group.streams[self.rank]

    # ------------------------------------------------------------- host collectives
    def _sync_device(self):
        if self.device.type == "cuda" and self.concurrent:
            torch.cuda.current_stream(self.device).synchronize()

    def barrier(self) -> None:
        self._sync_device()
        self._group.barrier.wait()

    def _exchange(self, obj):
        g = self._group
        g.slots[self.rank] = obj
        self.barrier()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("all_reduce takes a tensor")
        parts = self._exchange(tensor.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:  # rank order: every rank gets bitwise the same sum
            total += p.to(total.device)
        self.barrier()
        tensor.copy_(total)
        return tensor

    @property
    def checks_sizes(self) -> bool:
        return os.environ.get("MOE_OVERLAP_CHECK_SIZES", "1") != "0"

    def _exchange_sizes(self, values: list[int]) -> list[list[int]]:
        # Host values only: no device sync, so a GPU run's overlap is left as it is.
        g = self._group
        g.slots[self.rank] = list(values)
        g.barrier.wait()
        out = [list(v) for v in g.slots]
        g.barrier.wait()
        return out

    def all_gather_ints(self, values) -> list[list[int]]:
        vals = [int(v) for v in values]
        return [list(v) for v in self._exchange(vals)]

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (copies), in rank order. For tests and small metadata."""
        parts = self._exchange(tensor.detach().clone())
        out = [p.clone() for p in parts]
        self.barrier()
        return out

    def all_to_all(self, send: list) -> list:
        if len(send) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(send)}")
        table = self._exchange([t.detach().clone() for t in send])
        recv = [table[s][self.rank].clone() for s in range(self.world_size)]
        self.barrier()
        return recv

    # ------------------------------------------------------------- memory
    def _alloc_symmetric(self, nbytes: int) -> SymmTensor:
        local = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        peers = self._exchange(local)
        table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)
        # The table holds the peers' tensors: a rank that returns early must not free memory
        # its peers still address (their kernels may still publish ready epochs into it).
        return SymmTensor(local, table, tuple(peers))
