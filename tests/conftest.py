"""Test modes: interpreted (CPU, the default) or compiled (GPU), one per process.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when
``moe_overlap.kernels`` is imported, so the mode is fixed here, before any test module imports
Triton, and a process runs one mode only:

* ``pytest tests`` (default): ``TRITON_INTERPRET=1``; kernels run in the Triton interpreter on CPU
  tensors. Tests marked ``gpu`` / ``multigpu`` are skipped.
* ``MOE_OVERLAP_COMPILED=1 pytest -m "gpu or multigpu" tests``: compiled Triton on CUDA. Tests
  *not* marked ``gpu`` / ``multigpu`` are skipped (they hand CPU tensors to kernels, which only the
  interpreter accepts). ``gpu`` tests also need CUDA, ``multigpu`` tests two or more GPUs.

Tests under ``tests/gpu/`` and ``tests/multigpu/`` get their directory's marker when a file
forgot its ``pytestmark`` (an explicit ``gpu`` marker in ``tests/multigpu/`` is kept: a test
there that launches ``torchrun`` with one process needs a single GPU only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

COMPILED = os.environ.get("MOE_OVERLAP_COMPILED", "0") == "1"
_WAS_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if COMPILED:
    os.environ.pop("TRITON_INTERPRET", None)
    # Before anything starts CUDA: concurrent emulated worlds need every kernel loaded up front
    # (moe_overlap/world/emulated.py, "Lazy module loading").
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
else:
    os.environ["TRITON_INTERPRET"] = "1"

# Kernels imported earlier (by a plugin, say) were decorated under the old setting: harmless if
# it was already the wanted one, a wrong-mode run otherwise.
if "moe_overlap.kernels.signals" in sys.modules and _WAS_INTERPRETED == COMPILED:
    raise pytest.UsageError(
        "moe_overlap.kernels was imported before tests/conftest.py chose the Triton mode; "
        "run interpreted and compiled tests in separate processes"
    )

_HERE = Path(__file__).resolve().parent
_GPU_CMD = 'MOE_OVERLAP_COMPILED=1 python -m pytest -m "gpu or multigpu" tests'


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_report_header(config):
    mode = "compiled (GPU)" if COMPILED else "interpreted (TRITON_INTERPRET=1, CPU)"
    return f"moe_overlap test mode: {mode}"


def pytest_collection_modifyitems(config, items):
    gpu_dir, multi_dir = _HERE / "gpu", _HERE / "multigpu"
    ngpu = _cuda_count() if COMPILED else 0
    for item in items:
        path = Path(str(item.fspath)).resolve()
        names = {m.name for m in item.iter_markers()}
        if not names & {"gpu", "multigpu"}:
            if multi_dir in path.parents:
                item.add_marker(pytest.mark.multigpu)
                names.add("multigpu")
            elif gpu_dir in path.parents:
                item.add_marker(pytest.mark.gpu)
                names.add("gpu")
        device_test = bool(names & {"gpu", "multigpu"})
        if not COMPILED:
            if device_test:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs compiled Triton on CUDA: run `{_GPU_CMD}` on a GPU machine"
                    )
                )
            continue
        if not device_test:
            item.add_marker(
                pytest.mark.skip(
                    reason="CPU test (runs kernels in the Triton interpreter): run `pytest tests` "
                    "without MOE_OVERLAP_COMPILED"
                )
            )
        elif "multigpu" in names and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {ngpu}"))
        elif ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
