"""``python -m moe_overlap.bench`` / ``moe-overlap-bench``: benchmark the fused ops against
their baselines, measured in the same run.

Subcommands::

    layer0      dispatch + grouped GEMM + activation (fused layer 0)
    layer1      grouped GEMM + weighted combine (fused layer 1)
    moe         the whole MoE layer (router included); --backward for forward+backward
    ag-matmul   all_gather_matmul (dense TP)
    matmul-rs   matmul_reduce_scatter (dense TP)
    all         several ops over a list of presets (--presets, --ops)
    tune        re-tune one preset through the fused module's tuning hook; writes configs.json

Examples::

    moe-overlap-bench layer0 --preset mixtral-8x7b --json out.json --png out.png
    moe-overlap-bench moe --preset qwen3-30b-a3b --backward --md BENCHMARKS.md
    moe-overlap-bench layer0 --preset tiny          # CPU smoke test (numbers mean nothing)
    moe-overlap-bench layer0 --preset olmoe --world-size 4 --trace trace.json  # 4 emulated ranks
    torchrun --nproc-per-node 8 -m moe_overlap.bench ag-matmul --preset gpt3-175b

Without CUDA the command re-executes itself with ``TRITON_INTERPRET=1`` (the fused kernels
then run in the Triton interpreter) and says that CPU numbers mean nothing.

Tuning hook contract: a module among ``moe_overlap.experts.fused``, ``moe_overlap.tp`` and
``moe_overlap`` exposing ``tune(op: str, shape: dict[str, int], dtype: torch.dtype, world) ->
dict`` (a JSON-serializable config); ``tune`` stores it with
:func:`moe_overlap.bench.presets.store_config`, keyed by device, op, dtype, world size and shape.
"""

from __future__ import annotations

import argparse
import os
import sys

from .presets import DENSE_ONLY, MODEL_PRESETS, PRESETS

OPS = ("layer0", "layer1", "moe", "ag-matmul", "matmul-rs")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_REEXEC_FLAG = "MOE_OVERLAP_BENCH_REEXEC"


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _add_common(p: argparse.ArgumentParser, dense: bool = False, multi: bool = False):
    g = p.add_argument_group("shape")
    names = sorted(PRESETS) + (sorted(DENSE_ONLY) if dense else [])
    if multi:
        g.add_argument(
            "--presets",
            type=_csv,
            default=None,
            help=f"comma list (default: {','.join(MODEL_PRESETS)}; 'tiny' on CPU)",
        )
        g.add_argument(
            "--ops",
            type=_csv,
            default=["layer0", "layer1", "moe"],
            help="comma list of ops (default layer0,layer1,moe)",
        )
    else:
        g.add_argument(
            "--preset",
            choices=names,
            default=None,
            help="benchmark shape (default mixtral-8x7b on GPU, tiny on CPU"
            + ("; gpt3-175b for dense ops" if dense else "")
            + ")",
        )
    if dense:
        g.add_argument("-m", "--m", type=int, default=None, help="rows M (global)")
        g.add_argument("-n", "--n", type=int, default=None, help="output features N (global)")
        g.add_argument("-k", "--k", type=int, default=None, help="input features K (global)")
    if not dense or multi:
        g.add_argument("--tokens", type=int, default=None, help="tokens per rank")
        g.add_argument("--hidden", type=int, default=None, help="H")
        g.add_argument("--ffn", type=int, default=None, help="F per expert")
        g.add_argument("--experts", type=int, default=None, help="E (global)")
        g.add_argument("--topk", type=int, default=None, help="K")
        g.add_argument("--activation", choices=("swiglu", "gelu", "relu", "silu"), default=None)
        g.add_argument("--score-func", choices=("softmax", "sigmoid"), default=None)
    r = p.add_argument_group("run")
    r.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU"
    )
    r.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if present)")
    r.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="emulated ranks on one device (default 1; under torchrun: the job's)",
    )
    r.add_argument("--warmup", default="100ms", help="count (10) or duration (100ms)")
    r.add_argument("--rep", default="500ms", help="count (20) or duration (500ms); median")
    r.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timing rounds: every case gets its share of the calls in each, order rotating",
    )
    r.add_argument(
        "--interleave",
        choices=("block", "call"),
        default="block",
        help="block: each case's calls of a round back to back; call: the cases' calls in turn"
        " (A B C A B C), so all see the same clock where the GPU runs at its power limit",
    )
    r.add_argument("--sets", type=int, default=None, help="rotating input sets (default: auto)")
    r.add_argument(
        "--baselines",
        type=_csv,
        default=None,
        help="comma list of baselines (default all of the op's; 'none')",
    )
    r.add_argument(
        "--candidates",
        type=_csv,
        default=None,
        help="comma list of fused candidates (default all; 'none')",
    )
    r.add_argument("--no-check", action="store_true", help="skip the correctness cross-checks")
    r.add_argument(
        "--no-bounds",
        action="store_true",
        help="skip the GPU's matmul-rate and copy-bandwidth probe (the compute/memory floors)",
    )
    r.add_argument("--seed", type=int, default=0)
    if not dense or multi:
        r.add_argument("--backward", action="store_true", help="moe: time forward+backward")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write all numbers + environment here")
    o.add_argument("--png", default=None, help="bar chart (matplotlib)")
    o.add_argument("--md", default=None, help="append a markdown table (BENCHMARKS.md)")
    o.add_argument(
        "--trace",
        default=None,
        help="per-tile timeline of the fused candidates: Chrome trace JSON at this "
        "path (+ a PNG next to it)",
    )
    o.add_argument("--quiet", action="store_true", help="print the summary lines only")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moe-overlap-bench",
        description="Benchmark moe_overlap's fused ops against baselines measured in the same "
        "run (median of CUDA-event timings over rotating random inputs).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1].split("Without CUDA")[0],
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="SUBCOMMAND")
    helps = {
        "layer0": "fused layer 0 (dispatch + grouped GEMM + activation)",
        "layer1": "fused layer 1 (grouped GEMM + weighted combine)",
        "moe": "the whole MoE layer (router included)",
        "ag-matmul": "all_gather_matmul (dense TP)",
        "matmul-rs": "matmul_reduce_scatter (dense TP)",
    }
    for op in OPS:
        _add_common(sub.add_parser(op, help=helps[op]), dense=op in ("ag-matmul", "matmul-rs"))
    _add_common(
        sub.add_parser("all", help="several ops over a list of presets"), dense=True, multi=True
    )
    t = sub.add_parser(
        "tune",
        help="re-tune one preset's MoE kernel blocks on the GPU and pin them in the config table",
        description="Times the fused MoE kernels' block candidates on this GPU (layer 0, layer 1 "
        "and the backward's dispatch GEMM) and stores the fastest for the preset's shape in the "
        "config table the fused ops read (op moe: what fused_experts and MoELayer use).",
    )
    t.add_argument("--preset", choices=sorted(PRESETS), required=True)
    t.add_argument(
        "--op",
        choices=("moe", "layer0", "layer1"),
        default="moe",
        help="whose time decides: the pair's sum (moe, default; the entry the ops read), or one "
        "layer's",
    )
    t.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    t.add_argument("--device", default=None)
    t.add_argument("--world-size", type=int, default=1)
    t.add_argument(
        "--configs",
        default=None,
        help="config table to update (default: the "
        "package's configs.json, or $MOE_OVERLAP_CONFIGS)",
    )
    return ap


# ---------------------------------------------------------------------------------- running
def _device(args):
    import torch

    if args.device:
        try:
            dev = torch.device(args.device)
        except RuntimeError as e:
            raise SystemExit(f"error: --device {args.device!r}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"error: --device {args.device} but this torch sees no CUDA GPU")
        from ..world import resolve_device

        return resolve_device(dev)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype(args, device):
    import torch

    name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return getattr(torch, DTYPES[name])


def _maybe_dist():
    """Initialize torch.distributed under torchrun (WORLD_SIZE set); returns the world or None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    from .. import init_world

    return init_world()


def _none_list(v):
    if v is None:
        return None
    return [] if v == ["none"] else v


def _names_for(op: str, requested, which: str, several_ops: bool):
    """``requested`` (None: all of them) narrowed to ``op``'s baselines or candidates. Over
    several ops (``all``) a name belongs to some ops only and is skipped by the others; a
    name that no op has is a usage error, as is one the single op asked for lacks."""
    from .harness import case_names

    if requested is None:
        return None
    known = case_names(op)[0 if which == "--baselines" else 1]
    if not several_ops:
        bad = [n for n in requested if n not in known]
        if bad:
            raise SystemExit(f"error: {op} {which}: unknown {bad}; choose from {known}")
        return list(requested)
    return [n for n in requested if n in known]


def _check_names_exist(ops, args) -> None:
    from .harness import case_names

    for which, requested in (("--baselines", args.baselines), ("--candidates", args.candidates)):
        requested = _none_list(requested)
        if not requested:
            continue
        known = sorted({n for op in ops for n in case_names(op)[which == "--candidates"]})
        bad = [n for n in requested if n not in known]
        if bad:
            raise SystemExit(f"error: {which}: unknown {bad}; the ops run have {known}")


def _specs(args, device, dtype, world_size):
    from .harness import RunSpec, parse_amount
    from .presets import get_dense_shape, get_moe_shape

    if args.cmd == "all":
        presets = args.presets or (["tiny"] if device.type == "cpu" else list(MODEL_PRESETS))
        ops = args.ops
    else:
        presets = [args.preset]
        ops = [args.cmd]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"unknown op(s) {bad}; choose from {OPS}")
    _check_names_exist(ops, args)
    if getattr(args, "backward", False) and "moe" not in ops:
        raise SystemExit("error: --backward times the whole MoE layer (op moe) only")
    if args.sets is not None and args.sets < 1:
        raise SystemExit(f"error: --sets must be >= 1, got {args.sets}")
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"error: --rounds must be >= 1, got {args.rounds}")
    for flag, text in (("--warmup", args.warmup), ("--rep", args.rep)):
        try:
            kind, v = parse_amount(text)
        except ValueError as e:
            raise SystemExit(f"error: {flag}: {e}") from None
        if flag == "--rep" and v < 1:
            raise SystemExit("error: --rep must be >= 1 call (or a duration)")
    default_preset = "tiny" if device.type == "cpu" else None
    specs = []
    for preset in presets:
        for op in ops:
            try:  # sizes and presets: a usage error, not a traceback
                if op in ("ag-matmul", "matmul-rs"):
                    shape = get_dense_shape(
                        op,
                        preset or (default_preset or "gpt3-175b"),
                        getattr(args, "m", None),
                        getattr(args, "n", None),
                        getattr(args, "k", None),
                    )
                else:
                    if preset in DENSE_ONLY:
                        continue
                    shape = get_moe_shape(
                        preset or default_preset or "mixtral-8x7b",
                        tokens=args.tokens,
                        hidden=args.hidden,
                        ffn=args.ffn,
                        experts=args.experts,
                        topk=args.topk,
                        activation=args.activation,
                        score_func=args.score_func,
                    )
            except (KeyError, ValueError) as e:
                raise SystemExit(f"error: {op} {preset}: {e}") from None
            _check_world_fits(op, shape, world_size)
            specs.append(
                RunSpec(
                    op=op,
                    shape=shape,
                    dtype=dtype,
                    device=device,
                    world_size=world_size,
                    backward=bool(getattr(args, "backward", False)) and op == "moe",
                    baselines=_names_for(
                        op, _none_list(args.baselines), "--baselines", len(ops) > 1
                    ),
                    candidates=_names_for(
                        op, _none_list(args.candidates), "--candidates", len(ops) > 1
                    ),
                    warmup=parse_amount(args.warmup),
                    rep=parse_amount(args.rep),
                    rounds=args.rounds,
                    interleave=args.interleave,
                    n_sets=args.sets,
                    check=not args.no_check,
                    bounds=not args.no_bounds,
                    trace=bool(args.trace),
                    seed=args.seed,
                )
            )
    return specs


def _check_world_fits(op, shape, world_size) -> None:
    """The sizes a world of ``world_size`` ranks must divide (checked before any run)."""
    d = shape.as_dict()
    if op in ("ag-matmul", "matmul-rs"):
        # M is split over ranks by rows; ag-matmul shards the weight's N rows, matmul-rs its
        # K columns (make_dense_problem).
        split = {"m": "rows", "n" if op == "ag-matmul" else "k": "weight shards"}
        for name, what in split.items():
            v = d.get(name)
            if isinstance(v, int) and v % world_size:
                raise SystemExit(
                    f"error: {op}: {name.upper()} = {v} ({what}) must be a multiple of "
                    f"--world-size {world_size}"
                )
    elif d["experts"] % world_size:
        raise SystemExit(
            f"error: {op}: {d['experts']} experts do not split over --world-size {world_size}"
        )
    if op != "ag-matmul" and op != "matmul-rs" and d["topk"] > d["experts"]:
        raise SystemExit(f"error: {op}: top-k {d['topk']} exceeds {d['experts']} experts")


def _write_traces(runs, path):
    from pathlib import Path

    from . import trace as tr

    written = []
    base = Path(path)
    many = sum(len(r.get("traces", {})) for r in runs) > 1
    for run in runs:
        for cand, buf in run.get("traces", {}).items():
            p = base
            if many:
                p = base.with_name(f"{base.stem}-{run['op']}-{run['preset']}-{cand}{base.suffix}")
            align = run["world"] == "torchrun"
            tr.write_chrome(buf, p, name=f"{run['op']} tile", align_ranks=align)
            png = tr.write_png(
                buf,
                p.with_suffix(".png"),
                title=f"{run['op']} {run['preset']} {cand} W={run['world_size']}",
                align_ranks=align,
            )
            written.append(str(p) + ("" if png is None else f" + {png}"))
            if png is None:
                written.append("(matplotlib missing: no timeline PNG)")
    return written


def _run_bench(args) -> int:
    import torch

    from . import report
    from .harness import run

    world = _maybe_dist()
    device = world.device if world is not None else _device(args)
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "warning: TRITON_INTERPRET=1 on a CUDA run: fused kernels run in the interpreter",
            file=sys.stderr,
        )
    if world is not None:
        if args.world_size not in (None, world.world_size):
            raise SystemExit(
                f"--world-size {args.world_size} but the torchrun job has {world.world_size} ranks"
            )
        world_size = world.world_size
    else:
        world_size = 1 if args.world_size is None else args.world_size
    if world_size < 1:
        raise SystemExit("error: --world-size must be >= 1")
    dtype = _dtype(args, device)
    specs = _specs(args, device, dtype, world_size)
    env = report.environment(device)
    if args.argv is not None:
        env["command"] = "moe-overlap-bench " + " ".join(args.argv)
    env["world_size"] = world_size
    rank0 = world is None or world.rank == 0
    runs = []
    for spec in specs:
        if rank0 and not args.quiet:
            print(
                f"running {spec.op}{' fwd+bwd' if spec.backward else ''} {spec.shape.name} "
                f"({str(dtype).replace('torch.', '')}, W={world_size}) ...",
                flush=True,
            )
        runs.append(run(spec, world=world))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not rank0:
        return 0
    if args.quiet:
        for r in runs:
            for line in report.summary_lines(r):
                print(line)
        if env.get("gpu") is None:
            print("NOTE: CPU run: these numbers mean nothing for performance.")
    else:
        report.print_report(runs, env)
    tail = []
    if args.json:
        tail.append(f"wrote {report.write_json(runs, env, args.json)}")
    if args.png:
        p = report.write_png(runs, env, args.png)
        tail.append(f"wrote {p}" if p else "matplotlib missing or nothing timed: no PNG")
    if args.md:
        tail.append(f"appended to {report.append_markdown(runs, env, args.md)}")
    if args.trace:
        written = _write_traces(runs, args.trace)
        why = [
            f"{r['op']} {c['name']}: {c['trace']}"
            for r in runs
            for c in r["cases"]
            if c.get("role") == "candidate" and isinstance(c.get("trace"), str)
        ]
        tail += [f"trace: {w}" for w in written] or [
            "trace: no fused candidate produced a tile trace (tiles are traced by layer0 and "
            "layer1)" + "".join(f"\n  {w}" for w in why)
        ]
    for line in tail:
        print(line)
    return 0


def _run_tune(args) -> int:
    import importlib

    import torch

    from .presets import get_moe_shape, store_config

    device = _device(args)
    dtype = _dtype(args, device)
    if args.world_size < 1:
        raise SystemExit("error: --world-size must be >= 1")
    shape = get_moe_shape(args.preset).as_dict()
    if shape["experts"] % args.world_size:
        raise SystemExit(
            f"error: {shape['experts']} experts do not split over --world-size {args.world_size}"
        )
    shape = {k: v for k, v in shape.items() if isinstance(v, int)}
    hook = None
    for mod_name in ("moe_overlap.experts.fused", "moe_overlap.tp", "moe_overlap"):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - being written; try the next
            continue
        if callable(getattr(mod, "tune", None)):
            hook = (mod_name, mod.tune)
            break
    if hook is None:
        print(
            f"tune {args.op} {args.preset}: unavailable: no fused module exposes "
            "tune(op, shape, dtype, world) yet; configs.json unchanged"
        )
        return 1
    if args.world_size > 1:
        from ..testing import spawn

        mode = "concurrent" if device.type == "cuda" else "sequential"
        config = spawn(
            args.world_size, lambda w: hook[1](args.op, shape, dtype, w), device=device, mode=mode
        )[0]
    else:
        from .. import local_world

        config = hook[1](args.op, shape, dtype, local_world(device))
    if device.type != "cuda":
        # The interpreter runs its own small blocks whatever the candidate: nothing to pin.
        print(
            f"tune {args.op} {args.preset} on the CPU: {config}\nnot written: the interpreter's "
            "timings mean nothing and it runs its own blocks (tune on a GPU)"
        )
        return 0
    name = torch.cuda.get_device_name(device)
    dshort = {v: k for k, v in DTYPES.items()}[str(dtype).replace("torch.", "")]
    from . import report

    env = report.environment(device)
    p = store_config(
        args.op,
        shape,
        dshort,
        name,
        config,
        world_size=args.world_size,
        preset=args.preset,
        path=args.configs,
        extra={
            "tuned": env["date"],
            "torch": env["torch"],
            "triton": env["triton"],
            "hook": hook[0],
        },
    )
    print(f"tune {args.op} {args.preset} on {name}: {config}\nwrote {p}")
    return 0


def _needs_interpreter(args) -> bool:
    """Whether the kernels must run in the Triton interpreter: on a CPU-only machine, and
    for ``--device cpu`` on a machine with a GPU (compiled kernels refuse CPU tensors)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    dev = getattr(args, "device", None)
    if dev is not None and str(dev).split(":")[0] == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def main(argv=None) -> int:
    """CLI entry. ``argv=None`` reads ``sys.argv`` (and may re-execute itself on a CPU-only
    machine with ``TRITON_INTERPRET=1``); a list runs in-process (tests)."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if argv is None and _needs_interpreter(args) and not os.environ.get(_REEXEC_FLAG):
        # Triton reads TRITON_INTERPRET when kernels are decorated, i.e. at import: set it and
        # start afresh so the fused kernels can run on the CPU.
        env = dict(os.environ, TRITON_INTERPRET="1", **{_REEXEC_FLAG: "1"})
        os.execve(sys.executable, [sys.executable, "-m", "moe_overlap.bench", *sys.argv[1:]], env)
    if (getattr(args, "world_size", None) or 1) > 1:
        from ..world.emulated import prefer_eager_module_loading

        prefer_eager_module_loading(warn=False)  # before CUDA starts: see world/emulated.py
    if args.cmd == "tune":
        return _run_tune(args)
    return _run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
