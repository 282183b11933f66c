"""DeepSpeed MoE on moe_overlap's fused experts: build a small model with DeepSpeed's own MoE
layers, swap them in place with ``replace_moe_layers``, check the outputs did not change, then
train a few steps under ``deepspeed.initialize``.

    # CPU (kernels in the Triton interpreter; one process, gloo):
    python examples/deepspeed_moe.py --steps 5
    # GPU, expert parallel over 2 GPUs (ep_size=2):
    deepspeed --num_gpus 2 examples/deepspeed_moe.py --ep-size 2 --hidden 1024 --ffn 2048

Install, from the repository root: pip install -e '.[deepspeed]' (on a machine without CUDA
prefix it with DS_BUILD_OPS=0 DS_ACCELERATOR=cpu).
"""

from __future__ import annotations

import argparse
import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=48)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank per step")
    p.add_argument(
        "--save-dir",
        default=None,
        help="save a DeepSpeed checkpoint there, load it into plain DeepSpeed MoE "
        "layers and compare their outputs",
    )
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the first import of moe_overlap's kernels (Triton reads it then).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # a plain `python` run: a one-process job
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )

    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    from moe_overlap.integrations.deepspeed import MoE, replace_moe_layers

    if not cuda:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory collective op on its first
        # init (minutes, and a C++ toolchain); a gloo job does not need it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    H, F = args.hidden, args.ffn

    class SwiGLU(nn.Module):  # a Llama-style expert: w2(silu(w1 x) * w3 x)
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(H, F, bias=False)
            self.w3 = nn.Linear(H, F, bias=False)
            self.w2 = nn.Linear(F, H, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(H, H)
            self.moe = nn.ModuleList(
                DeepSpeedMoE(
                    H,
                    SwiGLU(),
                    num_experts=args.experts,
                    ep_size=args.ep_size,
                    k=args.k,
                    capacity_factor=1.25,
                    min_capacity=0,
                    use_rts=False,
                    top2_2nd_expert_sampling=False,
                )
                for _ in range(2)
            )
            self.out = nn.Linear(H, H)

        def forward(self, x):
            h, aux = self.inp(x), 0.0
            for layer in self.moe:
                y, l_aux, _ = layer(h)
                h, aux = h + y, aux + l_aux
            return self.out(h), aux

    def engine_for(model):
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},
            "bf16": {"enabled": dtype == torch.bfloat16},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine

    torch.manual_seed(0)
    model = Model().to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, H, generator=g).to(device=device, dtype=dtype)
    target = torch.randn(args.tokens, H, generator=g).to(device=device, dtype=dtype)

    # Same weights, before and after the swap (ep_size 1: the DeepSpeed layers run as they are;
    # with ep_size > 1 they need deepspeed.initialize first, so compare after it instead).
    if args.ep_size == 1:
        with torch.no_grad():
            before, _ = model(x)
    n = replace_moe_layers(model)
    assert all(isinstance(m, MoE) for m in model.moe)
    if args.ep_size == 1:
        with torch.no_grad():
            after, _ = model(x)
        diff = (after - before).abs().max().item()
        if rank == 0:
            print(f"replaced {n} DeepSpeed MoE layers; max |output difference| = {diff:.2e}")

    engine = engine_for(model)
    assert engine.has_moe_layers  # DeepSpeed still sees its MoE layers
    loss_val = float("nan")
    for step in range(args.steps):
        out, aux = engine(x)
        loss = nn.functional.mse_loss(out.float(), target.float()) + 0.01 * aux
        engine.backward(loss)
        engine.step()
        loss_val = loss.item()
        if rank == 0:
            print(f"step {step}: loss {loss_val:.4f}")

    if args.save_dir:
        # DeepSpeed writes the experts to their own files; plain DeepSpeed layers load them.
        engine.save_checkpoint(args.save_dir, tag="demo")
        files = sorted(os.listdir(os.path.join(args.save_dir, "demo")))
        experts = [f for f in files if "expert" in f]
        torch.manual_seed(123)
        plain = engine_for(Model().to(device=device, dtype=dtype))
        plain.load_checkpoint(args.save_dir, tag="demo")
        engine.eval()
        plain.eval()
        with torch.no_grad():
            diff = (engine(x)[0] - plain(x)[0]).abs().max().item()
        if rank == 0:
            print(
                f"checkpoint: {len(files)} files, {len(experts)} expert files; plain DeepSpeed "
                f"layers loaded it, max |output difference| = {diff:.2e}"
            )
    return loss_val


if __name__ == "__main__":
    main()
