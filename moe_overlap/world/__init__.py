"""Worlds: the communicator + symmetric memory every fused op talks to (see ``base``)."""

from __future__ import annotations

import itertools
import os
import weakref

import torch

from ..errors import MissingBackendError
from .base import (
    ROLE_BOTH,
    ROLE_CONSUMER,
    ROLE_PRODUCER,
    SymmTensor,
    WorkspacePlan,
    World,
    interpreted,
    launch_lock,
)
from .emulated import EmulatedWorld

_REGISTRY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def _register(world) -> str:
    name = f"{world.backend}:{next(_COUNTER)}:r{world.rank}"
    _REGISTRY[name] = world
    return name


__all__ = [
    "ROLE_BOTH",
    "ROLE_CONSUMER",
    "ROLE_PRODUCER",
    "SymmTensor",
    "World",
    "WorkspacePlan",
    "EmulatedWorld",
    "default_world",
    "init_world",
    "local_world",
    "register_world",
    "get_world",
    "interpreted",
    "launch_lock",
]


def register_world(world: World) -> str:
    """The name custom ops carry for ``world`` (every World registers itself when built)."""
    _REGISTRY[world.name] = world
    return world.name


def get_world(name: str) -> World:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no world registered under {name!r}") from None


def resolve_device(device) -> torch.device:
    """``device`` as a ``torch.device``, a bare ``"cuda"`` made the current CUDA device
    (``torch.cuda.set_device`` and per-device caches need the index)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def local_world(device=None, seed: int = 0) -> World:
    """A single-rank world on ``device`` (default: the current CUDA device, else the CPU)."""
    from .emulated import _Group

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = resolve_device(device)
    return EmulatedWorld(_Group(1, device, "sequential", timeout=600.0), 0, seed=seed)


_DEFAULT: World | None = None


def default_world() -> World:
    """The process's world, built once by ``init_world()`` on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = init_world()
    return _DEFAULT


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_world(backend: str = "auto", group=None, seed: int = 0) -> World:
    """Build the world for this process.

    ``backend``: ``"auto"`` (torch_symm when torch.distributed is initialized on CUDA; a
    single-rank local world when torch.distributed is not initialized and the job has one rank),
    ``"torch_symm"``, ``"nvshmem"`` or ``"local"``. A job with several ranks that no available
    backend can connect is an error, never a silent single-rank fallback.
    """
    import torch.distributed as dist

    if backend not in ("auto", "torch_symm", "nvshmem", "local"):
        raise ValueError(
            f"backend must be 'auto', 'torch_symm', 'nvshmem' or 'local', got {backend!r} "
            "(emulated worlds come from moe_overlap.testing.spawn)"
        )
    initialized = dist.is_available() and dist.is_initialized()
    if backend == "nvshmem":
        from .nvshmem import make_nvshmem_world

        return make_nvshmem_world(group=group, seed=seed)
    if backend == "local":
        return local_world(seed=seed)
    if backend == "auto" and initialized and torch.cuda.is_available():
        from .nvshmem import install_hint, job_spans_nodes, make_nvshmem_world, nvshmem_available

        if job_spans_nodes(group):  # collective when the launcher does not say
            if not nvshmem_available():
                raise MissingBackendError(
                    "the job spans several nodes and torch_symm connects one node only: the "
                    f"nvshmem backend needs nvshmem4py: {install_hint()}"
                )
            return make_nvshmem_world(group=group, seed=seed)
    if backend == "torch_symm" or (backend == "auto" and initialized):
        if not initialized:
            raise RuntimeError(
                "backend 'torch_symm' needs torch.distributed initialized; launch with torchrun "
                "and call torch.distributed.init_process_group('nccl') first"
            )
        if not torch.cuda.is_available():
            n = dist.get_world_size(group)
            if n == 1:
                return local_world(device="cpu", seed=seed)
            raise RuntimeError(
                f"torch.distributed has {n} ranks but no CUDA device: no available backend "
                "connects them (torch_symm needs GPUs; use testing.spawn for emulated ranks)"
            )
        from .torch_symm import TorchSymmWorld

        return TorchSymmWorld(group=group, seed=seed)
    n = _env_world_size()
    if n > 1:
        raise RuntimeError(
            f"WORLD_SIZE={n} but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first (refusing a silent single-rank world)"
        )
    return local_world(seed=seed)
