"""Host collectives over a ``torch.distributed`` group, shared by the worlds whose ranks are
processes (``torch_symm``, ``nvshmem``): all_reduce (sum), a small all-gather of host ints, and
the host-driven tensor all-to-all the baselines use. The class needs ``group``, ``device`` and
``world_size`` attributes; ``barrier`` stays with each world (nvshmem also fences its puts)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DistCollectives:
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_ints(self, values) -> list[list[int]]:
        vals = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * vals.numel(), dtype=torch.int64, device=self.device)
        # all_gather_single is the newer name (torch 2.13 deprecates the old one).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, vals, group=self.group)
        return out.view(self.world_size, -1).cpu().tolist()

    def all_to_all(self, send: list) -> list:
        if len(send) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(send)}")
        sizes = torch.tensor([t.shape[0] for t in send], dtype=torch.int64, device=self.device)
        recv_sizes = torch.empty_like(sizes)
        dist.all_to_all_single(recv_sizes, sizes, group=self.group)
        rs = recv_sizes.tolist()
        inp = torch.cat([t.contiguous() for t in send])
        out = inp.new_empty((sum(rs), *inp.shape[1:]))
        dist.all_to_all_single(out, inp, rs, [t.shape[0] for t in send], group=self.group)
        return list(out.split(rs))
