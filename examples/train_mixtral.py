"""Train a small Mixtral-style MoE decoder with expert parallelism (the README's main job).

    python examples/train_mixtral.py                 # CPU: 4 emulated EP ranks, 20 steps
    python examples/train_mixtral.py --steps 200     # a longer run: the sort loss falls far
    python examples/train_mixtral.py --resume --steps 40
    python examples/train_mixtral.py --data notes.txt --seq-len 64
    torchrun --nproc-per-node 4 examples/train_mixtral.py   # one EP rank per GPU

Writes OUT/losses.csv, OUT/loss.png (where matplotlib is installed) and OUT/checkpoint.pt
(default OUT: runs/mixtral). ``--help`` lists every flag; the recipe itself is
``moe_overlap.recipe``.
"""

import os
import sys


def _wants_cpu(argv) -> bool:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1].startswith("cpu")
        if a.startswith("--device="):
            return a.split("=", 1)[1].startswith("cpu")
    return False


if __name__ == "__main__":
    import torch

    # Triton reads TRITON_INTERPRET when the kernels are decorated, i.e. when moe_overlap is
    # imported: without CUDA the fused kernels can only run in the interpreter.
    if not torch.cuda.is_available() or _wants_cpu(sys.argv[1:]):
        os.environ["TRITON_INTERPRET"] = "1"

    from moe_overlap.recipe import main

    main()
