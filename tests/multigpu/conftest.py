"""Multi-GPU test settings: torchrun children inherit these (NVLink multicast stays off, as the
lent H200 machines require; harmless elsewhere). Markers and skips live in tests/conftest.py."""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
