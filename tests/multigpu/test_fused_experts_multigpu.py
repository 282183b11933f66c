"""``fused_experts`` on real GPUs (one process per GPU, torch_symm world), forward and backward.

A torchrun script and a pytest test at once:

    torchrun --standalone --nproc_per_node=N tests/multigpu/test_fused_experts_multigpu.py  # N >= 1

Every rank regenerates the same GLOBAL expert weights and every rank's tokens from fixed seeds
(no broadcast needed), runs ``fused_experts`` on its own tokens with its slice of the weights
(bf16), then compares with the float64 reference over ALL ranks' tokens: its output and the
gradients of its x and topk_weights against its own part, its local weight gradients against
its slice of the global ones (which collect every rank's tokens). Uneven tokens per rank, the
last rank without tokens when N >= 3, -1 ids, static sizing, and a repeated call that must be
bitwise identical are covered. Works with one process on one GPU too; the pytest tests launch it
with one process (marked ``gpu``) and on every visible GPU (marked ``multigpu``, needs >= 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

# (tokens of rank r as a function of r and W, H, F, experts per rank, K, activation, bias)
CASES = [
    (lambda r, W: 512 + 129 * r, 1024, 1408, 2, 2, "swiglu", False),
    (lambda r, W: 0 if (W >= 3 and r == W - 1) else 300 + 77 * r, 768, 1000, 1, 1, "gelu", True),
    (lambda r, W: 256 * (r % 2) + 100, 512, 256, 4, 4, "silu", True),
]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _problem(case_i, W):
    """Global weights and every rank's inputs (CPU, bf16), identical on every rank."""
    tok_fn, H, F, El, K, act, bias = CASES[case_i]
    E = El * W
    g = _gen("fused_experts_multigpu", case_i, W)
    rows = 2 * F if act == "swiglu" else F

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    glob = dict(
        w1=rnd(E, rows, H, scale=H**-0.5),
        w2=rnd(E, H, F, scale=F**-0.5),
        b1=rnd(E, rows, scale=0.5) if bias else None,
        b2=rnd(E, H, scale=0.5) if bias else None,
    )
    ranks = []
    for r in range(W):
        T = tok_fn(r, W)
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        ids[torch.rand(T, K, generator=g) < 0.1] = -1
        ranks.append(
            dict(
                x=rnd(T, H),
                ids=ids,
                wts=(torch.rand(T, K, generator=g) + 0.1).to(torch.bfloat16),
                gy=rnd(T, H),
            )
        )
    return dict(H=H, F=F, E=E, El=El, K=K, act=act, glob=glob, ranks=ranks)


def _reference(prob, dev):
    """float64 over every rank's tokens: y per rank, grads per rank and global weight grads."""
    from moe_overlap import reference as ref

    f64 = torch.float64
    glob = {
        k: None if v is None else v.to(dev, f64).requires_grad_() for k, v in prob["glob"].items()
    }
    ys, xw, loss = [], [], torch.zeros((), dtype=f64, device=dev)
    for d in prob["ranks"]:
        x = d["x"].to(dev, f64).requires_grad_()
        w = d["wts"].to(dev, f64).requires_grad_()
        y = ref.experts(
            x, d["ids"].to(dev), w, glob["w1"], glob["w2"], prob["act"], glob["b1"], glob["b2"]
        )
        ys.append(y.detach())
        xw.append((x, w))
        loss = loss + (y * d["gy"].to(dev, f64)).sum()
    inputs = [t for p in xw for t in p] + [v for v in glob.values() if v is not None]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(inputs, grads)]
    it = iter(grads)
    rank_grads = [dict(x=next(it), topk_weights=next(it)) for _ in prob["ranks"]]
    glob_grads = {k: (None if v is None else next(it)) for k, v in glob.items()}
    return ys, rank_grads, glob_grads


def _compare(actual, expected, name, failures):
    from moe_overlap.testing import assert_close

    try:
        assert_close(actual, expected, dtype=torch.bfloat16, name=name)
    except AssertionError as e:
        failures.append(str(e))


def _main() -> int:
    import torch.distributed as dist

    import moe_overlap as mo

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    world = mo.init_world()
    W, r = world.world_size, world.rank
    failures: list[str] = []

    for ci in range(len(CASES)):
        prob = _problem(ci, W)
        tag = f"case {ci} (W={W}, rank {r})"
        El, act = prob["El"], prob["act"]
        sl = slice(r * El, (r + 1) * El)
        d = prob["ranks"][r]
        lv = dict(x=d["x"], topk_weights=d["wts"])
        lv.update({k: None if v is None else v[sl] for k, v in prob["glob"].items()})
        lv = {k: None if v is None else v.to(dev).clone().requires_grad_() for k, v in lv.items()}
        ids = d["ids"].to(dev)

        def run(max_tokens=None, lv=lv, ids=ids, act=act):
            return mo.fused_experts(
                lv["x"],
                ids,
                lv["topk_weights"],
                lv["w1"],
                lv["w2"],
                world,
                activation=act,
                b1=lv["b1"],
                b2=lv["b2"],
                max_tokens_per_rank=max_tokens,
            )

        y = run()
        (y * d["gy"].to(dev)).sum().backward()
        with torch.no_grad():
            y_again = run()
            max_t = max(len(p["x"]) for p in prob["ranks"])
            y_static = run(max_tokens=max_t + 5)
        world.check()
        if not torch.equal(y_again, y):
            failures.append(f"{tag}: a repeated call differs bitwise")
        if not torch.equal(y_static, y):
            failures.append(f"{tag}: static sizing differs from exact sizing")

        ys, rank_grads, glob_grads = _reference(prob, dev)
        _compare(y, ys[r], f"{tag}: y", failures)
        for k in ("x", "topk_weights"):
            _compare(lv[k].grad, rank_grads[r][k], f"{tag}: d{k}", failures)
        for k in ("w1", "w2", "b1", "b2"):
            if glob_grads[k] is not None:
                _compare(lv[k].grad, glob_grads[k][sl], f"{tag}: d{k}", failures)

    torch.cuda.synchronize()
    for f in failures:
        print("FAIL", f, flush=True)
    status = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(status)
    dist.barrier()
    dist.destroy_process_group()
    if r == 0:
        print(f"fused_experts multigpu: world_size {W}: {'OK' if status.item() == 0 else 'FAILED'}")
    return 0 if status.item() == 0 else 1


def _torchrun(nproc: int):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(__file__),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"torchrun failed:\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    assert "OK" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_experts_torchrun_one_process():
    _torchrun(1)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")
def test_fused_experts_torchrun_every_gpu():
    _torchrun(torch.cuda.device_count())


if __name__ == "__main__":
    sys.exit(_main())
