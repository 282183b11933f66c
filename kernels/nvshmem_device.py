"""Device-side NVSHMEM for Triton kernels: extern calls into ``libnvshmem_device.bc``.

Importing this module never needs NVSHMEM: the wrappers are plain ``@triton.jit`` functions whose
extern symbols resolve only when a kernel is compiled with :func:`compile_options` (which finds
the bitcode library) and runs in a process whose NVSHMEM runtime is up (``NvshmemWorld``).

Device API (``@triton.jit``, callable from any kernel)
-----------------------------------------------------
* ``putmem_nbi_block(dest, source, nbytes, pe)``: non-blocking put of ``nbytes`` bytes.
* ``putmem_signal_nbi_block(dest, source, nbytes, sig, value, SIG_OP, pe)``: put, then update the
  64-bit signal word ``sig`` on ``pe`` with ``SIG_OP`` (``SIGNAL_SET`` / ``SIGNAL_ADD``) once the
  data is delivered: data and flag in one operation, the inter-node tile transport.
* ``signal_op(sig, value, SIG_OP, pe)``, ``int32_atomic_set(dest, value, pe)``,
  ``int32_atomic_add(dest, value, pe)``: remote flag updates without data (one thread issues).
* ``signal_wait_until(sig, CMP, value)`` (unbounded, NVSHMEM's own), ``signal_fetch(sig)``,
  and :func:`wait_signal_geq`, the bounded wait every kernel of this library uses.
* ``fence()`` (orders this thread's puts/AMOs per destination), ``quiet()`` (completes them),
  ``my_pe()``, ``n_pes()``, ``peer_address(addr, pe)`` (``nvshmem_ptr``: 0 when ``pe`` is not
  load/store reachable).

Addresses may be pointers or int64 addresses. ``dest``/``sig`` of a put are symmetric addresses
*of this rank* (``table[rank] + offset``): NVSHMEM translates them for ``pe``. Never pass a peer
table entry: it is 0 for a peer that is not load/store reachable.

Transport contract (what a fused kernel does per destination ``d``, see ``world/topology.py``)
-----------------------------------------------------------------------------------------------
The choice reads ``World.put_mask[d]`` (1 = put), which for this world is exactly the 0 entries
of the peer table. Store path: store the tile at ``table[d] + off`` and publish its int32 flag
with ``signals.signal_set`` / ``signal_add`` (release, sys scope). Put path
(``kernels/put.py``, used by the MoE ops): store the tile into this rank's own symmetric staging
slot (the put source must be symmetric memory: the world's workspace), ``tl.debug_barrier()``
(every warp's stores are in the slot), then ``putmem_signal_nbi_block(table[rank] + off,
staging, nbytes, sig_table[rank] + 8 * i, value, SIG_OP, d)``: one call per signalled piece, so
no fence is needed. The consumer waits on its local 64-bit signal with :func:`wait_signal_geq`,
and programs that put end with ``quiet()`` so staging is never reused before delivery. The ready
handshake (``publish_ready``) uses stores for reachable peers and ``int32_atomic_set`` for the
others, so the int32 ready slots stay as they are.

Flag contract for puts
----------------------
* NVSHMEM signals are 64-bit words (``uint64_t``), 8-byte aligned, in symmetric memory. The MoE
  ops carve them as int64 after their int32 flags in the signal pad
  (``World.begin_op_signals``, zeroed by the owner at the op start); never alias the two.
* Signal ops: ``SIGNAL_SET = 9``, ``SIGNAL_ADD = 10`` (``nvshmemx_signal_op_t`` in the NVSHMEM
  headers and nvshmem4py's ``bindings.Signal_op``). Some public code passes 0 and 5, which
  NVSHMEM does not treat as SET/ADD: a flag that never arrives, not an error.
* Comparisons: ``CMP_EQ 0, CMP_NE 1, CMP_GT 2, CMP_LE 3, CMP_LT 4, CMP_GE 5`` (``CMP_GE`` is not 3).
* Every wait is bounded: :func:`wait_signal_geq` polls the local word with acquire atomics under
  the world's budget (``signals.wait_geq``: error record + False on timeout), then, on success,
  calls ``nvshmem_signal_wait_until(GE)`` once, which returns at once and gives NVSHMEM's own
  post-wait memory ordering for data delivered by a NIC.

Traps
-----
* Void NVSHMEM functions are declared as returning int32 (Triton's extern calls need a result).
  After linking, LLVM still inlines them: checked on this CPU machine, the PTX of a put kernel
  (Triton 3.9, sm_90a, NVSHMEM 3.4.5 and 3.8.0 bitcode) holds the inlined body and no call to
  the symbol.
* ``*_block`` calls are collective over the program's threads: every thread must reach them in
  uniform control flow. Triton scalars are uniform, so scalar branches are fine; a branch on a
  per-thread value is not.
* Triton runs scalar code in *every* thread. Thread-scoped AMOs (``signal_op``,
  ``int32_atomic_*``) are therefore issued from thread 0 only (``%tid.x == 0``): an ADD executed
  by all 128 threads of a 4-warp program adds 128 times.
* Module init: a compiled kernel's ``CUmodule`` has its own copy of NVSHMEM's device state
  (``nvshmemi_device_state_d``); ``nvshmemx_cumodule_init`` fills it. A launch before that reads
  zeros (fault or hang). :func:`install_module_init_hook` runs the init from Triton's
  kernel-load hook, i.e. at every module load (per process, per device, after a reload), before
  the first launch of the module; ``launch.warmup_only`` loads, so warm-up initializes too.
* Compiling links the NVSHMEM bitcode into every kernel variant. Measured on this 2-core CPU
  machine (Triton 3.9, sm_90a, to cubin): 2.4-5 s per test kernel with NVSHMEM 3.4.5's
  ``libnvshmem_device.bc`` (the first one 12.8 s), about 17 s with 3.8.0's
  ``libnvshmem_device_sm_90.bc`` (3.8 ships per-arch files only). Triton's cache makes it once
  per variant; compile every variant before an op that waits (``launch.warmup_only``) so no peer
  spins meanwhile.
* The bitcode must come from the NVSHMEM whose host library runs the process (device state
  layout): :func:`device_library_path` prefers nvshmem4py's own finder and the
  ``nvidia-nvshmem`` wheel beside it.
* Extern calls cannot run in the Triton interpreter: kernels choose the NVSHMEM path with a
  constexpr (``USE_NVSHMEM``), False under ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import glob
import os
import site
import sys
import sysconfig
import threading

import triton
import triton.language as tl
from triton.language import core

from .signals import wait_geq

# Host-side values (ints) and their device-side constexprs.
NVSHMEM_SIGNAL_SET = 9
NVSHMEM_SIGNAL_ADD = 10
NVSHMEM_CMP_EQ, NVSHMEM_CMP_NE, NVSHMEM_CMP_GT = 0, 1, 2
NVSHMEM_CMP_LE, NVSHMEM_CMP_LT, NVSHMEM_CMP_GE = 3, 4, 5

SIGNAL_SET = tl.constexpr(NVSHMEM_SIGNAL_SET)
SIGNAL_ADD = tl.constexpr(NVSHMEM_SIGNAL_ADD)
CMP_EQ = tl.constexpr(NVSHMEM_CMP_EQ)
CMP_NE = tl.constexpr(NVSHMEM_CMP_NE)
CMP_GT = tl.constexpr(NVSHMEM_CMP_GT)
CMP_LE = tl.constexpr(NVSHMEM_CMP_LE)
CMP_LT = tl.constexpr(NVSHMEM_CMP_LT)
CMP_GE = tl.constexpr(NVSHMEM_CMP_GE)

# Key under which the bitcode travels in Triton's ``extern_libs`` compile option.
EXTERN_LIB_NAME = "libnvshmem_device"
# A global every module that calls NVSHMEM device functions carries (what cumodule_init fills).
DEVICE_STATE_SYMBOL = "nvshmemi_device_state_d"

_I32, _I64, _U64 = tl.int32, tl.int64, tl.uint64


# ----------------------------------------------------------------------------- raw externs
# Argument types must match exactly (no implicit casts); the @triton.jit wrappers below cast.
def _call(symbol, args, arg_types, ret, _semantic):
    return core.extern_elementwise(
        "", "", list(args), {tuple(arg_types): (symbol, ret)}, is_pure=False, _semantic=_semantic
    )


@core.extern
def _x_putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    return _call(
        "nvshmemx_putmem_nbi_block",
        [dest, source, nbytes, pe],
        (_I64, _I64, _I64, _I32),
        _I32,
        _semantic,
    )


@core.extern
def _x_putmem_signal_nbi_block(dest, source, nbytes, sig, value, sig_op, pe, _semantic=None):
    return _call(
        "nvshmemx_putmem_signal_nbi_block",
        [dest, source, nbytes, sig, value, sig_op, pe],
        (_I64, _I64, _I64, _I64, _U64, _I32, _I32),
        _I32,
        _semantic,
    )


@core.extern
def _x_signal_op(sig, value, sig_op, pe, _semantic=None):
    return _call(
        "nvshmemx_signal_op", [sig, value, sig_op, pe], (_I64, _U64, _I32, _I32), _I32, _semantic
    )


@core.extern
def _x_int32_atomic_set(dest, value, pe, _semantic=None):
    return _call("nvshmem_int32_atomic_set", [dest, value, pe], (_I64, _I32, _I32), _I32, _semantic)


@core.extern
def _x_int32_atomic_add(dest, value, pe, _semantic=None):
    return _call("nvshmem_int32_atomic_add", [dest, value, pe], (_I64, _I32, _I32), _I32, _semantic)


@core.extern
def _x_signal_wait_until(sig, cmp, value, _semantic=None):
    return _call(
        "nvshmem_signal_wait_until", [sig, cmp, value], (_I64, _I32, _U64), _U64, _semantic
    )


@core.extern
def _x_signal_fetch(sig, _semantic=None):
    return _call("nvshmem_signal_fetch", [sig], (_I64,), _U64, _semantic)


@core.extern
def _x_ptr(addr, pe, _semantic=None):
    return _call("nvshmem_ptr", [addr, pe], (_I64, _I32), _I64, _semantic)


@core.extern
def _x_fence(_semantic=None):
    return _call("nvshmem_fence", [], (), _I32, _semantic)


@core.extern
def _x_quiet(_semantic=None):
    return _call("nvshmem_quiet", [], (), _I32, _semantic)


@core.extern
def _x_my_pe(_semantic=None):
    return _call("nvshmem_my_pe", [], (), _I32, _semantic)


@core.extern
def _x_n_pes(_semantic=None):
    return _call("nvshmem_n_pes", [], (), _I32, _semantic)


# ----------------------------------------------------------------------------- device API
@triton.jit
def _thread_id_x():
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _addr(p):
    # Pointer or int64 address -> int64 address (ptrtoint for pointers, a no-op for int64).
    return p.to(tl.int64)


@triton.jit
def putmem_nbi_block(dest, source, nbytes, pe):
    """Non-blocking put of ``nbytes`` bytes from local ``source`` to symmetric ``dest`` on ``pe``.

    Collective over the program's threads. Complete with ``quiet()``; order with ``fence()``.
    """
    _x_putmem_nbi_block(
        _addr(dest), _addr(source), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32)
    )


@triton.jit
def putmem_signal_nbi_block(dest, source, nbytes, sig, value, SIG_OP: tl.constexpr, pe):
    """Put ``nbytes`` bytes, then apply ``SIG_OP`` (``SIGNAL_SET``/``SIGNAL_ADD``) with ``value``
    to the 64-bit symmetric word ``sig`` on ``pe`` after the data is delivered.

    Collective over the program's threads; the signal is applied once per call, not per thread.
    """
    tl.static_assert(
        (SIG_OP == 9) or (SIG_OP == 10), "SIG_OP must be SIGNAL_SET (9) or SIGNAL_ADD (10)"
    )
    _x_putmem_signal_nbi_block(
        _addr(dest),
        _addr(source),
        tl.cast(nbytes, tl.int64),
        _addr(sig),
        tl.cast(value, tl.uint64),
        tl.full((), SIG_OP, tl.int32),
        tl.cast(pe, tl.int32),
    )


@triton.jit
def signal_op(sig, value, SIG_OP: tl.constexpr, pe):
    """``SIG_OP`` on the 64-bit symmetric word ``sig`` of ``pe``, issued by thread 0 only.

    No ordering with earlier puts: ``fence()`` first when the signal announces data.
    """
    tl.static_assert(
        (SIG_OP == 9) or (SIG_OP == 10), "SIG_OP must be SIGNAL_SET (9) or SIGNAL_ADD (10)"
    )
    tl.debug_barrier()  # every warp's earlier work is done before thread 0 signals
    if _thread_id_x() == 0:
        _x_signal_op(
            _addr(sig),
            tl.cast(value, tl.uint64),
            tl.full((), SIG_OP, tl.int32),
            tl.cast(pe, tl.int32),
        )
    tl.debug_barrier()


@triton.jit
def int32_atomic_set(dest, value, pe):
    """Atomically set the int32 symmetric word ``dest`` on ``pe`` (thread 0 only)."""
    tl.debug_barrier()
    if _thread_id_x() == 0:
        _x_int32_atomic_set(_addr(dest), tl.cast(value, tl.int32), tl.cast(pe, tl.int32))
    tl.debug_barrier()


@triton.jit
def int32_atomic_add(dest, value, pe):
    """Atomically add to the int32 symmetric word ``dest`` on ``pe`` (thread 0 only)."""
    tl.debug_barrier()
    if _thread_id_x() == 0:
        _x_int32_atomic_add(_addr(dest), tl.cast(value, tl.int32), tl.cast(pe, tl.int32))
    tl.debug_barrier()


@triton.jit
def signal_wait_until(sig, CMP: tl.constexpr, value):
    """NVSHMEM's unbounded wait on the local 64-bit word ``sig``; returns the value seen.

    Kernels of this library call it only once the condition already holds (see
    ``wait_signal_geq``); a bare call can hang forever.
    """
    tl.static_assert((CMP >= 0) and (CMP <= 5), "CMP must be one of CMP_EQ..CMP_GE (0..5)")
    return _x_signal_wait_until(_addr(sig), tl.full((), CMP, tl.int32), tl.cast(value, tl.uint64))


@triton.jit
def signal_fetch(sig):
    """Current value of the local 64-bit signal word ``sig`` (uint64)."""
    return _x_signal_fetch(_addr(sig))


@triton.jit
def peer_address(addr, pe):
    """``nvshmem_ptr``: an int64 address through which this thread can load/store ``pe``'s copy
    of symmetric ``addr``, or 0 when ``pe`` is reachable only by puts."""
    return _x_ptr(_addr(addr), tl.cast(pe, tl.int32))


@triton.jit
def fence():
    """Order this thread's earlier puts/AMOs before its later ones, per destination PE."""
    _x_fence()


@triton.jit
def quiet():
    """Complete this thread's outstanding puts/AMOs."""
    _x_quiet()


@triton.jit
def my_pe():
    return _x_my_pe()


@triton.jit
def n_pes():
    return _x_n_pes()


@triton.jit
def wait_signal_geq(
    sig_ptr,
    target,
    err_ptr,
    rank,
    stage,
    index,
    budget,
    USE_TIMER: tl.constexpr,
    USE_NVSHMEM: tl.constexpr,
):
    """Bounded wait until the local 64-bit signal ``*sig_ptr >= target`` (``sig_ptr``: int64*).

    Polls with acquire atomics under ``budget`` (``signals.wait_geq``: on timeout it writes the
    error record and returns False). On success with ``USE_NVSHMEM``, one
    ``nvshmem_signal_wait_until(GE)`` (returns at once) adds NVSHMEM's post-wait ordering for data
    a NIC delivered. Runs in the interpreter with ``USE_NVSHMEM=False``.
    """
    ok = wait_geq(
        sig_ptr, tl.cast(target, tl.int64), err_ptr, rank, stage, index, budget, USE_TIMER
    )
    if USE_NVSHMEM:
        if ok:
            signal_wait_until(sig_ptr, CMP_GE, target)
    return ok


# ----------------------------------------------------------------------------- ready handshake
@triton.jit(do_not_specialize=["rank", "world_size"])
def _ready_kernel(pad_table_ptr, epoch_ptr, rank, world_size, USE_NVSHMEM: tl.constexpr):
    # signals._ready_kernel with a put path: bump this rank's op epoch and publish it into slot
    # [rank] of every peer's pad: a release store where the peer is reachable (table entry != 0),
    # an NVSHMEM int32 atomic set to our own symmetric slot address on that PE otherwise.
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    own = tl.load(pad_table_ptr + rank)
    for p in range(world_size):
        base = tl.load(pad_table_ptr + p)
        if base != 0:
            tl.atomic_xchg(base.to(tl.pointer_type(tl.int32)) + rank, e, sem="release", scope="sys")
        else:
            if USE_NVSHMEM:
                int32_atomic_set(own + rank * 4, e, p)


def publish_ready(pad_table, epoch, rank: int, world_size: int, use_nvshmem: bool):
    """Launch the op-start handshake; ``use_nvshmem`` when some table entry is 0 (needs the
    NVSHMEM runtime and :func:`compile_options`)."""
    opts = compile_options() if use_nvshmem else {}
    _ready_kernel[(1,)](pad_table, epoch, rank, world_size, USE_NVSHMEM=use_nvshmem, **opts)


# ----------------------------------------------------------------------------- host side
_LOCK = threading.RLock()
_STATE = {
    "bc_path": None,
    "runtime_ready": False,
    "epoch": 0,  # bumped at every runtime start: modules must be initialized again
    "hook": None,  # how the hook is installed: "load_chain", "load_attr", "post_compile"
    "prev_hook": None,
}
# module handle -> runtime epoch it was initialized for (-1: not yet)
_MODULES: dict[int, int] = {}
_NAMES: dict[int, str] = {}


def _install_hint() -> str:
    return (
        "install nvshmem4py for your CUDA major version: pip install nvshmem4py-cu13 "
        "(or nvshmem4py-cu12 for CUDA 12); it brings the nvidia-nvshmem wheel with "
        "libnvshmem_device.bc"
    )


def _arch() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}{minor}"
    except Exception:  # noqa: BLE001 - no device: the generic library is used
        pass
    return None


def _search_dirs() -> list[str]:
    roots = list(sys.path)
    for getter in (site.getsitepackages, lambda: [site.getusersitepackages()]):
        try:
            roots += list(getter())
        except Exception:  # noqa: BLE001 - virtualenvs may lack either
            pass
    roots.append(sysconfig.get_path("purelib"))
    dirs, seen = [], set()
    for root in roots:
        d = os.path.join(root or ".", "nvidia", "nvshmem", "lib")
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            dirs.append(d)
    return dirs


def device_library_path(refresh: bool = False) -> str:
    """Path of ``libnvshmem_device.bc`` (per-arch file first when one exists).

    Order: ``MOE_OVERLAP_NVSHMEM_BC`` (a file), ``NVSHMEM_LIB_DIR`` (a folder), nvshmem4py's
    ``find_device_bitcode_library`` (0.4+), then ``nvidia/nvshmem/lib`` under every
    ``sys.path`` / site-packages entry (the ``nvidia-nvshmem-cu12/13`` wheel layout).
    Raises FileNotFoundError with the install command when none is found.
    """
    with _LOCK:
        if _STATE["bc_path"] is not None and not refresh:
            return _STATE["bc_path"]
        path = _find_bc()
        _STATE["bc_path"] = path
        return path


def _find_bc() -> str:
    tried = []
    explicit = os.environ.get("MOE_OVERLAP_NVSHMEM_BC")
    if explicit:
        if os.path.isfile(explicit):
            return explicit
        raise FileNotFoundError(f"MOE_OVERLAP_NVSHMEM_BC={explicit!r} is not a file")
    arch = _arch()
    names = ([f"libnvshmem_device_sm_{arch}.bc"] if arch else []) + ["libnvshmem_device.bc"]
    lib_dir = os.environ.get("NVSHMEM_LIB_DIR")
    if lib_dir:
        for n in names:
            p = os.path.join(lib_dir, n)
            tried.append(p)
            if os.path.isfile(p):
                return p
        raise FileNotFoundError(f"NVSHMEM_LIB_DIR={lib_dir!r} holds none of {names}")
    try:
        from nvshmem.core import find_device_bitcode_library  # nvshmem4py >= 0.4

        p = find_device_bitcode_library()
        if p and os.path.isfile(p):
            return str(p)
    except Exception:  # noqa: BLE001 - older nvshmem4py, or no headers: search ourselves
        pass
    for d in _search_dirs():
        for n in names:
            p = os.path.join(d, n)
            tried.append(p)
            if os.path.isfile(p):
                return p
        # Per-arch files of another arch are useless; a generic one under another name is not.
        found = sorted(glob.glob(os.path.join(d, "libnvshmem_device*.bc")))
        generic = [f for f in found if "_sm_" not in os.path.basename(f)]
        if generic:
            return generic[0]
    raise FileNotFoundError(
        "NVSHMEM device library (libnvshmem_device.bc) not found"
        + (f" (tried {', '.join(tried[:6])}{' ...' if len(tried) > 6 else ''})" if tried else "")
        + f"; {_install_hint()}, or set NVSHMEM_LIB_DIR / MOE_OVERLAP_NVSHMEM_BC"
    )


def compile_options() -> dict:
    """Keyword arguments to add to a kernel launch whose code calls this module's device API:
    ``kernel[grid](..., **compile_options())``. Also installs the module-init hook."""
    install_module_init_hook()
    return {"extern_libs": {EXTERN_LIB_NAME: device_library_path()}}


# --- module init -------------------------------------------------------------------------
def _module_uses_nvshmem(module, metadata_group) -> bool:
    """True when the loaded module carries NVSHMEM's device state (it calls the device API)."""
    try:
        from cuda.bindings import driver

        err, _, _ = driver.cuModuleGetGlobal(
            driver.CUmodule(int(module)), DEVICE_STATE_SYMBOL.encode()
        )
        return err == driver.CUresult.CUDA_SUCCESS
    except Exception:  # noqa: BLE001 - no cuda-python (or an old one): read the PTX instead
        pass
    for key, path in (metadata_group or {}).items():
        if str(key).endswith(".ptx"):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    return DEVICE_STATE_SYMBOL in f.read()
            except OSError:
                return False
    return False


def _cumodule_init(module: int) -> None:
    import nvshmem.bindings as bindings

    init = getattr(bindings, "cumodule_init", None)
    if init is not None:
        status = init(int(module))
    else:  # nvshmem4py without the raw binding: the core wrapper does the same call
        import nvshmem.core as nvcore

        status = nvcore.module_init(nvcore.NvshmemKernelObject.from_handle(int(module)))
    if status not in (None, 0):
        raise RuntimeError(f"nvshmemx_cumodule_init failed with status {status}")


def _init_module(module: int) -> None:
    _cumodule_init(module)
    _MODULES[module] = _STATE["epoch"]


def _on_kernel_load(
    module, function=None, name="", metadata_group=None, hash=None, *args, **kwargs
):
    """Triton kernel-load hook: NVSHMEM module init for modules that use the device API."""
    if module is None:
        return
    module = int(module)
    with _LOCK:
        if module in _MODULES and _MODULES[module] == _STATE["epoch"] and _STATE["runtime_ready"]:
            return
        if not _module_uses_nvshmem(module, metadata_group):
            return
        _NAMES[module] = str(name)
        _MODULES.setdefault(module, -1)
        if not _STATE["runtime_ready"]:
            raise RuntimeError(
                f"Triton kernel {name!r} calls NVSHMEM device functions but no NVSHMEM runtime "
                "is up in this process: create the world first (moe_overlap.init_world('nvshmem')"
                "); the module is initialized as soon as the runtime starts"
            )
        _init_module(module)


def _on_kernel_unload(module, *args, **kwargs):
    if module is None:
        return
    with _LOCK:
        _MODULES.pop(int(module), None)
        _NAMES.pop(int(module), None)


def set_runtime_ready(ready: bool) -> None:
    """Called by the NVSHMEM world after init (True) and before finalize (False). On start,
    every NVSHMEM module loaded earlier is initialized for the new runtime."""
    with _LOCK:
        if ready:
            _STATE["epoch"] += 1
            _STATE["runtime_ready"] = True
            for module in list(_MODULES):
                _init_module(module)
        else:
            _STATE["runtime_ready"] = False


def runtime_ready() -> bool:
    return bool(_STATE["runtime_ready"])


def install_module_init_hook() -> str:
    """Install (once) the hook that initializes NVSHMEM modules; returns how it is installed.

    Triton with ``knobs.runtime.kernel_load_end_hook`` as a hook chain (3.9): added to the chain,
    so other users of the hook are kept. A plain attribute: chained by hand. Neither: the
    ``jit_post_compile_hook`` (loads the fresh kernel, then initializes it), chained by hand.
    """
    with _LOCK:
        if _STATE["hook"] is not None:
            return _STATE["hook"]
        rt = triton.knobs.runtime
        missing = object()
        chain = getattr(rt, "kernel_load_end_hook", missing)
        if chain is not missing and hasattr(chain, "add"):
            chain.add(_on_kernel_load)
            unload = getattr(rt, "kernel_unload_hook", None)
            if unload is not None and hasattr(unload, "add"):
                unload.add(_on_kernel_unload)
            _STATE["hook"] = "load_chain"
        elif chain is not missing:
            prev = chain
            _STATE["prev_hook"] = prev

            def _chained(*args, **kwargs):
                if prev is not None:
                    prev(*args, **kwargs)
                _on_kernel_load(*args, **kwargs)

            rt.kernel_load_end_hook = _chained
            _STATE["hook"] = "load_attr"
        else:
            prev = getattr(rt, "jit_post_compile_hook", None)
            _STATE["prev_hook"] = prev

            def _post_compile(*args, **kwargs):
                ret = prev(*args, **kwargs) if prev is not None else None
                fn, key = kwargs.get("fn"), kwargs.get("key")
                device = (kwargs.get("compile") or {}).get("device")
                try:
                    kernel = fn.jit_function.device_caches[device][0].get(key)
                except Exception:  # noqa: BLE001 - unknown layout: nothing to initialize
                    kernel = None
                if kernel is not None:
                    kernel.run  # noqa: B018 - property access loads the module
                    _on_kernel_load(
                        kernel.module,
                        kernel.function,
                        kernel.name,
                        getattr(kernel, "metadata_group", None),
                    )
                return ret

            rt.jit_post_compile_hook = _post_compile
            _STATE["hook"] = "post_compile"
        return _STATE["hook"]


def uninstall_module_init_hook() -> None:
    """Remove the hook (tests). Modules already initialized stay initialized."""
    with _LOCK:
        how = _STATE["hook"]
        rt = triton.knobs.runtime
        if how == "load_chain":
            rt.kernel_load_end_hook.remove(_on_kernel_load)
            unload = getattr(rt, "kernel_unload_hook", None)
            if unload is not None and hasattr(unload, "remove"):
                unload.remove(_on_kernel_unload)
        elif how == "load_attr":
            rt.kernel_load_end_hook = _STATE["prev_hook"]
        elif how == "post_compile":
            rt.jit_post_compile_hook = _STATE["prev_hook"]
        _STATE["hook"] = None
        _STATE["prev_hook"] = None
