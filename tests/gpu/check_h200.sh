#!/usr/bin/env bash
# One device call for a kernel change: benchmark the changed op, then the GPU tests that judge
# it, inside one time budget (the session's device time is short). Usage there:
#   BENCH="layer0:mixtral-8x7b layer0:qwen3-30b-a3b moe_bwd:mixtral-8x7b" \
#   ENVS="MOE_OVERLAP_L0_FLAT=0@layer0:mixtral-8x7b" PYTEST_ARGS="tests/gpu/..." \
#   bash tests/gpu/check_h200.sh
# An ENVS entry sets several variables joined by '+' (A=1+B=2@op:preset); BENCH_ARGS is passed
# to every bench run (e.g. "--baselines unfused" to skip the slow per-expert loop).
# Benchmark tables land in $OUT/bench.tgz (bench.md), the pytest log in $OUT/pytest_gpu.log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
R=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache
run_one() {  # run_one op:preset [ENV=VALUE]
  N_RUN=$((${N_RUN:-0} + 1))
  local op=${1%%:*} p=${1##*:} tag=${N_RUN}_${1//:/_}${2:+_${2%%=*}}
  local extra=() ev=${2:-}
  [ "$op" = moe_bwd ] && op=moe && extra=(--backward)
  local s=$SECONDS
  # shellcheck disable=SC2086
  env ${ev//+/ } timeout 150 python3 -m moe_overlap.bench "$op" --preset "$p" "${extra[@]}" \
    ${BENCH_ARGS:-} --md "$R/bench.md" > "$R/$tag.log" 2>&1
  echo "== $tag ${2:-} rc=$? $((SECONDS - s))s"
  grep "^  .*x grouped_mm" "$R/$tag.log" | cut -c1-220
  tar czf "$OUT/bench.tgz" -C "$R" .
}
for b in ${BENCH:-}; do run_one "$b"; done
for e in ${ENVS:-}; do run_one "${e##*@}" "${e%%@*}"; done
# run_h200.sh installs the carried wheels and bounds pytest by PYTEST_S
[ -n "${PYTEST_ARGS:-}" ] && TORCHRUN=0 bash tests/gpu/run_h200.sh tests
