"""Triton kernels of moe_overlap (shipped as ``moe_overlap.kernels``).

Device code only: these modules import torch and triton, never torch.distributed. Peers arrive as
int64 tensors of base addresses plus rank / world-size integers, so the same kernels run on an
emulated world (virtual ranks in one process), on PyTorch SymmetricMemory and on NVSHMEM.
"""
