"""World on PyTorch SymmetricMemory: one node, NVLink peer-to-peer, one process per GPU.

Symmetric buffers come from ``torch.distributed._symmetric_memory.empty`` + ``rendezvous`` over
the world's process group; ``handle.buffer_ptrs`` becomes the int64 peer table every kernel
takes. Works at world_size 1 on one GPU (checked on the H200), and at N GPUs under torchrun.
Host collectives (barrier, all_reduce, all_gather_ints) go through the group's NCCL backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import SymmTensor, World
from .dist_collectives import DistCollectives


class TorchSymmWorld(DistCollectives, World):
    backend = "torch_symm"

    def __init__(self, group=None, seed: int = 0):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "the torch_symm world needs torch.distributed initialized "
                "(dist.init_process_group('nccl') under torchrun)"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("the torch_symm world needs CUDA GPUs")
        self.group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(self.group)
        world_size = dist.get_world_size(self.group)
        device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, world_size, device, seed=seed)
        self.max_programs = torch.cuda.get_device_properties(device).multi_processor_count
        # Symmetric allocations stay alive for the world's lifetime, outgrown ones too: PyTorch
        # caches a rendezvous by the buffer's address, and before its tensor-aware rendezvous
        # (pytorch/pytorch#188650, after the 2.11 the H200 runs) a new buffer at a freed one's
        # address could get the old handle's peer pointers back. The cost: workspaces grow in
        # 1.5x steps, so the outgrown ones add up to about twice the final size at most;
        # with MoEConfig(max_tokens_per_rank=...) the MoE ops ask for their worst case at the
        # first call instead of growing it as routing varies.
        self._keep = []
        from torch.distributed import _symmetric_memory as symm

        self._symm = symm
        self._group_name = self.group.group_name

    def _alloc_symmetric(self, nbytes: int) -> SymmTensor:
        t = self._symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = self._symm.rendezvous(t, self._group_name)
        table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        self._keep.append((t, handle))
        return SymmTensor(t, table)

    def barrier(self) -> None:
        dist.barrier(group=self.group)
