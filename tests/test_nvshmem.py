"""The nvshmem backend on a machine without NVSHMEM (CPU, Triton interpreter).

* Without nvshmem4py the backend is a clean ``MissingBackendError`` (an ImportError) whose
  message is the pip command, from ``init_world('nvshmem')`` and from the module itself.
* Conflict detection with PyTorch's NVSHMEM backend (environment, Triton hook, init status,
  a second world) on fakes.
* ``kernels/nvshmem_device``: constants (SET 9, ADD 10, CMP_GE 5), library discovery, the
  module-init hook state machine on fakes, the bounded signal wait and the ready handshake in
  the interpreter, and, in a compiled-mode subprocess, every device wrapper lowered to PTX (to a
  cubin linked against ``libnvshmem_device.bc`` when one is installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from moe_overlap import MissingBackendError, init_world
from moe_overlap.kernels import nvshmem_device as nvd
from moe_overlap.world import nvshmem as nvw

HAVE_NVSHMEM = nvw.nvshmem_available()
needs_no_nvshmem = pytest.mark.skipif(HAVE_NVSHMEM, reason="nvshmem4py is installed here")


# ------------------------------------------------------------------------------ missing backend
@needs_no_nvshmem
def test_missing_backend_error_names_the_install_command():
    assert not nvw.nvshmem_available()
    with pytest.raises(MissingBackendError) as ei:
        nvw.import_nvshmem()
    msg = str(ei.value)
    assert isinstance(ei.value, ImportError)
    assert "pip install nvshmem4py-cu1" in msg
    assert "nvshmem4py" in msg


@needs_no_nvshmem
@pytest.mark.parametrize("call", ["init_world", "make_nvshmem_world", "NvshmemWorld"])
def test_backend_unavailable_before_any_distributed_setup(call):
    # torch.distributed is not initialized here: the missing package must be reported first.
    fn = {
        "init_world": lambda: init_world("nvshmem"),
        "make_nvshmem_world": lambda: nvw.make_nvshmem_world(),
        "NvshmemWorld": lambda: nvw.NvshmemWorld(),
    }[call]
    with pytest.raises(MissingBackendError, match=r"pip install nvshmem4py-cu1[23]"):
        fn()


@pytest.mark.parametrize("cuda,first", [("12.8", "cu12"), ("13.0", "cu13"), (None, "cu13")])
def test_install_hint_follows_torch_cuda(monkeypatch, cuda, first):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    hint = nvw.install_hint()
    assert hint.startswith(f"pip install nvshmem4py-{first}")
    other = "cu13" if first == "cu12" else "cu12"
    assert f"nvshmem4py-{other}" in hint


def test_broken_install_is_missing_backend(monkeypatch):
    """An nvshmem4py that fails to import (missing CUDA libraries) reads as missing too."""
    fake = types.ModuleType("nvshmem")
    fake.__path__ = []
    monkeypatch.setitem(sys.modules, "nvshmem", fake)
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", None)  # import raises ImportError
    with pytest.raises(MissingBackendError, match="pip install"):
        nvw.import_nvshmem()


def test_world_needs_distributed(monkeypatch):
    """With nvshmem4py importable (faked), the next requirement is torch.distributed."""
    monkeypatch.setattr(nvw, "import_nvshmem", lambda: types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        nvw.NvshmemWorld()


def test_job_spans_nodes_from_env_without_distributed():
    assert nvw.job_spans_nodes(environ={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) is True
    assert nvw.job_spans_nodes(environ={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) is False
    assert nvw.job_spans_nodes(environ={}) is False  # no launcher info, no process group


# ------------------------------------------------------------------------------ conflicts
def test_no_conflicts_here():
    assert nvw.torch_nvshmem_conflicts(environ={}) == []
    assert nvw.loaded_nvshmem_host_libs() == []
    assert nvw.active_world() is None


@pytest.mark.parametrize("value", ["NVSHMEM", "nvshmem"])
def test_conflict_torch_symmmem_env(value):
    reasons = nvw.torch_nvshmem_conflicts(environ={"TORCH_SYMMMEM": value})
    assert len(reasons) == 1 and "TORCH_SYMMMEM=NVSHMEM" in reasons[0]
    assert nvw.torch_nvshmem_conflicts(environ={"TORCH_SYMMMEM": "CUDA"}) == []


def test_conflict_torch_nvshmem_triton_hook(monkeypatch):
    import triton

    def _nvshmem_init_hook(*args, **kwargs):  # stands in for torch's hook
        return None

    _nvshmem_init_hook.__module__ = "torch.distributed._symmetric_memory._nvshmem_triton"
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", _nvshmem_init_hook)
    reasons = nvw.torch_nvshmem_conflicts(environ={})
    assert any("@requires_nvshmem" in r for r in reasons)


def _fake_nv(status):
    def init_status():
        if status is None:
            raise RuntimeError("no library")
        return status

    return types.SimpleNamespace(bindings=types.SimpleNamespace(init_status=init_status))


@pytest.mark.parametrize("status,conflict", [(0, False), (2, True), (1, True), (None, False)])
def test_conflict_runtime_already_initialized(monkeypatch, status, conflict):
    monkeypatch.delenv("TORCH_SYMMMEM", raising=False)
    reasons = nvw.runtime_conflicts(nvshmem=_fake_nv(status))
    assert bool(reasons) == conflict
    if conflict:
        assert f"nvshmemx_init_status = {status}" in reasons[0]


def test_conflict_second_world(monkeypatch):
    monkeypatch.delenv("TORCH_SYMMMEM", raising=False)
    monkeypatch.setattr(nvw, "_ACTIVE", "NvshmemWorld(rank=0, world_size=2, device=cuda:0)")
    reasons = nvw.runtime_conflicts()
    assert len(reasons) == 1 and "another NvshmemWorld is active" in reasons[0]


# ------------------------------------------------------------------------------ device constants
def test_signal_and_compare_constants():
    # nvshmemx_signal_op_t and nvshmemi_cmp_type from the NVSHMEM headers.
    assert (nvd.NVSHMEM_SIGNAL_SET, nvd.NVSHMEM_SIGNAL_ADD) == (9, 10)
    assert (nvd.SIGNAL_SET.value, nvd.SIGNAL_ADD.value) == (9, 10)
    cmps = [nvd.CMP_EQ, nvd.CMP_NE, nvd.CMP_GT, nvd.CMP_LE, nvd.CMP_LT, nvd.CMP_GE]
    assert [c.value for c in cmps] == [0, 1, 2, 3, 4, 5]
    assert nvd.NVSHMEM_CMP_GE == 5


# ------------------------------------------------------------------------------ library discovery
@pytest.fixture
def fresh_nvd(monkeypatch):
    """Isolate the device module's cached path, hook and module table."""
    monkeypatch.setitem(nvd._STATE, "bc_path", None)
    monkeypatch.setattr(nvd, "_MODULES", {})
    monkeypatch.setattr(nvd, "_NAMES", {})
    monkeypatch.setitem(nvd._STATE, "runtime_ready", False)
    monkeypatch.delenv("MOE_OVERLAP_NVSHMEM_BC", raising=False)
    monkeypatch.delenv("NVSHMEM_LIB_DIR", raising=False)
    yield nvd
    nvd.uninstall_module_init_hook()
    nvd._STATE["bc_path"] = None


def test_library_from_explicit_file(fresh_nvd, monkeypatch, tmp_path):
    bc = tmp_path / "libnvshmem_device.bc"
    bc.write_bytes(b"BC\xc0\xde")
    monkeypatch.setenv("MOE_OVERLAP_NVSHMEM_BC", str(bc))
    assert nvd.device_library_path() == str(bc)
    opts = nvd.compile_options()
    assert opts == {"extern_libs": {"libnvshmem_device": str(bc)}}
    assert nvd._STATE["hook"] is not None
    monkeypatch.setenv("MOE_OVERLAP_NVSHMEM_BC", str(tmp_path / "missing.bc"))
    with pytest.raises(FileNotFoundError, match="is not a file"):
        nvd.device_library_path(refresh=True)


def test_library_from_lib_dir(fresh_nvd, monkeypatch, tmp_path):
    (tmp_path / "libnvshmem_device.bc").write_bytes(b"BC")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    assert nvd.device_library_path() == str(tmp_path / "libnvshmem_device.bc")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="holds none of"):
        nvd.device_library_path(refresh=True)


def test_library_from_wheel_layout(fresh_nvd, monkeypatch, tmp_path):
    lib = tmp_path / "nvidia" / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvshmem_device.bc").write_bytes(b"BC")
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)  # no nvshmem4py finder
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(nvd.site, "getsitepackages", lambda: [])
    monkeypatch.setattr(nvd.site, "getusersitepackages", lambda: str(tmp_path / "user"))
    monkeypatch.setattr(nvd.sysconfig, "get_path", lambda name: str(tmp_path / "none"))
    assert nvd.device_library_path() == str(lib / "libnvshmem_device.bc")


def test_library_missing_says_how_to_install(fresh_nvd, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    monkeypatch.setattr(nvd, "_search_dirs", lambda: [])
    with pytest.raises(FileNotFoundError) as ei:
        nvd.device_library_path()
    msg = str(ei.value)
    assert "libnvshmem_device.bc" in msg and "pip install nvshmem4py-cu13" in msg
    assert "NVSHMEM_LIB_DIR" in msg


# ------------------------------------------------------------------------------ module-init hook
def test_hook_installs_once_into_triton(fresh_nvd):
    import triton

    how = nvd.install_module_init_hook()
    assert how in ("load_chain", "load_attr", "post_compile")
    assert nvd.install_module_init_hook() == how
    chain = getattr(triton.knobs.runtime, "kernel_load_end_hook", None)
    if how == "load_chain":
        assert chain.calls.count(nvd._on_kernel_load) == 1
    nvd.uninstall_module_init_hook()
    if how == "load_chain":
        assert nvd._on_kernel_load not in chain.calls
    assert nvd._STATE["hook"] is None


def test_hook_state_machine(fresh_nvd, monkeypatch):
    inits = []
    monkeypatch.setattr(nvd, "_module_uses_nvshmem", lambda module, group: module in (11, 12))
    monkeypatch.setattr(nvd, "_cumodule_init", lambda module: inits.append(module))

    nvd._on_kernel_load(None)  # no module: nothing
    nvd._on_kernel_load(99, name="plain_kernel")  # no NVSHMEM calls: never initialized
    assert inits == [] and 99 not in nvd._MODULES

    # Loaded before the runtime is up: a clear error, and the module is remembered.
    with pytest.raises(RuntimeError, match="'put_kernel' calls NVSHMEM device functions"):
        nvd._on_kernel_load(11, name="put_kernel")
    assert inits == [] and nvd._MODULES == {11: -1}

    nvd.set_runtime_ready(True)  # the world starts: pending modules are initialized
    assert inits == [11] and nvd.runtime_ready()
    nvd._on_kernel_load(11, name="put_kernel")  # reload of an initialized module: no-op
    nvd._on_kernel_load(12, name="wait_kernel")
    assert inits == [11, 12]

    nvd.set_runtime_ready(False)  # finalize
    with pytest.raises(RuntimeError, match="no NVSHMEM runtime"):
        nvd._on_kernel_load(12, name="wait_kernel")
    nvd.set_runtime_ready(True)  # a new runtime: every module gets the new device state
    assert sorted(inits) == [11, 11, 12, 12]

    nvd._on_kernel_unload(11)
    assert 11 not in nvd._MODULES
    nvd._on_kernel_load(11, name="put_kernel")  # handle reused by a new module
    assert inits[-1] == 11 and len(inits) == 5


def test_module_detection_reads_ptx_without_cuda_python(fresh_nvd, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    yes = tmp_path / "k.ptx"
    yes.write_text(".visible .const .align 8 .b8 nvshmemi_device_state_d[776];\n")
    no = tmp_path / "j.ptx"
    no.write_text(".visible .entry j()\n")
    assert nvd._module_uses_nvshmem(1, {"k.ptx": str(yes), "k.json": "x"})
    assert not nvd._module_uses_nvshmem(1, {"j.ptx": str(no)})
    assert not nvd._module_uses_nvshmem(1, {"j.cubin": str(no)})
    assert not nvd._module_uses_nvshmem(1, None)


# ------------------------------------------------------------------------------ interpreter paths
def test_wait_signal_geq_interpreted():
    import triton
    import triton.language as tl

    from moe_overlap.errors import ERR_WORDS

    @triton.jit
    def _k(sig_ptr, err_ptr, out_ptr, target, budget):
        ok = nvd.wait_signal_geq(sig_ptr + 1, target, err_ptr, 3, 8, 1, budget, False, False)
        tl.store(out_ptr, ok.to(tl.int32))

    sig = torch.tensor([0, 5, 0], dtype=torch.int64)
    for target, expect in [(5, 1), (4, 1), (1 << 40, 0)]:
        err = torch.zeros(ERR_WORDS, dtype=torch.int64)
        out = torch.full((1,), -1, dtype=torch.int32)
        _k[(1,)](sig, err, out, target, 20)
        assert int(out[0]) == expect, target
        if expect:
            assert int(err[0]) == 0
        else:  # code, rank, stage, index, expected, seen
            assert err[:6].tolist() == [1, 3, 8, 1, 1 << 40, 5]


@pytest.mark.parametrize("W,rank", [(1, 0), (3, 1), (4, 3)])
def test_ready_handshake_interpreted(W, rank):
    """Every table entry reachable: the handshake stores epoch e into slot [rank] of each pad."""
    pads = [torch.zeros(8, dtype=torch.int32) for _ in range(W)]
    table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    epoch = torch.tensor([6], dtype=torch.int32)
    nvd.publish_ready(table, epoch, rank, W, use_nvshmem=False)
    nvd.publish_ready(table, epoch, rank, W, use_nvshmem=False)
    assert int(epoch[0]) == 8
    for p in pads:
        want = torch.zeros(8, dtype=torch.int32)
        want[rank] = 8
        assert torch.equal(p, want)


# ------------------------------------------------------------------------------ compiled lowering
_COMPILE_SCRIPT = r"""
import os, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_overlap.kernels import nvshmem_device as nvd

@triton.jit
def _every_wrapper(src_ptr, dst_ptr, sig_ptr, i32_ptr, err_ptr, n, pe, budget,
                   USE_NVSHMEM: tl.constexpr):
    nvd.putmem_nbi_block(dst_ptr, src_ptr, n * 4, pe)
    nvd.putmem_signal_nbi_block(dst_ptr, src_ptr, n * 4, sig_ptr, 1, nvd.SIGNAL_ADD, pe)
    nvd.fence()
    nvd.signal_op(sig_ptr + 1, 3, nvd.SIGNAL_SET, pe)
    nvd.int32_atomic_add(i32_ptr, 1, pe)
    nvd.int32_atomic_set(i32_ptr + 1, 2, pe)
    nvd.quiet()
    ok = nvd.wait_signal_geq(sig_ptr, 1, err_ptr, 0, 8, 0, budget, True, USE_NVSHMEM)
    v = nvd.signal_fetch(sig_ptr) + nvd.signal_wait_until(sig_ptr, nvd.CMP_GE, 1)
    a = nvd.peer_address(dst_ptr, pe)
    tl.store(err_ptr + 7, v.to(tl.int64) + a + nvd.my_pe() + nvd.n_pes() + ok.to(tl.int64))

class _Stop(Exception):
    pass

LINK = len(sys.argv) > 1
BC = sys.argv[1] if LINK else None

def hook(*args):
    # Called once without arguments (cache key) and once with the stage table.
    if not args:
        return ("moe_overlap_stop_at_ptx", "1")
    stages = args[1]
    if not LINK:
        def stop(src, metadata):
            raise _Stop(src)
        stages["cubin"] = stop

triton.knobs.runtime.add_stages_inspection_hook = hook
target = GPUTarget("cuda", 90, 32)
ptr = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "sig_ptr": "*i64", "i32_ptr": "*i32",
       "err_ptr": "*i64", "n": "i32", "pe": "i32", "budget": "i64", "USE_NVSHMEM": "constexpr"}
ready = {"pad_table_ptr": "*i64", "epoch_ptr": "*i32", "rank": "i32", "world_size": "i32",
         "USE_NVSHMEM": "constexpr"}
jobs = [("wrappers", _every_wrapper, ptr, True), ("wrappers_nonv", _every_wrapper, ptr, False),
        ("ready_nv", nvd._ready_kernel, ready, True),
        ("ready_plain", nvd._ready_kernel, ready, False)]
opts = {"extern_libs": {"libnvshmem_device": BC}} if LINK else {}
for name, fn, sig, use in jobs:
    src = ASTSource(fn=fn, signature=sig, constexprs={"USE_NVSHMEM": use})
    try:
        ptx = triton.compile(src, target=target, options=opts).asm["ptx"]
    except _Stop as e:
        ptx = e.args[0]
    names = sorted({w for w in ("nvshmemx_putmem_nbi_block", "nvshmemx_putmem_signal_nbi_block",
                                "nvshmemx_signal_op", "nvshmem_int32_atomic_add",
                                "nvshmem_int32_atomic_set", "nvshmem_signal_wait_until",
                                "nvshmem_signal_fetch", "nvshmem_ptr", "nvshmem_fence",
                                "nvshmem_quiet", "nvshmem_my_pe", "nvshmem_n_pes")
                    if w in ptx})
    ours = re.search(r"begin inline asm[^\n]*\n(?:\s*\.loc[^\n]*\n)*"
                     r"\s*mov\.u32\s+%r\d+, %tid\.x;", ptx)
    print("RESULT", name, int(bool(ours)), int("nvshmemi_device_state_d" in ptx),
          ",".join(names) or "-")
"""


def test_device_wrappers_lower_to_ptx(tmp_path):
    """Every wrapper passes Triton's frontend and LLVM (compiled mode, sm_90). Unlinked, the PTX
    declares each NVSHMEM symbol; linked (when the bitcode is installed), they are inlined and
    the module carries the device state that cumodule_init fills."""
    script = tmp_path / "lower.py"
    script.write_text(textwrap.dedent(_COMPILE_SCRIPT))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    try:
        bc = [nvd.device_library_path()]
    except FileNotFoundError:
        bc = []
    res = subprocess.run(
        [sys.executable, str(script), *bc], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    rows = {
        p[1]: p[2:]
        for p in (line.split() for line in res.stdout.splitlines())
        if p and p[0] == "RESULT"
    }
    assert set(rows) == {"wrappers", "wrappers_nonv", "ready_nv", "ready_plain"}
    every = {
        "nvshmemx_putmem_nbi_block",
        "nvshmemx_putmem_signal_nbi_block",
        "nvshmemx_signal_op",
        "nvshmem_int32_atomic_add",
        "nvshmem_int32_atomic_set",
        "nvshmem_signal_wait_until",
        "nvshmem_signal_fetch",
        "nvshmem_ptr",
        "nvshmem_fence",
        "nvshmem_quiet",
        "nvshmem_my_pe",
        "nvshmem_n_pes",
    }
    tid, _, names = rows["wrappers"]
    assert tid == "1"  # thread-scoped AMOs are predicated on our inline-asm %tid.x
    if not bc:
        assert set(names.split(",")) == every
        assert set(rows["ready_nv"][2].split(",")) == {"nvshmem_int32_atomic_set"}
    else:
        assert rows["wrappers"][1] == "1" and rows["ready_nv"][1] == "1"
    # USE_NVSHMEM=False: the ready handshake is plain atomics, no NVSHMEM symbol at all.
    assert rows["ready_plain"] == ["0", "0", "-"]


# ------------------------------------------------------------------------------ fake runtime
class _FakeNvshmem:
    """Just enough of nvshmem4py for the world's host logic, on CPU tensors, one PE."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.log: list = []
        self.status = 0  # nvshmemx_init_status: 0 not initialized, 2 initialized, 1 bootstrapped
        self.live: dict[int, torch.Tensor] = {}
        core = types.SimpleNamespace(
            get_unique_id=self.get_unique_id,
            init=self.init,
            finalize=self.finalize,
            tensor=self.tensor,
            free_tensor=self.free_tensor,
            my_pe=lambda: 0,
            n_pes=lambda: 1,
            barrier=lambda team, stream: self.log.append(("barrier", team)),
            NvshmemStream=lambda s: ("stream", s),
            Teams=types.SimpleNamespace(TEAM_WORLD=0),
        )
        bindings = types.SimpleNamespace(
            ptr=lambda base, pe: base if pe == 0 else 0, init_status=lambda: self.status
        )
        self.core, self.bindings = core, bindings

    def get_unique_id(self, empty=False):
        np = self.np
        dt = np.dtype([("version", np.int32), ("internal", np.int8, (124,))])
        uid = types.SimpleNamespace(_data=np.zeros(1, dtype=dt).view(np.recarray))
        if not empty:
            uid._data.view(np.uint8)[...] = np.arange(128, dtype=np.uint8)
        return uid

    def init(self, device=None, uid=None, rank=None, nranks=None, initializer_method=""):
        assert self.status != 2, "double init"
        raw = bytes(uid._data.view(self.np.uint8).tobytes())
        self.log.append(("init", rank, nranks, initializer_method, raw[:3]))
        self.status = 2

    def finalize(self):
        self.log.append(("finalize", len(self.live)))
        self.status = 1

    def tensor(self, shape, dtype, except_on_del=True):
        t = torch.empty(shape, dtype=dtype)
        self.live[t.data_ptr()] = t
        self.log.append(("alloc", t.numel()))
        return t

    def free_tensor(self, t):
        assert self.live.pop(t.data_ptr(), None) is not None, "free of an unknown buffer"
        self.log.append(("free", t.numel()))


@pytest.fixture
def fake_pg(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    fake = _FakeNvshmem()
    monkeypatch.setattr(nvw, "import_nvshmem", lambda: fake)
    monkeypatch.setattr(nvw, "_world_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(nvw, "_ACTIVE", None)
    monkeypatch.setitem(nvw._AFTER_FINALIZE, "status", None)
    monkeypatch.delenv("TORCH_SYMMMEM", raising=False)
    monkeypatch.delenv(nvw.FORCE_PUT_ENV, raising=False)
    monkeypatch.setitem(nvd._STATE, "runtime_ready", False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield fake
    finally:
        dist.destroy_process_group()
        nvd.uninstall_module_init_hook()
        nvd._STATE["runtime_ready"] = False


def test_world_host_logic_on_a_fake_runtime(fake_pg, monkeypatch):
    from moe_overlap.toy import push_allreduce

    fake = fake_pg
    w = nvw.make_nvshmem_world(seed=3)
    assert fake.log[0] == ("init", 0, 1, "uid", bytes([0, 1, 2]))
    assert nvw.active_world() is w and nvd.runtime_ready() and w.backend == "nvshmem"
    assert (w.node, w.local_rank, w.local_world_size, w.num_nodes) == (0, 0, 1, 1)
    assert w.peer_reachable(0) and w.all_peers_reachable and w.transport(0) == "store"
    assert ("free", 256) in fake.log  # the reachability probe is returned at once

    # one runtime per process
    with pytest.raises(RuntimeError, match="another NvshmemWorld is active"):
        nvw.NvshmemWorld()

    buf = w.alloc((3, 5), torch.float32)
    assert buf.ptrs.tolist() == [buf.local.data_ptr()]
    assert w.all_gather_ints([4, -1]) == [[4, -1]]
    t = torch.arange(6.0)
    assert torch.equal(w.all_reduce(t.clone()), t)
    assert torch.equal(w.all_to_all([t[:2]])[0], t[:2])

    # a whole op (interpreter): workspace, pad, ready handshake, both roles, error check
    x = torch.randn(17, 33)
    assert torch.equal(push_allreduce(x, w), x)
    kept = len(w._keep)
    ws = w.workspace(1 << 20)
    old = ws.local.data_ptr()
    big = w.workspace(ws.local.numel() * 3)
    assert len(w._keep) == kept and old not in fake.live and big.local.data_ptr() in fake.live
    assert torch.equal(push_allreduce(x * 2, w), x * 2)

    # ops without a put path refuse when a peer needs puts
    monkeypatch.setattr(w, "_reachable", [True, False])
    with pytest.raises(RuntimeError, match=r"ranks \[1\] are reachable only by NVSHMEM puts"):
        w.begin_op(4)
    monkeypatch.setattr(w, "_reachable", [True])

    # PyTorch's NVSHMEM appearing later is refused at the next allocation
    monkeypatch.setenv("TORCH_SYMMMEM", "NVSHMEM")
    with pytest.raises(RuntimeError, match="became active next to this world"):
        w.alloc((2,), torch.int32)
    monkeypatch.delenv("TORCH_SYMMMEM")

    w.finalize()
    assert fake.live == {} and fake.log[-1] == ("finalize", 0)
    assert w.finalized and not nvd.runtime_ready() and nvw.active_world() is None
    w.finalize()
    with pytest.raises(RuntimeError, match="finalized"):
        w.alloc((2,), torch.int32)

    # after our own finalize the library keeps its bootstrap: a new world may start
    w2 = nvw.make_nvshmem_world()
    assert [e[0] for e in fake.log].count("init") == 2
    w2.finalize()


def test_world_refuses_before_bootstrap(fake_pg, monkeypatch):
    fake = fake_pg
    fake.status = 2  # someone else initialized the host library
    with pytest.raises(RuntimeError, match=r"refusing to start NVSHMEM.*rank 0: the NVSHMEM host"):
        nvw.make_nvshmem_world()
    assert not any(e[0] == "init" for e in fake.log) and nvw.active_world() is None
    fake.status = 0
    monkeypatch.setenv("TORCH_SYMMMEM", "NVSHMEM")
    with pytest.raises(RuntimeError, match="TORCH_SYMMMEM=NVSHMEM"):
        nvw.make_nvshmem_world()
    assert not any(e[0] == "init" for e in fake.log)


def test_forced_puts_zero_the_table(fake_pg, monkeypatch):
    monkeypatch.setenv(nvw.FORCE_PUT_ENV, "1")
    w = nvw.make_nvshmem_world()
    try:
        # one PE: only itself, which stays reachable; the forced path shows in peer addresses
        assert w._peer_address(1234, 0) == 1234
        assert w._force_put
        w.world_size = 3
        assert [w._peer_address(1234, r) for r in range(3)] == [1234, 0, 0]
    finally:
        w.world_size = 1
        w.finalize()


def test_unique_id_travels_as_bytes():
    fake = _FakeNvshmem()
    uid = fake.get_unique_id()
    payload = nvw._uid_payload(uid)
    assert payload[0] == "bytes" and len(payload[1]) == 128
    back = nvw._uid_from_payload(fake, payload)
    assert back._data.view(fake.np.uint8).tobytes() == payload[1]
    with pytest.raises(RuntimeError, match="127 bytes received, 128 expected"):
        nvw._uid_from_payload(fake, ("bytes", payload[1][:127]))
    marker = object()
    assert nvw._uid_from_payload(fake, ("obj", marker)) is marker


def test_job_spans_nodes_by_hostnames(fake_pg, monkeypatch):
    import torch.distributed as dist

    assert nvw.job_spans_nodes(environ={}) is False  # one rank, this host
    assert nvw.gather_hostnames() == [__import__("socket").gethostname()]
    multi = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert nvw.job_spans_nodes(environ=multi) is True  # the launcher decides for the whole job
    assert nvw.job_spans_nodes(group=dist.group.WORLD, environ=multi) is True
    # A subgroup is judged by its own ranks' hosts, never by the job's variables.
    sub = dist.new_group([0])
    monkeypatch.setattr(nvw, "gather_hostnames", lambda group=None: ["a", "b"])
    assert nvw.job_spans_nodes(group=sub, environ={"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    monkeypatch.setattr(nvw, "gather_hostnames", lambda group=None: ["a", "a"])
    assert not nvw.job_spans_nodes(group=sub, environ=multi)


def test_put_table_views_keep_zero_entries():
    raw = torch.zeros(4096, dtype=torch.uint8)
    st = nvw._PutTableSymmTensor(raw, torch.tensor([5000, 0, 7000], dtype=torch.int64))
    v = st.view(512, (256,), torch.int32)
    assert isinstance(v, nvw._PutTableSymmTensor)
    assert v.ptrs.tolist() == [5512, 0, 7512]
    assert v.local.data_ptr() == raw.data_ptr() + 512 and v.local.shape == (256,)
    vv = v.view(256, (2,), torch.int64)
    assert vv.ptrs.tolist() == [5768, 0, 7768]
    with pytest.raises(ValueError, match="multiple of"):
        st.view(3, (1,), torch.int8)
