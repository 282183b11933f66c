"""One launch path for every kernel, with a warm-up-only mode.

Trap measured on the H200 (emulated ranks as threads, one stream each): a rank whose kernel spins
on a peer's flag while that peer's thread JIT-compiles *and loads* the same kernel variant can
deadlock: CUDA loads kernel code lazily at first launch, and a load may wait for the running
kernels to finish, which wait for the kernel being loaded. So concurrent worlds first compile and
load every variant (``warmup_only``: Triton ``warmup`` + module load, no launch), meet at a
barrier, and only then launch kernels that wait.
"""

import contextlib
import os
import threading

_state = threading.local()
_INTERP_DOT_FIXED = False


def fix_interpreter_bf16_dot() -> None:
    """Make the Triton interpreter's ``tl.dot`` right for bf16 operands (idempotent).

    The interpreter stores bf16 as raw ``uint16`` (numpy has no bf16) and its ``create_dot``
    multiplies those bit patterns as integers (Triton 3.6 and 3.9: relative error ~1e10,
    finite, no error). Casting the operands to fp32 first gives what the GPU computes: bf16
    products are exact in fp32, accumulated in fp32. Element-wise bf16 math in our kernels
    already runs in fp32 (loads are cast before arithmetic), so the dot was the one wrong op:
    ``tests/test_fused_experts.py`` and ``tests/test_tp.py`` check bf16 against float64.
    """
    global _INTERP_DOT_FIXED
    if _INTERP_DOT_FIXED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def _create_dot(self, a, b, *args):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, *args)

    builder.create_dot = _create_dot
    _INTERP_DOT_FIXED = True


@contextlib.contextmanager
def warmup_only():
    """Inside this context ``launch`` compiles and loads kernels but launches nothing."""
    prev = getattr(_state, "warm", False)
    _state.warm = True
    try:
        yield
    finally:
        _state.warm = prev


def warming_up() -> bool:
    return getattr(_state, "warm", False)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or compile + load only under ``warmup_only``."""
    if not _INTERP_DOT_FIXED and os.environ.get("TRITON_INTERPRET") == "1":
        fix_interpreter_bf16_dot()
    if warming_up():
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()  # loads the module and queries the function: no lazy load at launch
        return compiled
    try:
        return kernel[grid](*args, **kwargs)
    except Exception as e:
        hint = _cpu_without_interpreter(kernel, args, kwargs, e)
        if hint:
            raise RuntimeError(hint) from e
        raise


def _cpu_without_interpreter(kernel, args, kwargs, err) -> str | None:
    """What to say when a compiled kernel got CPU tensors, or an interpreted one called a helper
    compiled before TRITON_INTERPRET was set (Triton's own errors name no cause: "0 active
    drivers", "Cannot call @triton.jit'd outside of the scope of a kernel")."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    late = os.environ.get("TRITON_INTERPRET") == "1"
    if isinstance(kernel, InterpretedFunction) and not (late and "scope of a kernel" in str(err)):
        return None
    values = (*args, *kwargs.values())
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in values):
        return None
    return (
        "moe_overlap's Triton kernels got CPU tensors: on the CPU they run in the Triton "
        "interpreter, which Triton reads when kernels are defined, so TRITON_INTERPRET=1 must "
        "be in the environment before moe_overlap (or triton) is imported"
        + (" (it is set now, but was not then)" if late else "")
    )
