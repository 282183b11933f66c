#!/usr/bin/env bash
# Run HERE (where pip reaches the package index), before a device call that wants DeepSpeed:
# puts the wheels the H200 image lacks (DeepSpeed and the packages it needs beyond that image's
# own) into .whl/, at the versions ci-requirements-integrations.txt pins, for Python 3.12 on
# x86-64. Name .whl in the call's carry list; run_h200.sh and bench_h200.sh install what they
# find there into /tmp/site first. DeepSpeed ships only as an sdist whose setup.py imports torch,
# so it is built here (pure Python, DS_BUILD_OPS=0) with $PY, which must have torch.
#   bash tests/gpu/wheels.sh && du -sh .whl      # ~5.5 MB; a call carries at most 64 MiB
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
pins=ci-requirements-integrations.txt
pin() { grep -E "^$1==" "$pins" | head -1 || { echo "no pin for $1 in $pins" >&2; exit 1; }; }
# Not fetched: numpy and ninja (the image's list in KINDS.md), packaging, psutil and tqdm (needs
# of the image's accelerate and transformers, both listed there).
names="hjson msgpack py-cpuinfo einops pydantic pydantic-core annotated-types typing-inspection"
# as assignments, so a missing pin stops the script (set -e) instead of dropping a wheel
ds_req=$(pin deepspeed)
reqs=$(for n in $names; do pin "$n"; done)
git_dir=$(git rev-parse --git-common-dir)
mkdir -p "$git_dir/info"
grep -qx '/.whl/' "$git_dir/info/exclude" 2>/dev/null || echo '/.whl/' >> "$git_dir/info/exclude"
rm -rf .whl && mkdir .whl
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$ds_req"
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel -q --no-deps --no-build-isolation \
  -w .whl "$tmp"/deepspeed-*.tar.gz
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  $reqs
rm -rf "$tmp"
ls .whl
