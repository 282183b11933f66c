"""``MoELayer``: router + fused experts (+ shared experts), and the ``GroupedExperts`` params.

>>> import torch, moe_overlap as mo
>>> cfg = mo.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
>>> layer = mo.MoELayer(cfg)                       # single-rank world
>>> y = layer(torch.randn(2, 3, 16))
>>> y.shape, layer.expert_counts.shape
(torch.Size([2, 3, 16]), torch.Size([4]))

Parameters use the HF transformers v5 layout: ``experts.gate_up_proj [El, 2F, H]`` (gate rows
first, up rows second; ``[El, F, H]`` for the plain activations) and ``experts.down_proj
[El, H, F]``; the global id of local expert i is ``world.rank * El + i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import nn

from ..config import MoEConfig, w1_rows
from ..dispatch.baseline import baseline_experts
from ..dispatch.router import Router
from .fused import fused_experts

INIT_STD = 0.02


def _act(v, activation):
    if activation == "gelu":
        return Fn.gelu(v)
    if activation == "relu":
        return torch.relu(v)
    return Fn.silu(v)


IMPLS = ("fused", "baseline")  # fused kernels, or all-to-all + grouped_mm (the baseline)


class GroupedExperts(nn.Module):
    """The El experts of this rank as two stacked weights (optionally with biases)."""

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        bias: bool = False,
        dtype=None,
        device=None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        El, H, F = num_local_experts, hidden_size, ffn_hidden_size
        rows = w1_rows(activation, F)
        kw = dict(dtype=dtype or torch.float32, device=device)
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(El, rows, H, **kw))
        self.down_proj = nn.Parameter(torch.empty(El, H, F, **kw))
        self.gate_up_bias = nn.Parameter(torch.zeros(El, rows, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(El, H, **kw)) if bias else None
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None):
        dev = generator.device if generator is not None else torch.device("cpu")
        for p in (self.gate_up_proj, self.down_proj):
            v = torch.randn(p.shape, generator=generator, dtype=torch.float32, device=dev)
            p.copy_(v * INIT_STD)

    @torch.no_grad()
    def load_global(self, gate_up_global: torch.Tensor, down_global: torch.Tensor, rank: int):
        """Copy this rank's slice of global ``[E, ...]`` expert weights (one seed, any W)."""
        El = self.gate_up_proj.shape[0]
        sl = slice(rank * El, (rank + 1) * El)
        self.gate_up_proj.copy_(gate_up_global[sl])
        self.down_proj.copy_(down_global[sl])

    def forward(self, x, topk_ids, topk_weights, world, impl="fused", max_tokens_per_rank=None):
        if impl not in IMPLS:
            raise ValueError(f"impl must be 'fused' or 'baseline', got {impl!r}")
        if impl == "fused":
            return fused_experts(
                x,
                topk_ids,
                topk_weights,
                self.gate_up_proj,
                self.down_proj,
                world=world,
                activation=self.activation,
                b1=self.gate_up_bias,
                b2=self.down_bias,
                max_tokens_per_rank=max_tokens_per_rank,
            )
        return baseline_experts(
            x,
            topk_ids,
            topk_weights,
            self.gate_up_proj,
            self.down_proj,
            world=world,
            activation=self.activation,
            b1=self.gate_up_bias,
            b2=self.down_bias,
        )


class SharedExperts(nn.Module):
    """Shared experts as one dense MLP on the local tokens: ``gate_up_proj [2Fs or Fs, H]``,
    ``down_proj [H, Fs]``."""

    def __init__(
        self, hidden_size, ffn_size, activation="swiglu", dtype=None, device=None, generator=None
    ):
        super().__init__()
        kw = dict(dtype=dtype or torch.float32, device=device)
        self.activation = activation
        self.ffn_size = ffn_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(w1_rows(activation, ffn_size), hidden_size, **kw)
        )
        self.down_proj = nn.Parameter(torch.empty(hidden_size, ffn_size, **kw))
        dev = generator.device if generator is not None else torch.device("cpu")
        with torch.no_grad():
            for p in (self.gate_up_proj, self.down_proj):
                p.copy_(torch.randn(p.shape, generator=generator, device=dev) * INIT_STD)

    def forward(self, x):
        a = Fn.linear(x, self.gate_up_proj)
        if self.activation == "swiglu":
            g, u = a.chunk(2, dim=-1)
            h = Fn.silu(g) * u
        else:
            h = _act(a, self.activation)
        return Fn.linear(h, self.down_proj)


class MoELayer(nn.Module):
    """Router + experts sharded over an expert-parallel ``world`` (+ shared experts).

    ``forward(x [..., H]) -> [..., H]`` in x's dtype, which must be the layer's (``dtype``,
    default torch's default), on the world's device; leading dims are flattened into this
    rank's tokens. ``impl="fused"`` (default) runs the fused Triton kernels; ``impl="baseline"``
    the plain all-to-all + grouped_mm path (comparison and fallback). After a forward,
    ``aux_loss`` (fp32 scalar) holds the differentiable scaled auxiliary loss and
    ``expert_counts [E]`` (int64) the assignments this rank routed to each global expert.
    Parameters: ``router.weight [E, H]`` (fp32 by default), ``experts.gate_up_proj [El, 2F or F,
    H]`` and ``experts.down_proj [El, H, F]`` in ``dtype`` (El = E / world size; HF v5 layout).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        world=None,
        dtype=None,
        device=None,
        impl: str = "fused",
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        from ..world import default_world

        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be 'fused' or 'baseline', got {impl!r}")
        self.world = world if world is not None else default_world()
        W = self.world.world_size
        if cfg.num_experts % W:
            raise ValueError(
                f"num_experts ({cfg.num_experts}) must be divisible by the world size ({W})"
            )
        self.cfg = cfg
        self.impl = impl
        device = torch.device(device) if device is not None else self.world.device
        if device != self.world.device:
            raise ValueError(f"device {device} differs from the world's {self.world.device}")
        El = cfg.num_experts // W
        self.router = Router(cfg, dtype=dtype, device=device, generator=generator)
        self.experts = GroupedExperts(
            El,
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.activation,
            dtype=dtype,
            device=device,
            generator=generator,
        )
        self.shared_experts = None
        if cfg.n_shared_experts > 0:
            fs = cfg.shared_expert_ffn_size or cfg.n_shared_experts * cfg.ffn_hidden_size
            self.shared_experts = SharedExperts(
                cfg.hidden_size, fs, cfg.activation, dtype=dtype, device=device, generator=generator
            )
        self.aux_loss = None
        self.expert_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != cfg.hidden_size:
            raise ValueError(f"x must be [..., {cfg.hidden_size}], got {tuple(x.shape)}")
        if x.device != self.world.device:
            raise ValueError(f"x is on {x.device} but the layer's world is on {self.world.device}")
        if x.dtype != self.experts.gate_up_proj.dtype:
            raise TypeError(
                f"x dtype {x.dtype} differs from the layer's {self.experts.gate_up_proj.dtype}"
            )
        x2 = x.reshape(-1, cfg.hidden_size)
        if cfg.max_tokens_per_rank is not None and x2.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(
                f"{x2.shape[0]} tokens exceed max_tokens_per_rank={cfg.max_tokens_per_rank}"
            )
        r = self.router(x2)
        shared, side = None, None
        if self.shared_experts is not None and x2.is_cuda and not torch.compiler.is_compiling():
            # The shared experts are dense and local: run them on a side stream while the
            # dispatch and the expert GEMMs run on the main one.
            main = torch.cuda.current_stream(x2.device)
            side = torch.cuda.Stream(x2.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts(x2)
        y = self.experts(
            x2,
            r.topk_ids,
            r.topk_weights,
            self.world,
            impl=self.impl,
            max_tokens_per_rank=cfg.max_tokens_per_rank,
        )
        if side is not None:
            main.wait_stream(side)
            x2.record_stream(side)
            shared.record_stream(main)
        elif self.shared_experts is not None:
            shared = self.shared_experts(x2)
        if shared is not None:
            y = y + shared
        self.aux_loss = r.aux_loss
        self.expert_counts = r.counts
        return y.reshape(x.shape)
