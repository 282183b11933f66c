"""One launch path for every kernel, with a warm-up-only mode.

Trap measured on the H200 (emulated ranks as threads, one stream each): a rank whose kernel spins
on a peer's flag while that peer's thread JIT-compiles *and loads* the same kernel variant can
deadlock: CUDA loads kernel code lazily at first launch, and a load may wait for the running
kernels to finish, which wait for the kernel being loaded. So concurrent worlds first compile and
load every variant (``warmup_only``: Triton ``warmup`` + module load, no launch), meet at a
barrier, and only then launch kernels that wait.
"""

import contextlib
import threading

_state = threading.local()


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
    if warming_up():
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()  # loads the module and queries the function: no lazy load at launch
        return compiled
    return kernel[grid](*args, **kwargs)
