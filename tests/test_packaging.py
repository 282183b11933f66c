"""Packaging and build checks that need no GPU.

* The root ``kernels/`` folder ships as ``moe_overlap.kernels`` (never as a top-level ``kernels``
  module), and every package folder is listed, so a built wheel holds what an editable install
  sees. (A wheel build is too slow for the suite; the README's commands are the end-to-end
  check.)
* Every Triton kernel of the foundation compiles for sm_90 (the H200) on this CPU-only machine:
  Triton's own ``ptxas`` runs without a GPU, so front-end errors (non-constexpr globals,
  mistyped atomics, ``.to`` on a Python int) fail here rather than on the first GPU run. The
  compile runs in a subprocess because this process has ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_kernels_ship_inside_the_package():
    st = pyproject()["tool"]["setuptools"]
    assert st["package-dir"]["moe_overlap.kernels"] == "kernels"
    assert "moe_overlap.kernels" in st["packages"]
    assert "kernels" not in st["packages"], "a top-level `kernels` module collides on PyPI"
    spec = importlib.util.find_spec("moe_overlap.kernels.signals")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent.name == "kernels"


def test_every_package_folder_is_listed():
    # A subpackage missing from `packages` is silently left out of the wheel while an editable
    # install still finds it.
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "moe_overlap").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    found.add("moe_overlap.kernels")
    assert found <= listed, f"not in pyproject packages: {sorted(found - listed)}"
    assert (ROOT / "kernels" / "__init__.py").exists()


def test_console_scripts_resolve():
    for name, target in pyproject()["project"].get("scripts", {}).items():
        module, func = target.split(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{name}: module {module} not found"
        tree = ast.parse(Path(spec.origin).read_text())
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        for n in tree.body:
            if isinstance(n, ast.Assign):
                defs |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        assert func in defs, f"{name}: {module} has no top-level {func}"


def test_license_is_an_spdx_expression_with_its_file():
    # PEP 639: a string, not the table setuptools deprecates, naming files that exist.
    data = pyproject()
    proj = data["project"]
    assert proj["license"] == "Apache-2.0"
    assert all((ROOT / f).is_file() for f in proj["license-files"])
    req = data["build-system"]["requires"]
    assert "setuptools>=77" in req, f"SPDX license strings need setuptools >= 77: {req}"


def test_extras_declared():
    opt = pyproject()["project"]["optional-dependencies"]
    for extra in ("test", "bench", "deepspeed", "transformers", "nvshmem-cu12", "nvshmem-cu13"):
        assert extra in opt, f"missing extra [{extra}]"
    assert any(d.startswith("pytest") for d in opt["test"])


# Variants compiled for sm_90: kernel, argument types (or ("constexpr", value)). Add the
# variants of a new kernel here; every constexpr branch that matters (roles, timer) should be
# covered, since the GPU only ever sees the branches that were compiled.
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_overlap.kernels import signals, toy_allreduce

    def build(fn, args):
        sig = {n: ("constexpr" if isinstance(a, tuple) else a) for n, a in args.items()}
        consts = {(fn.arg_names.index(n),): a[1] for n, a in args.items() if isinstance(a, tuple)}
        assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32))

    n = 0
    for timer in (False, True):
        # stage 1 specializes to a constexpr on the GPU: the error path must take it.
        for stage in ("i32", ("c", 1)):
            build(signals._wait_kernel, dict(
                flag_ptr="*i32", target="i32", err_ptr="*i64", out_ptr="*i32", rank="i32",
                stage=stage, index="i32", budget="i64", USE_TIMER=("c", timer)))
            n += 1
    build(signals._ready_kernel, dict(pad_table_ptr="*i64", epoch_ptr="*i32", rank="i32",
                                      world_size="i32"))
    n += 1
    for role, timer, dt, w in itertools.product((0, 1, 2), (False, True),
                                                ("fp32", "fp16", "bf16"), (2,)):
        if dt != "fp32" and not timer:
            continue
        build(toy_allreduce._push_allreduce_kernel, dict(
            x_ptr="*" + dt, out_ptr="*" + dt, buf_local="*" + dt, buf_table="*i64",
            flag_table="*i64", flags_local="*i32", pad_local="*i32", epoch_ptr="*i32",
            err_ptr="*i64", M="i32", N="i32", rank="i32", budget="i64", W=("c", w),
            ROLE=("c", role), BM=("c", 16), BN=("c", 32), USE_TIMER=("c", timer)))
        n += 1
    print(f"compiled {n} variants for sm_90")
    """
)


def test_foundation_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every run
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 warning
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert r.returncode == 0, f"sm_90 compile failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "compiled" in r.stdout


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_has_two_quick_start_commands_and_ci_runs_the_test_one():
    cmds = _quick_start_commands()
    assert len(cmds) == 2, cmds
    main, tests = cmds
    for cmd in cmds:
        assert "venv .venv" in cmd and "pip install torch==" in cmd
        assert cmd.index("pip install torch==") < cmd.index("pip install -e")
    assert tests.endswith("-m pytest -q -n 2 --dist loadgroup tests")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines() or any(line.startswith(tests + " ") for line in ci.splitlines())
    assert os.access(ROOT / ".ci" / "run", os.X_OK), ".ci/run must be executable"
