"""The warm-up-only launch path and the concurrent-mode op sequence (GPU logic, CPU-checked).

On one GPU, emulated ranks in the concurrent mode must compile and load every kernel variant,
meet at a barrier, and only then launch kernels that wait; a warm-up must not touch flags or
epochs that an earlier op's kernels may still be waiting on. These tests pin that sequence with
fake kernels, since the interpreter cannot run concurrent ranks.
"""

import torch

from moe_overlap.kernels import launch as kl
from moe_overlap.world import ROLE_BOTH, ROLE_CONSUMER, ROLE_PRODUCER
from moe_overlap.world.emulated import EmulatedWorld, _Group


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        self.log.append("load")


class FakeKernel:
    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("launch", grid, kwargs.get("ROLE")))

        return run

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("warmup", grid, kwargs.get("ROLE")))
        return FakeCompiled(self.log)


def test_launch_runs_or_only_compiles_and_loads():
    k = FakeKernel()
    kl.launch(k, (3,), 1, ROLE=0)
    with kl.warmup_only():
        assert kl.warming_up()
        kl.launch(k, (3,), 1, ROLE=2)
    assert not kl.warming_up()
    assert k.log == [("launch", (3,), 0), ("warmup", (3,), 2), "load"]


class ConcurrentCpuWorld(EmulatedWorld):
    """An emulated world that takes the concurrent path on the CPU (fake kernels only)."""

    def __init__(self, log):
        super().__init__(_Group(1, torch.device("cpu"), "sequential", 10.0), 0)
        self.log = log

    @property
    def concurrent(self):
        return True

    def _needs_load_barrier(self):
        return not self.in_backward

    def barrier(self):
        self.log.append("barrier")

    def _inject_delay(self):
        self.log.append("delay")


def test_concurrent_op_loads_everything_then_meets_then_launches():
    log = []
    w = ConcurrentCpuWorld(log)

    def launch(role):
        log.append(("warm" if kl.warming_up() else "run", role))

    w.run_fused(launch)
    assert log == [("warm", ROLE_BOTH), "barrier", "delay", ("run", ROLE_BOTH)]
    log.clear()
    w.run_fused(launch, split=True)
    assert log == [
        ("warm", ROLE_PRODUCER),
        ("warm", ROLE_CONSUMER),
        "barrier",
        "delay",
        ("run", ROLE_PRODUCER),
        ("run", ROLE_CONSUMER),
    ]
    log.clear()
    with w.backward_scope():  # no host barrier inside a backward
        w.run_fused(launch)
    assert log == ["delay", ("run", ROLE_BOTH)]
    assert not w.in_backward


def test_warmup_leaves_flags_and_epoch_alone():
    w = EmulatedWorld(_Group(1, torch.device("cpu"), "sequential", 10.0), 0)
    flags = w.begin_op(8)  # a real op: epoch 1, flags zeroed
    flags.local.fill_(7)  # as if a peer had signalled and a kernel were still waiting
    epoch = int(w._epoch)
    with kl.warmup_only():
        again = w.begin_op(8)
        w.end_op()
    assert int(w._epoch) == epoch, "a warm-up published a ready epoch"
    assert (again.local == 7).all(), "a warm-up reset flags an earlier op still waits on"


def test_interpreter_bf16_dot_is_right():
    """The interpreter multiplies bf16 tiles as raw uint16 bits (relative error ~1e10);
    ``launch`` installs the fix that casts them to fp32 first, so bf16 runs right on the CPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(c_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    c = torch.full((16, 16), float("nan"))
    kl.launch(_dot, (1,), a, b, c, N=16)
    want = a.double() @ b.double()  # bf16 products are exact: only fp32 accumulation differs
    assert torch.allclose(c.double(), want, rtol=1e-5, atol=1e-5), (c - want).abs().max()


def test_cpu_tensors_without_the_interpreter_say_how_to_fix_it():
    """Triton's own errors there name no cause ("0 active drivers"; with the variable set
    after import, "Cannot call @triton.jit'd outside of the scope of a kernel")."""
    import os
    import subprocess
    import sys

    body = (
        "import os, torch\n"
        "import moe_overlap as mo\n"
        "{late}"
        "x = torch.randn(8, 32); ids = torch.randint(0, 4, (8, 2)); w = torch.rand(8, 2)\n"
        "w1 = torch.randn(4, 32, 32) * 0.1; w2 = torch.randn(4, 32, 16) * 0.1\n"
        "try:\n"
        "    mo.fused_experts(x, ids, w, w1, w2)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for late, tail in (("", "imported"), ("os.environ['TRITON_INTERPRET'] = '1'\n", "not then)")):
        r = subprocess.run([sys.executable, "-c", body.format(late=late)], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        out = r.stdout.strip().splitlines()
        assert out and out[-1].startswith("ERR") and "TRITON_INTERPRET=1" in out[-1], r
        assert out[-1].endswith(tail), out[-1]
