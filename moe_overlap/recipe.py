"""Mixtral-style training recipe: a small MoE decoder trained with expert parallelism
(and, with ``--tp``, tensor-parallel attention with sequence-parallel activations).

``python examples/train_mixtral.py`` (or ``moe_overlap.recipe.main(argv)``) trains a decoder of
``n_layers`` blocks ``x + attn(rmsnorm(x))`` then ``x + moe(rmsnorm(x))`` (causal self-attention
with RoPE; :class:`moe_overlap.MoELayer` with top-2 SwiGLU experts and a load-balance loss) with
AdamW on a built-in sorting (or copy) task or on a text file, then writes a loss curve and a
checkpoint.

Parallel layout (the design record of this module)
--------------------------------------------------
* **Expert parallel over the whole world.** Rank r holds experts ``[r*El, (r+1)*El)`` with
  ``El = E / W``; everything else (embedding, attention, norms, router, LM head) is replicated.
  By default attention is data parallel (:class:`Attention`, whole sequences per rank).
* **``--tp``: one world for TP, SP and EP.** Every block is a
  :class:`moe_overlap.hybrid.HybridBlock` (its docstring is the design record): ``wqkv``
  column-parallel (heads split over ranks, the sequence shard gathered in the GEMM prologue),
  ``wo`` row-parallel (reduce-scattered back to the sequence shard), then the MoE layer on the
  same ranks dispatching exactly the tokens of that shard. There is no data parallelism: every
  rank runs every micro-batch, on positions ``[r*S/W, (r+1)*S/W)``; the embedding and LM head
  stay replicated and run on those positions only, and the model is sequence-first
  ``[S/W, B, D]`` between them (one transpose each way). The router losses use expert counts
  all-reduced over the world, so each rank's ``aux`` is its share of the micro-batch's loss.
  Needs ``n_heads % W == 0`` and ``seq_len % W == 0``. Same seed, same losses as the default
  mode up to fp32 rounding (measured ~2e-8 relative at W = 2).
* **One model for every W.** :func:`init_global_weights` draws the *global* weights (experts
  ``[E, ...]``) in fp32 on the CPU from one seed, in one fixed order; each rank then copies its
  expert slice (with ``--tp`` also its ``wqkv``/``wo`` shards,
  ``moe_overlap.hybrid.shard_full_weight``) and the replicated tensors. W = 1, 2, 4 therefore
  start from bitwise the same model.
* **Fixed micro-batches.** A step consumes ``batch`` sequences drawn from one seeded CPU
  generator whatever W is. They are cut into micro-batches of ``micro_batch`` consecutive
  sequences; rank r runs micro-batches ``[r*A, (r+1)*A)`` with ``A = batch / (W*micro_batch)``
  gradient-accumulation steps. The router's load-balance (and z-) loss is a per-forward
  statistic (``E * sum_e f_e P_e`` is not additive over tokens), so the micro-batch, not the
  rank, is its unit: W changes who runs a micro-batch, never what it computes. Only float
  rounding differs between world sizes.
* **Loss scaling.** The step loss is ``CE summed over the global batch's loss tokens / N`` plus
  ``the per-micro-batch aux losses summed over layers / number of micro-batches``. Every
  micro-batch's backward uses its term *already divided by the global counts* (``N`` is known
  without communication: the built-in tasks have ``seq_len / 2`` loss tokens per sequence, text has
  ``seq_len``). Hence:

  - an expert's gradient, which the fused backward gathers from every rank's tokens, is
    exactly the unsharded model's gradient with no further scaling;
  - a replicated parameter's gradient is the **sum** over ranks (``world.all_reduce``), which
    equals the average of per-rank mean-loss gradients (the usual data-parallel average) since
    every rank holds ``batch / W`` sequences;
  - with ``--tp`` each rank backpropagates its positions' CE and its aux share (both already
    divided by the global counts): the ``wqkv``/``wo`` shards' gradients come out of the fused
    AG <-> RS backward exact, like the experts', and the replicated ones (embedding, norms,
    router, LM head: applied to this rank's positions only) are again the sum over ranks.

* **Gradient groups.** ``replicated`` (all-reduced, one flat fp32 buffer, one collective per
  step) and ``expert`` (local: every sharded tensor, i.e. the experts and, with ``--tp``, the
  attention shards). Global-norm clipping adds the replicated squares (identical on every rank
  after the reduction) to the all-reduced sharded squares, so every rank clips by the same
  factor, and that factor is W-invariant. AdamW is elementwise (``foreach=False``), so a shard
  takes exactly the update of the matching slice of the unsharded tensor.
* **Precision.** Parameters live in ``dtype`` (fp32 on CPU, bf16 on GPU by default). For a
  dtype other than fp32 the optimizer steps fp32 master copies, gradients are accumulated into
  the masters after every micro-batch, and the masters are copied back after each step. fp16
  scales the loss dynamically (``_LossScale``: a step whose gradients overflowed on any rank
  is skipped and the scale halved; the scale is checkpointed).

Data
----
Built-in tasks (``--task``), each ``[x_1..x_L, SEP, answer]`` with ``L = seq_len / 2`` tokens
uniform over ``1..vocab-1`` and ``SEP = 0``; the input is the first ``seq_len`` tokens and the
loss covers the ``L`` predictions of the answer half (the first scored position is the SEP).

* ``sort`` (default): the answer is ``sorted(x)``. Its loss starts at ``ln(vocab)`` and falls
  within the first 20 steps (the answer is non-decreasing, which the model picks up first), then
  keeps falling as attention learns to count (about 3.45 -> 2.1 in 20 steps and -> 0.6 in 300
  with the defaults, measured on the float64 twin).
* ``copy``: the answer is ``x`` itself; the loss stays near ``ln(vocab - 1)`` until an induction
  pattern forms, then falls towards 0 (a slower start).

``--data PATH`` trains on the bytes of a text file instead (vocab 256, random windows, every
position scored). The data of a step come from one CPU generator seeded with ``--seed`` and are
drawn whole on every rank, whatever W is.

Execution modes (:func:`main`)
------------------------------
* CPU: ``--world-size`` emulated ranks (threads, default 4) through
  :func:`moe_overlap.testing.spawn`; the fused kernels run in the Triton interpreter, so
  ``TRITON_INTERPRET=1`` must be set before ``moe_overlap`` is imported
  (``examples/train_mixtral.py`` does it).
* One GPU: world size 1 by default; ``--world-size > 1`` runs emulated ranks on the GPU in the
  *concurrent* mode (autograd runs every thread's CUDA backward on one worker thread, so the
  sequential mode's host barriers could never be met inside backward).
* ``torchrun --nproc-per-node N`` (CUDA): one rank per GPU through ``torch.distributed``
  (NCCL) and :func:`moe_overlap.init_world` (the torch_symm world; run here with N = 1 only).

Measured (defaults, 20 steps, loss 3.47 -> ~2.1): CPU, 4 emulated ranks, 2 cores shared with
other jobs: 4.5 min wall (2.9 min of CPU time); one H200, bf16, W = 1: 3 s of training.
``--tp`` on the CPU costs more: every rank runs every micro-batch and the AG/RS kernels run in
the interpreter too (defaults at W = 2: about 14 s a step with ``--tp``, 9 s without, the same
losses to the printed 6 decimals; the tests' tiny model, 5 steps: 22 s vs 8 s).

Traps. On the GPU, fp32 takes smaller fused-kernel blocks than bf16 (BK 32: the bf16 blocks'
pipelined fp32 tiles overflow shared memory); the defaults already do, and pinning
``MOE_OVERLAP_L0_CONFIG`` would also replace the backward dispatch GEMM's own default. Emulated
W > 1 on one GPU is verified in bf16 only; in fp32 the experts' weight-gradient fallback syncs
the host inside backward, where autograd's single CUDA worker thread serves every rank.

Checkpoint (``OUT/checkpoint.pt``): format version, step, world size, both configs, the data
generator's state, the loss history, and per rank its fp32 master weights (expert shards
included) and its optimizer state. ``--resume`` continues the same curve; it needs the world
size, model, batch and ``--tp`` settings the checkpoint was written with (checked, with a
clear error; a ``--tp`` checkpoint holds attention shards).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .config import MoEConfig
from .experts.layer import MoELayer
from .hybrid import (
    HybridBlock,
    RMSNorm,
    causal_attention,
    param_kind,
    rms_norm,
    rope_tables,
    shard_full_weight,
)
from .world import interpreted
from .world.emulated import prefer_eager_module_loading

__all__ = [
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "MixtralModel",
    "TwinModel",
    "CopyTask",
    "TextData",
    "init_global_weights",
    "train",
    "train_twin",
    "build_parser",
    "parse_args",
    "main",
]

CHECKPOINT_VERSION = 1
INIT_STD = 0.02
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------- configs
@dataclass
class ModelConfig:
    """The decoder's shape. ``ffn_size`` is one expert's F (SwiGLU: ``gate_up_proj [2F, D]``)."""

    vocab_size: int = 32
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_size: int = 32
    num_experts: int = 4
    top_k: int = 2
    seq_len: int = 32
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "ffn_size",
            "num_experts",
            "top_k",
            "seq_len",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3, got {self.vocab_size}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head dim d_model / n_heads = {self.d_model // self.n_heads} must be "
                "even (RoPE rotates pairs)"
            )
        # MoEConfig validates top_k <= num_experts and the loss coefficients.
        self.moe_config()

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            hidden_size=self.d_model,
            ffn_hidden_size=self.ffn_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            activation="swiglu",
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
        )


@dataclass
class TrainConfig:
    """One run. ``None`` fields are resolved by :meth:`resolved` from the device."""

    steps: int = 20
    lr: float = 1e-2
    seed: int = 0
    batch: int = 8  # global sequences per step, whatever the world size
    micro_batch: int = 2  # sequences per forward (the aux loss's unit)
    world_size: int | None = None  # emulated ranks: 4 on CPU, 1 on a GPU
    device: str | None = None
    dtype: str | None = None  # fp32 on CPU, bf16 on CUDA
    impl: str = "fused"
    tp: bool = False  # attention tensor-parallel + sequence-parallel (HybridBlock) over the world
    task: str = "sort"  # built-in task: "sort" or "copy"
    data: str | None = None  # a text file instead of the built-in task
    weight_decay: float = 0.01
    clip: float = 1.0  # global grad-norm clip (0: off)
    out: str = "runs/mixtral"
    resume: bool = False
    save: bool = True  # checkpoint + curve at the end
    progress: bool = True

    def resolved(self, torchrun_world: int | None = None) -> TrainConfig:
        """A copy with device, dtype and world size filled in and every rule checked."""
        c = dataclasses.replace(self)
        if c.device is None:
            c.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(c.device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {c.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {c.device!r} asked for but CUDA is not available")
        if c.dtype is None:
            c.dtype = "bf16" if dev.type == "cuda" else "fp32"
        if c.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {c.dtype!r}")
        if torchrun_world is not None:
            if c.world_size not in (None, torchrun_world):
                raise ValueError(
                    f"--world-size {c.world_size} contradicts torchrun's "
                    f"WORLD_SIZE={torchrun_world}"
                )
            c.world_size = torchrun_world
        elif c.world_size is None:
            c.world_size = 1 if dev.type == "cuda" else 4
        for name in ("steps", "batch", "micro_batch", "world_size"):
            v = getattr(c, name)
            low = 0 if name == "steps" else 1  # 0 steps: a resumed run only rewrites its outputs
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not isinstance(c.tp, bool):
            raise ValueError(f"tp must be a bool, got {c.tp!r}")
        if c.tp:
            # Every rank runs every micro-batch (on its sequence shard).
            if c.batch % c.micro_batch:
                raise ValueError(
                    f"batch ({c.batch}) must be divisible by micro_batch ({c.micro_batch})"
                )
        elif c.batch % (c.world_size * c.micro_batch):
            raise ValueError(
                f"batch ({c.batch}) must be divisible by world_size * micro_batch "
                f"({c.world_size} * {c.micro_batch})"
            )
        if c.impl not in ("fused", "baseline"):
            raise ValueError(f"impl must be 'fused' or 'baseline', got {c.impl!r}")
        if c.task not in ("sort", "copy"):
            raise ValueError(f"task must be 'sort' or 'copy', got {c.task!r}")
        if not (c.lr > 0 and math.isfinite(c.lr)):
            raise ValueError(f"lr must be a positive float, got {c.lr!r}")
        if c.weight_decay < 0 or c.clip < 0:
            raise ValueError("weight_decay and clip must be >= 0")
        return c


@dataclass
class TrainResult:
    """What a run returns (rank 0's view; every rank computes the same step losses)."""

    losses: list  # total loss per step (CE + aux), all steps so far (resume included)
    ce_losses: list
    aux_losses: list
    first_step: int  # first step this invocation ran (1-based; > 1 after a resume)
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    files: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- data
class CopyTask:
    """``[x_1..x_L, SEP, x_1..x_L]``, loss on the copied half (see the module docstring).
    Subclasses change :meth:`answer`."""

    SEP = 0

    def __init__(self, vocab_size: int, seq_len: int):
        if seq_len % 2:
            raise ValueError(f"the {type(self).__name__} needs an even seq_len, got {seq_len}")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.loss_tokens_per_seq = seq_len // 2

    def answer(self, x_nL: torch.Tensor) -> torch.Tensor:
        return x_nL

    def batch(self, gen: torch.Generator, n: int):
        """``n`` sequences -> (inputs [n, S] int64, targets [n, S] int64, mask [n, S] bool)."""
        L = self.seq_len // 2
        x = torch.randint(1, self.vocab_size, (n, L), generator=gen)
        sep = torch.full((n, 1), self.SEP, dtype=torch.int64)
        seq = torch.cat([x, sep, self.answer(x)], dim=1)  # [n, 2L + 1]
        mask = torch.zeros(n, self.seq_len, dtype=torch.bool)
        mask[:, L:] = True
        return seq[:, :-1], seq[:, 1:], mask


class SortTask(CopyTask):
    """``[x_1..x_L, SEP, sorted(x)]``, loss on the sorted half."""

    def answer(self, x_nL: torch.Tensor) -> torch.Tensor:
        return torch.sort(x_nL, dim=1).values


class TextData:
    """Byte-level windows of a text file: vocab 256, every position scored."""

    def __init__(self, path: str, seq_len: int):
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--data {path!r} is not a file")
        raw = p.read_bytes()
        if len(raw) < seq_len + 2:
            raise ValueError(
                f"--data {path!r} has {len(raw)} bytes; seq_len {seq_len} needs at "
                f"least {seq_len + 2}"
            )
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        self.vocab_size, self.seq_len = 256, seq_len
        self.loss_tokens_per_seq = seq_len

    def batch(self, gen: torch.Generator, n: int):
        S = self.seq_len
        start = torch.randint(0, self.data.numel() - S - 1, (n,), generator=gen)
        idx = start[:, None] + torch.arange(S + 1)[None, :]
        seq = self.data[idx]
        return seq[:, :-1], seq[:, 1:], torch.ones(n, S, dtype=torch.bool)


def make_data(mcfg: ModelConfig, tcfg: TrainConfig):
    if tcfg.data is None:
        task = {"copy": CopyTask, "sort": SortTask}[tcfg.task]
        return task(mcfg.vocab_size, mcfg.seq_len)
    if mcfg.vocab_size != 256:
        raise ValueError(f"--data trains on bytes: vocab_size must be 256, got {mcfg.vocab_size}")
    return TextData(tcfg.data, mcfg.seq_len)


# ----------------------------------------------------------------------------------- weights
def is_expert_param(name: str) -> bool:
    return ".experts." in name


def is_sharded_param(name: str, tp: bool = False) -> bool:
    """Experts always; the attention's ``wqkv``/``wo`` too in ``--tp`` mode."""
    kind = param_kind(name)
    return kind == "expert" or (tp and kind == "tensor")


def check_tp(mcfg: ModelConfig, world_size: int) -> None:
    """The ``--tp`` model's divisibility rules (ValueError naming the flag)."""
    W = world_size
    if mcfg.n_heads % W:
        raise ValueError(f"--tp splits heads over ranks: --heads {mcfg.n_heads} % {W} != 0")
    if mcfg.seq_len % W:
        raise ValueError(
            f"--tp splits the sequence over ranks: --seq-len {mcfg.seq_len} % {W} != 0"
        )


def init_global_weights(mcfg: ModelConfig, seed: int) -> dict:
    """Every weight of the unsharded model, fp32 on the CPU, from ``seed`` in a fixed order.

    Names are the :class:`MixtralModel` parameter names; expert weights are global:
    ``layers.i.moe.experts.gate_up_proj [E, 2F, D]`` and ``...down_proj [E, D, F]``. Output
    projections (``wo``, ``down_proj``) use std ``0.02 / sqrt(2 * n_layers)`` (GPT-2's residual
    scaling), every other matrix 0.02, norms 1.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    V, D, E, Fs, L = mcfg.vocab_size, mcfg.d_model, mcfg.num_experts, mcfg.ffn_size, mcfg.n_layers
    out_std = INIT_STD / math.sqrt(2 * L)

    def normal(shape, std=INIT_STD):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    w = {"embed.weight": normal((V, D))}
    for i in range(L):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"] = torch.ones(D)
        w[p + "attn.wqkv.weight"] = normal((3 * D, D))
        w[p + "attn.wo.weight"] = normal((D, D), out_std)
        w[p + "moe_norm.weight"] = torch.ones(D)
        w[p + "moe.router.weight"] = normal((E, D))
        w[p + "moe.experts.gate_up_proj"] = normal((E, 2 * Fs, D))
        w[p + "moe.experts.down_proj"] = normal((E, D, Fs), out_std)
    w["norm.weight"] = torch.ones(D)
    w["lm_head.weight"] = normal((V, D))
    return w


# ----------------------------------------------------------------------------------- math
def ce_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, mask_BS: torch.Tensor):
    """Cross-entropy summed over the masked positions, in fp32 (float64 stays float64)."""
    cd = torch.float64 if logits_BSV.dtype == torch.float64 else torch.float32
    ce = F.cross_entropy(logits_BSV.to(cd).flatten(0, 1), targets_BS.flatten(), reduction="none")
    return (ce * mask_BS.flatten().to(cd)).sum()


# ----------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Replicated (data-parallel) causal attention: ``wqkv [3D, D]`` (q, k, v rows), ``wo
    [D, D]``. ``--tp`` uses ``moe_overlap.hybrid.TensorParallelAttention`` instead (inside a
    ``HybridBlock``), with the same parameter names and the full weights sharded."""

    def __init__(self, mcfg: ModelConfig, dtype, device):
        super().__init__()
        D = mcfg.d_model
        self.n_heads = mcfg.n_heads
        self.wqkv = nn.Linear(D, 3 * D, bias=False, dtype=dtype, device=device)
        self.wo = nn.Linear(D, D, bias=False, dtype=dtype, device=device)

    def forward(self, x_BSD, cos, sin):
        return causal_attention(x_BSD, self.wqkv.weight, self.wo.weight, self.n_heads, cos, sin)


class Block(nn.Module):
    def __init__(self, mcfg: ModelConfig, world, dtype, device, impl):
        super().__init__()
        self.attn_norm = RMSNorm(mcfg.d_model, mcfg.norm_eps, dtype, device)
        self.attn = Attention(mcfg, dtype, device)
        self.moe_norm = RMSNorm(mcfg.d_model, mcfg.norm_eps, dtype, device)
        # The layer's own init is overwritten by load_global: a private generator keeps it from
        # consuming the process's default RNG.
        gen = torch.Generator(device=device)
        self.moe = MoELayer(
            mcfg.moe_config(), world=world, dtype=dtype, device=device, impl=impl, generator=gen
        )

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.moe(self.moe_norm(x))
        return x, self.moe.aux_loss


class MixtralModel(nn.Module):
    """The recipe's decoder on one rank of ``world``.

    ``forward(tokens [B, S] int64) -> (logits [B, S_local, V] in dtype, aux scalar fp32)``.

    * default (``tp=False``): expert parallel only; every rank runs whole sequences, logits
      cover all S positions and ``aux`` is the sum over layers of ``MoELayer.aux_loss`` for
      these B sequences.
    * ``tp=True``: every block is a :class:`moe_overlap.hybrid.HybridBlock` on ``world``
      (attention tensor parallel, activations sequence parallel, experts over the same ranks).
      Rank r embeds and scores only positions :meth:`local_positions` (``[r*S/W, (r+1)*S/W)``),
      the blocks run sequence-first ``[S/W, B, D]`` (one transpose after the embedding, one
      before the head), and ``aux`` is this rank's share of the layers' router losses over
      the B sequences (summed over ranks: the default mode's ``aux`` for the same sequences).
    """

    def __init__(
        self,
        mcfg: ModelConfig,
        world,
        dtype=torch.float32,
        device=None,
        impl: str = "fused",
        tp: bool = False,
    ):
        super().__init__()
        device = torch.device(device) if device is not None else world.device
        self.mcfg, self.world, self.tp = mcfg, world, bool(tp)
        if self.tp:
            check_tp(mcfg, world.world_size)
        V, D = mcfg.vocab_size, mcfg.d_model
        self.embed = nn.Embedding(V, D, dtype=dtype, device=device)
        if self.tp:
            blocks = (
                HybridBlock(
                    mcfg.moe_config(),
                    mcfg.n_heads,
                    world,
                    rope_theta=mcfg.rope_theta,
                    norm_eps=mcfg.norm_eps,
                    dtype=dtype,
                    device=device,
                    impl=impl,
                )
                for _ in range(mcfg.n_layers)
            )
        else:
            blocks = (Block(mcfg, world, dtype, device, impl) for _ in range(mcfg.n_layers))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(D, mcfg.norm_eps, dtype, device)
        self.lm_head = nn.Linear(D, V, bias=False, dtype=dtype, device=device)
        cos, sin = rope_tables(mcfg.seq_len, D // mcfg.n_heads, mcfg.rope_theta, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def is_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` is this rank's shard (exact local gradient) rather than a
        replicated tensor (gradient summed over ranks)."""
        return is_sharded_param(name, self.tp)

    def local_positions(self, seq_len: int) -> slice:
        """The sequence positions whose logits this rank returns."""
        if not self.tp:
            return slice(0, seq_len)
        s = seq_len // self.world.world_size
        return slice(self.world.rank * s, (self.world.rank + 1) * s)

    @torch.no_grad()
    def load_global(self, weights: dict) -> None:
        """Copy the global weights (:func:`init_global_weights` names): this rank's expert
        slice, its attention shards with ``tp`` (``moe_overlap.hybrid.shard_full_weight``),
        every other tensor whole."""
        params = dict(self.named_parameters())
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"global weights lack {sorted(missing)}")
        rank, W = self.world.rank, self.world.world_size
        for name, prm in params.items():
            src = weights[name]
            if self.is_sharded(name):
                src = shard_full_weight(name, src, self.mcfg.n_heads, rank, W)
            if tuple(src.shape) != tuple(prm.shape):
                raise ValueError(
                    f"{name}: global weight gives {tuple(src.shape)}, the model "
                    f"holds {tuple(prm.shape)}"
                )
            prm.copy_(src)

    def forward(self, tokens_BS: torch.Tensor):
        S = tokens_BS.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        if self.tp and S % self.world.world_size:
            raise ValueError(
                f"--tp splits the sequence over ranks: length {S} is not a multiple of the "
                f"world size {self.world.world_size}"
            )
        h = self.embed(tokens_BS[:, self.local_positions(S)])
        aux = torch.zeros((), dtype=torch.float32, device=h.device)
        if not self.tp:
            for blk in self.layers:
                h, a = blk(h, cos, sin)
                aux = aux + a.float()
            return self.lm_head(self.norm(h)), aux
        h = h.transpose(0, 1).contiguous()  # [S/W, B, D]: sequence first for the TP ops
        for blk in self.layers:
            h = blk(h, cos, sin)
            aux = aux + blk.aux_loss.float()
        return self.lm_head(self.norm(h)).transpose(0, 1), aux


# ----------------------------------------------------------------------------------- twin
class TwinModel:
    """Single-process pure-torch twin of :class:`MixtralModel` (tests).

    Global weights (experts ``[E, ...]``) as leaf tensors in ``dtype`` (float64 by default); the
    MoE is :func:`moe_overlap.reference.moe_layer`, no world and no Triton.
    """

    def __init__(self, mcfg: ModelConfig, weights: dict, dtype=torch.float64):
        self.mcfg, self.dtype = mcfg, dtype
        self.params = {
            k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in weights.items()
        }
        self.moe_cfg = mcfg.moe_config()
        self.cos, self.sin = rope_tables(
            mcfg.seq_len, mcfg.d_model // mcfg.n_heads, mcfg.rope_theta, dtype, "cpu"
        )

    @classmethod
    def from_seed(cls, mcfg: ModelConfig, seed: int, dtype=torch.float64) -> TwinModel:
        return cls(mcfg, init_global_weights(mcfg, seed), dtype)

    def forward(self, tokens_BS: torch.Tensor):
        """``tokens [B, S]`` -> (logits [B, S, V], aux = sum over layers of the aux loss)."""
        p, m = self.params, self.mcfg
        S = tokens_BS.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        h = p["embed.weight"][tokens_BS]
        aux = torch.zeros((), dtype=self.dtype)
        for i in range(m.n_layers):
            q = f"layers.{i}."
            a = rms_norm(h, p[q + "attn_norm.weight"], m.norm_eps)
            h = h + causal_attention(
                a, p[q + "attn.wqkv.weight"], p[q + "attn.wo.weight"], m.n_heads, cos, sin
            )
            a = rms_norm(h, p[q + "moe_norm.weight"], m.norm_eps)
            y, aux_i = reference.moe_layer(
                a,
                p[q + "moe.router.weight"],
                p[q + "moe.experts.gate_up_proj"],
                p[q + "moe.experts.down_proj"],
                self.moe_cfg,
            )
            h = h + y
            aux = aux + aux_i
        logits = F.linear(rms_norm(h, p["norm.weight"], m.norm_eps), p["lm_head.weight"])
        return logits, aux


def _param_groups(named, weight_decay):
    """AdamW groups: matrices (dim >= 2, experts included) decay, norms do not."""
    decay = [t for _, t in named if t.dim() >= 2]
    other = [t for _, t in named if t.dim() < 2]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=other, weight_decay=0.0)]


def _adamw(groups, lr):
    # foreach=False: one elementwise update per tensor, so a sharded expert tensor gets the
    # same update as the matching rows of the unsharded one (no cross-tensor fusion choices).
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def train_twin(mcfg: ModelConfig, tcfg: TrainConfig, dtype=torch.float64) -> TrainResult:
    """Train the twin for ``tcfg.steps`` steps with the recipe's data, batching, loss and
    optimizer; returns the step losses (no files written)."""
    twin = TwinModel.from_seed(mcfg, tcfg.seed, dtype)
    data = make_data(mcfg, tcfg)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(tcfg.seed))
    named = list(twin.params.items())
    opt = _adamw(_param_groups(named, tcfg.weight_decay), tcfg.lr)
    n_tok = tcfg.batch * data.loss_tokens_per_seq
    n_micro = tcfg.batch // tcfg.micro_batch
    res = TrainResult([], [], [], first_step=1)
    for _ in range(tcfg.steps):
        inputs, targets, mask = data.batch(gen, tcfg.batch)
        ce_tot = aux_tot = 0.0
        for mb in range(n_micro):
            sl = slice(mb * tcfg.micro_batch, (mb + 1) * tcfg.micro_batch)
            logits, aux = twin.forward(inputs[sl])
            ce = ce_sum(logits, targets[sl], mask[sl])
            (ce / n_tok + aux / n_micro).backward()
            ce_tot += ce.item() / n_tok
            aux_tot += aux.item() / n_micro
        if tcfg.clip > 0:
            torch.nn.utils.clip_grad_norm_([t for _, t in named], tcfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        res.losses.append(ce_tot + aux_tot)
        res.ce_losses.append(ce_tot)
        res.aux_losses.append(aux_tot)
    return res


# ----------------------------------------------------------------------------------- training
class _ThreadGather:
    """Gather a Python object to rank 0 among emulated ranks (threads of one process)."""

    def __init__(self, world_size):
        self.slots = [None] * world_size

    def __call__(self, world, obj):
        self.slots[world.rank] = obj
        world.barrier()
        out = list(self.slots) if world.rank == 0 else None
        world.barrier()
        return out


def _dist_gather(world, obj):
    import torch.distributed as dist

    out = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class _Progress:
    """tqdm when installed, else one printed line per step (rank 0 only)."""

    def __init__(self, total, initial, enabled):
        self.bar = None
        self.enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step, total, loss, ce, tps):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", ce=f"{ce:.4f}", tok_s=f"{tps:.0f}")
            self.bar.update(1)
        else:
            print(
                f"step {step}/{total}  loss {loss:.4f}  ce {ce:.4f}  {tps:.0f} tokens/s", flush=True
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


class _LossScale:
    """Dynamic loss scaling for fp16 (bf16 and fp32 need none): the loss is multiplied by
    ``scale`` before the backward so small gradients survive fp16's range, and the fp32
    master gradients are divided by it; a step whose gradients overflowed on any rank is
    skipped and the scale halved, and after ``GROWTH_INTERVAL`` clean steps it doubles (the
    policy of ``torch.amp.GradScaler``)."""

    INIT = 2.0**16
    GROWTH_INTERVAL = 200

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.scale = self.INIT if enabled else 1.0
        self.good = self.skipped = 0

    def state_dict(self) -> dict:
        return dict(scale=self.scale, good=self.good, skipped=self.skipped)

    def load_state_dict(self, state: dict | None) -> None:
        if state and self.enabled:
            self.scale, self.good, self.skipped = state["scale"], state["good"], state["skipped"]

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; True if the optimizer may step."""
        if not finite:
            self.scale /= 2
            self.good = 0
            self.skipped += 1
            return False
        self.good += 1
        if self.good % self.GROWTH_INTERVAL == 0:
            self.scale *= 2
        return True


def _check_resume(ckpt, mcfg, tcfg):
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint version {ckpt.get('version')} is not {CHECKPOINT_VERSION}")
    if ckpt["world_size"] != tcfg.world_size:
        raise ValueError(
            f"the checkpoint was written by {ckpt['world_size']} ranks; resume with "
            f"--world-size {ckpt['world_size']} (got {tcfg.world_size})"
        )
    if ckpt["model_config"] != dataclasses.asdict(mcfg):
        now = dataclasses.asdict(mcfg)
        diff = ", ".join(
            f"{k} {now.get(k)!r} (checkpoint: {v!r})"
            for k, v in ckpt["model_config"].items()
            if now.get(k) != v
        )
        raise ValueError(f"model flags differ from the checkpoint's: {diff}")
    for k in ("batch", "micro_batch", "task", "data", "seed"):
        if ckpt["train_config"][k] != getattr(tcfg, k):
            raise ValueError(
                f"--{k.replace('_', '-')} {getattr(tcfg, k)!r} differs from the "
                f"checkpoint's {ckpt['train_config'][k]!r}"
            )
    # --tp shards the attention weights: its checkpoint holds other shapes.
    if bool(ckpt["train_config"].get("tp", False)) != tcfg.tp:
        how = "with" if ckpt["train_config"].get("tp", False) else "without"
        raise ValueError(f"the checkpoint was written {how} --tp; resume {how} it")


def _train_rank(world, mcfg: ModelConfig, tcfg: TrainConfig, gather, ckpt):
    """The training loop of one rank (every rank runs it in lockstep)."""
    rank, W = world.rank, world.world_size
    dev = world.device
    dtype = _DTYPES[tcfg.dtype]
    data = make_data(mcfg, tcfg)
    model = MixtralModel(mcfg, world, dtype=dtype, device=dev, impl=tcfg.impl, tp=tcfg.tp)
    model.load_global(init_global_weights(mcfg, tcfg.seed))
    named = list(model.named_parameters())
    if dtype == torch.float32:
        masters = [(n, p) for n, p in named]
    else:
        masters = [(n, p.detach().float().clone().requires_grad_(True)) for n, p in named]
    opt = _adamw(_param_groups(masters, tcfg.weight_decay), tcfg.lr)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(tcfg.seed))
    hist = dict(losses=[], ce=[], aux=[])
    start = 0
    scaler = _LossScale(dtype == torch.float16)
    if ckpt is not None:
        state = ckpt["ranks"][rank]
        scaler.load_state_dict(state.get("loss_scale"))
        with torch.no_grad():
            for (n, m), (_, p) in zip(masters, named):
                m.copy_(state["model"][n])
                if m is not p:
                    p.copy_(m)
        # load_state_dict restores the saved lr / weight decay: this run's flags win (the
        # checkpoint it writes records them), so --resume --lr X means X.
        flags = [{k: g[k] for k in ("lr", "weight_decay")} for g in opt.param_groups]
        opt.load_state_dict(state["optim"])
        for g, f in zip(opt.param_groups, flags):
            g.update(f)
        gen.set_state(ckpt["data_rng"])
        hist = {k: list(v) for k, v in ckpt["history"].items()}
        start = ckpt["step"]

    mb = tcfg.micro_batch
    # Default: rank r runs its own batch / W sequences. --tp: every rank runs every micro-batch
    # on its sequence shard (the world is one tensor/sequence-parallel group, no data parallel).
    per_rank = tcfg.batch if tcfg.tp else tcfg.batch // W
    first = 0 if tcfg.tp else rank * per_rank
    accum = per_rank // mb
    n_tok = tcfg.batch * data.loss_tokens_per_seq
    n_micro = tcfg.batch // mb
    pos = model.local_positions(mcfg.seq_len)
    # "expert" holds every sharded tensor (exact local gradient): experts, and with --tp the
    # attention's wqkv/wo shards. "replicated" gradients are summed over ranks.
    repl = [i for i, (n, _) in enumerate(masters) if not model.is_sharded(n)]
    expert = [i for i, (n, _) in enumerate(masters) if model.is_sharded(n)]
    show = rank == 0 and tcfg.progress
    bar = _Progress(tcfg.steps, start, show)
    tokens_per_step = tcfg.batch * mcfg.seq_len
    t_run = time.perf_counter()
    tps = 0.0
    for step in range(start + 1, tcfg.steps + 1):
        t0 = time.perf_counter()
        inputs, targets, mask = data.batch(gen, tcfg.batch)  # the global batch, on every rank
        stats = torch.zeros(2, dtype=torch.float64, device=dev)
        for a in range(accum):
            lo = first + a * mb
            tok = inputs[lo : lo + mb].to(dev)
            tgt, msk = (t[lo : lo + mb, pos].to(dev) for t in (targets, mask))
            logits, aux = model(tok)
            ce = ce_sum(logits, tgt, msk)
            loss = ce / n_tok + aux / n_micro
            (loss * scaler.scale if scaler.enabled else loss).backward()
            stats[0] += ce.detach().double() / n_tok
            stats[1] += aux.detach().double() / n_micro
            if dtype != torch.float32:  # accumulate in the fp32 masters
                for (_, m), (_, p) in zip(masters, named):
                    g = p.grad.float()
                    if scaler.enabled:
                        g.div_(scaler.scale)
                    m.grad = g if m.grad is None else m.grad.add_(g)
                    p.grad = None
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for _, m in masters]
        if W > 1:
            world.all_reduce(stats)
            flat = torch.cat([grads[i].reshape(-1) for i in repl])
            world.all_reduce(flat)
            off = 0
            for i in repl:
                n = grads[i].numel()
                grads[i].copy_(flat[off : off + n].view_as(grads[i]))
                off += n
        step_ok = True
        if scaler.enabled:  # one verdict for all ranks: expert gradients differ per rank
            bad = torch.zeros((), dtype=torch.float32, device=dev)
            for g in grads:
                bad += (~torch.isfinite(g)).any().float()
            if W > 1:
                world.all_reduce(bad)
            step_ok = scaler.update(float(bad) == 0)
            if not step_ok and show:
                print(
                    f"step {step}: fp16 gradients overflowed: step skipped, loss scale now "
                    f"{scaler.scale:g}",
                    flush=True,
                )
        if tcfg.clip > 0 and step_ok:
            sq_e = torch.zeros((), dtype=torch.float32, device=dev)
            for i in expert:
                sq_e = sq_e + grads[i].float().pow(2).sum()
            if W > 1:
                world.all_reduce(sq_e)
            sq_r = sum(grads[i].float().pow(2).sum() for i in repl)
            norm = torch.sqrt(sq_r + sq_e)
            coef = torch.clamp(tcfg.clip / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for (_, m), g in zip(masters, grads):
            m.grad = g
        if step_ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for (_, m), (_, p) in zip(masters, named):
                    p.copy_(m)
        else:
            model.zero_grad(set_to_none=True)
        ce_v, aux_v = stats.tolist()
        hist["losses"].append(ce_v + aux_v)
        hist["ce"].append(ce_v)
        hist["aux"].append(aux_v)
        dt = time.perf_counter() - t0
        tps = tokens_per_step / dt if dt > 0 else 0.0
        bar.update(step, tcfg.steps, ce_v + aux_v, ce_v, tps)
    bar.close()
    wall = time.perf_counter() - t_run
    ran = tcfg.steps - start
    state = dict(
        model={n: m.detach().cpu().clone() for n, m in masters},
        optim=opt.state_dict(),
        loss_scale=scaler.state_dict(),
    )
    states = gather(world, state) if tcfg.save else None
    if rank != 0:
        return None
    res = TrainResult(
        hist["losses"],
        hist["ce"],
        hist["aux"],
        first_step=start + 1,
        tokens_per_s=tokens_per_step * ran / wall if ran and wall > 0 else 0.0,
        wall_s=wall,
    )
    if tcfg.save:
        res.files = _write_outputs(tcfg, mcfg, states, gen, hist, W)
    return res


def _write_outputs(tcfg, mcfg, states, gen, hist, W) -> dict:
    out = Path(tcfg.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    ckpt = dict(
        version=CHECKPOINT_VERSION,
        step=len(hist["losses"]),
        world_size=W,
        model_config=dataclasses.asdict(mcfg),
        train_config=dataclasses.asdict(tcfg),
        data_rng=gen.get_state(),
        history=hist,
        ranks=states,
    )
    path = out / "checkpoint.pt"
    tmp = out / "checkpoint.pt.tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind
    files["checkpoint"] = str(path)
    csv_path = out / "losses.csv"
    with open(csv_path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["step", "loss", "ce", "aux"])
        for i, (lo, ce, ax) in enumerate(zip(hist["losses"], hist["ce"], hist["aux"]), 1):
            wr.writerow([i, f"{lo:.6f}", f"{ce:.6f}", f"{ax:.6f}"])
    files["csv"] = str(csv_path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        plt = None
        print(
            "matplotlib is not installed: no loss-curve PNG (pip install matplotlib); "
            f"the losses are in {csv_path}"
        )
    if plt is not None:
        steps = range(1, len(hist["losses"]) + 1)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, hist["losses"], label="loss (CE + aux)")
        ax.plot(steps, hist["ce"], label="CE", linestyle="--")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        task = f"{tcfg.task} task" if tcfg.data is None else Path(tcfg.data).name
        par = "TP+SP+EP" if tcfg.tp else "EP"
        ax.set_title(f"Mixtral-style MoE, {task}, {par} world {W}")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        png = out / "loss.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        files["png"] = str(png)
    return files


def _load_checkpoint(tcfg, mcfg):
    path = Path(tcfg.out) / "checkpoint.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    _check_resume(ckpt, mcfg, tcfg)
    return ckpt


def _check_model_world(mcfg: ModelConfig, tcfg: TrainConfig):
    if mcfg.num_experts % tcfg.world_size:
        raise ValueError(
            f"num_experts ({mcfg.num_experts}) must be divisible by the world size "
            f"({tcfg.world_size})"
        )
    if tcfg.tp:
        check_tp(mcfg, tcfg.world_size)


def _check_mode(tcfg: TrainConfig):
    dev = torch.device(tcfg.device)
    if tcfg.impl == "fused" and dev.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the fused kernels run on the CPU only in the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing moe_overlap "
            "(examples/train_mixtral.py does it when CUDA is absent)"
        )
    if dev.type == "cuda" and interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 is set but the device is CUDA: unset it")


def train(mcfg: ModelConfig, tcfg: TrainConfig) -> TrainResult:
    """Run the recipe in this process: emulated ranks (CPU, or one GPU), see :func:`main` for
    torchrun. Returns rank 0's :class:`TrainResult`."""
    from .testing import spawn

    tcfg = tcfg.resolved()
    _check_model_world(mcfg, tcfg)
    _check_mode(tcfg)
    make_data(mcfg, tcfg)  # bad --data fails here, before any rank starts
    ckpt = _load_checkpoint(tcfg, mcfg) if tcfg.resume else None
    dev = torch.device(tcfg.device)
    W = tcfg.world_size
    mode = "concurrent" if dev.type == "cuda" and W > 1 else "sequential"
    gather = _ThreadGather(W)
    # A barrier wait is bounded by 10 minutes (a peer that hangs is found); the whole run by a
    # day. A rank that fails still aborts its peers at once.
    res = spawn(
        W,
        _train_rank,
        mcfg,
        tcfg,
        gather,
        ckpt,
        device=dev,
        mode=mode,
        timeout=600.0,
        join_timeout=86400.0,
        seed=tcfg.seed,
    )
    return res[0]


def _train_torchrun(mcfg: ModelConfig, tcfg: TrainConfig) -> TrainResult | None:
    """One rank per GPU under torchrun: NCCL + ``init_world()`` (torch_symm world)."""
    import torch.distributed as dist

    from .world import init_world

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    tcfg = dataclasses.replace(tcfg, device=f"cuda:{local}")
    tcfg = tcfg.resolved(torchrun_world=int(os.environ["WORLD_SIZE"]))
    _check_model_world(mcfg, tcfg)
    _check_mode(tcfg)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        world = init_world(seed=tcfg.seed)
        ckpt = _load_checkpoint(tcfg, mcfg) if tcfg.resume else None
        if world.rank == 0:
            _banner(mcfg, tcfg, "torchrun")
        else:
            tcfg = dataclasses.replace(tcfg, progress=False)
        res = _train_rank(world, mcfg, tcfg, _dist_gather, ckpt)
        dist.barrier()  # rank 0 has written the checkpoint before anyone leaves
        return res
    finally:
        # A failed rank skips the barrier: torchrun then stops its peers.
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    m, t = ModelConfig(), TrainConfig()
    p = argparse.ArgumentParser(
        prog="train_mixtral",
        description="Train a small Mixtral-style MoE decoder with expert parallelism "
        "(moe_overlap fused kernels). CPU: emulated ranks in the Triton interpreter; one GPU: "
        "the GPU; torchrun: one rank per GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--steps",
        type=int,
        default=t.steps,
        help="total steps (a resumed run continues up to this many)",
    )
    g.add_argument("--lr", type=float, default=t.lr, help="AdamW learning rate (constant)")
    g.add_argument("--seed", type=int, default=t.seed, help="weights and data")
    g.add_argument("--batch", type=int, default=t.batch, help="global sequences per step")
    g.add_argument(
        "--micro-batch",
        type=int,
        default=t.micro_batch,
        help="sequences per forward (the aux loss's unit)",
    )
    g.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="emulated expert-parallel ranks (default 4 on CPU, 1 on a GPU)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="parameter dtype (default fp32 on CPU, bf16 on CUDA)",
    )
    g.add_argument(
        "--impl",
        choices=("fused", "baseline"),
        default=t.impl,
        help="MoE experts: the fused kernels or the all_to_all + grouped_mm baseline",
    )
    g.add_argument(
        "--tp",
        action="store_true",
        help="tensor-parallel attention + sequence parallelism over the same ranks as the "
        "experts (moe_overlap.hybrid.HybridBlock); needs heads and seq-len divisible by the "
        "world size",
    )
    g.add_argument("--task", choices=("sort", "copy"), default=t.task, help="built-in task")
    g.add_argument(
        "--data",
        default=None,
        help="a text file (bytes, vocab 256) instead of the built-in task",
    )
    g.add_argument(
        "--weight-decay", type=float, default=t.weight_decay, help="AdamW decay (not on norms)"
    )
    g.add_argument("--clip", type=float, default=t.clip, help="grad-norm clip (0: off)")
    g.add_argument("--out", default=t.out, help="output folder")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("model")
    g.add_argument(
        "--vocab-size", type=int, default=None, help=f"default {m.vocab_size} (256 with --data)"
    )
    g.add_argument("--d-model", type=int, default=m.d_model, help="hidden size H")
    g.add_argument("--layers", type=int, default=m.n_layers, help="decoder blocks")
    g.add_argument("--heads", type=int, default=m.n_heads, help="attention heads")
    g.add_argument("--ffn", type=int, default=m.ffn_size, help="per-expert FFN size")
    g.add_argument("--experts", type=int, default=m.num_experts, help="experts per MoE block")
    g.add_argument("--top-k", type=int, default=m.top_k, help="experts per token")
    g.add_argument("--seq-len", type=int, default=m.seq_len, help="tokens per sequence")
    g.add_argument(
        "--aux-loss-coef", type=float, default=m.aux_loss_coef, help="load-balance loss weight"
    )
    g.add_argument("--z-loss-coef", type=float, default=m.z_loss_coef, help="router z-loss weight")
    return p


def parse_args(argv=None) -> tuple[ModelConfig, TrainConfig]:
    a = build_parser().parse_args(argv)
    vocab = a.vocab_size if a.vocab_size is not None else (256 if a.data else 32)
    mcfg = ModelConfig(
        vocab_size=vocab,
        d_model=a.d_model,
        n_layers=a.layers,
        n_heads=a.heads,
        ffn_size=a.ffn,
        num_experts=a.experts,
        top_k=a.top_k,
        seq_len=a.seq_len,
        aux_loss_coef=a.aux_loss_coef,
        z_loss_coef=a.z_loss_coef,
    )
    tcfg = TrainConfig(
        steps=a.steps,
        lr=a.lr,
        seed=a.seed,
        batch=a.batch,
        micro_batch=a.micro_batch,
        world_size=a.world_size,
        device=a.device,
        dtype=a.dtype,
        impl=a.impl,
        tp=a.tp,
        task=a.task,
        data=a.data,
        weight_decay=a.weight_decay,
        clip=a.clip,
        out=a.out,
        resume=a.resume,
        progress=not a.no_progress,
    )
    return mcfg, tcfg


def _banner(mcfg: ModelConfig, r: TrainConfig, how: str) -> None:
    task = f"{r.task} task" if r.data is None else r.data
    print(
        f"moe_overlap recipe: {r.world_size} {'TP+SP+EP' if r.tp else 'EP'} rank(s) ({how}) on "
        f"{r.device} ({r.dtype}), "
        f"{mcfg.n_layers} layers, d_model {mcfg.d_model}, {mcfg.num_experts} experts "
        f"top-{mcfg.top_k}, {r.batch} x {mcfg.seq_len} tokens/step, {task}",
        flush=True,
    )


def _torchrun_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _under_torchrun() -> bool:
    # torchrun sets these for every worker (one process per GPU); a plain run sets neither.
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv=None) -> TrainResult | None:
    """CLI entry point (``examples/train_mixtral.py``)."""
    try:
        mcfg, tcfg = parse_args(argv)
        if (tcfg.world_size or 1) > 1 and not _under_torchrun():
            prefer_eager_module_loading(warn=False)  # before CUDA starts: world/emulated.py
        if _under_torchrun() and torch.cuda.is_available():
            res = _train_torchrun(mcfg, tcfg)
        elif _torchrun_world() > 1:
            raise RuntimeError(
                f"WORLD_SIZE={_torchrun_world()} (torchrun) needs CUDA GPUs; for emulated ranks "
                "on the CPU run without torchrun and pass --world-size"
            )
        else:
            _banner(mcfg, tcfg.resolved(), "emulated")
            res = train(mcfg, tcfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    if res is not None and res.losses:
        ran = res.losses[res.first_step - 1 :]
        if ran:
            print(
                f"steps {res.first_step}..{len(res.losses)}: loss {ran[0]:.4f} -> "
                f"{ran[-1]:.4f}; {res.tokens_per_s:.0f} tokens/s, {res.wall_s:.1f} s"
            )
    if res is not None:
        for kind, path in res.files.items():
            print(f"wrote {kind}: {path}")
    return res
