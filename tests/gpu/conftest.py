"""GPU test settings (compiled Triton; see tests/conftest.py for the mode switch).

* Eager CUDA module loading is asked for in tests/conftest.py (it must precede CUDA's start).
* Keeps NVLink multicast off (the lent H200 machines require it; harmless elsewhere).
* After every test, synchronizes the device so an asynchronous CUDA fault is reported by the
  test that caused it, not by the next one.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@pytest.fixture(autouse=True)
def _synchronize_after_test():
    yield
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
