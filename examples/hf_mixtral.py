"""HF transformers Mixtral on moe_overlap's fused experts: a tiny randomly initialised
MixtralForCausalLM, its logits before and after ``replace_mixtral_moe``, then a few training
steps with HF's own loss (cross-entropy + router load-balancing loss).

    python examples/hf_mixtral.py            # CPU: fp32, kernels in the Triton interpreter
    python examples/hf_mixtral.py --hidden 1024 --ffn 3584 --layers 4   # GPU: bf16

With transformers 5.x the experts run through the "moe_overlap" experts implementation (the
library's own extension point); a checkpoint loads straight onto it with
``register(); MixtralForCausalLM.from_pretrained(path, experts_implementation="moe_overlap")``.
With transformers 4.x the sparse MoE blocks are switched instead. Install, from the repository
root: pip install -e '.[transformers]'.
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=48)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=12)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the first import of moe_overlap's kernels (Triton reads it then).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers

    from moe_overlap.integrations.transformers import HAS_EXPERTS_INTERFACE, replace_mixtral_moe

    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = max(1, args.hidden // 16)
    cfg = transformers.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        num_local_experts=args.experts,
        num_experts_per_tok=args.k,
        max_position_embeddings=max(64, args.seq),
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids)
    n = replace_mixtral_moe(model)
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids)
    diff = (after.logits.float() - before.logits.float()).abs().max().item()
    how = "experts implementation 'moe_overlap'" if HAS_EXPERTS_INTERFACE else "block switch"
    print(f"transformers {transformers.__version__}: {n} MoE layers on fused_experts ({how})")
    print(
        f"logits max |difference| = {diff:.2e}; loss {before.loss.item():.5f} -> "
        f"{after.loss.item():.5f}; aux loss {before.aux_loss.item():.5f} -> "
        f"{after.aux_loss.item():.5f}"
    )

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        print(f"step {step}: loss {losses[-1]:.4f} (aux {out.aux_loss.item():.4f})")
    return dict(replaced=n, logits_diff=diff, losses=losses)


if __name__ == "__main__":
    main()
