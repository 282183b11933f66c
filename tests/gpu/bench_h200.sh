#!/usr/bin/env bash
# One device call: re-tune the pinned MoE configs and write the benchmark tables (one H200).
# Usage there: TUNE="mixtral-8x7b" PRESETS="mixtral-8x7b qwen3-30b-a3b" bash tests/gpu/bench_h200.sh
# (BENCH_ARGS="--interleave call" goes to every layer table; OPS="layer0 layer1" by default.)
# Everything lands in $OUT/bench.tgz (the device tool returns at most 8 files): tune.log, the
# updated configs.json, bench.md (the CLI's markdown tables), one JSON per run, trace files.
set -u
OUT=${OUT:-/tmp/out}
R=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # carried wheels (deepspeed for its baseline), see the device README
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export TRITON_CACHE_DIR=$PWD/.tcache  # see run_h200.sh
export MOE_OVERLAP_CONFIGS=$R/configs.json
cp moe_overlap/bench/configs.json "$MOE_OVERLAP_CONFIGS"
step() {  # step SECONDS NAME CMD...: bounded, logged, never fatal
  local t=$1 n=$2
  shift 2
  local s=$SECONDS
  timeout "$t" "$@" > "$R/$n.log" 2>&1
  echo "== $n rc=$? $((SECONDS - s))s"
  grep -v "Repeat.cu\|^$" "$R/$n.log" | tail -${TAILN:-6} | cut -c1-300
  tar czf "$OUT/bench.tgz" -C "$R" .  # after every step: a killed call still returns the rest
}
for p in ${TUNE:-}; do
  step 200 "tune_$p" python3 -m moe_overlap.bench tune --preset "$p" --op moe
done
B="python3 -m moe_overlap.bench"
for p in ${PRESETS-mixtral-8x7b}; do  # unset: mixtral-8x7b; PRESETS="": none
  for op in ${OPS:-layer0 layer1}; do
    # shellcheck disable=SC2086
    step 150 "${op}_$p" $B "$op" --preset "$p" ${BENCH_ARGS:-} --json "$R/${op}_$p.json" \
      --md "$R/bench.md"
  done
  if [ "${BACKWARD:-1}" = 1 ]; then
    step 200 "moe_bwd_$p" $B moe --preset "$p" --backward --json "$R/moe_bwd_$p.json" \
      --md "$R/bench.md"
  fi
done
if [ -n "${TRACE:-}" ]; then
  # layer0 (and layer1) trace their tiles; the whole moe op takes no trace yet
  step 150 trace $B layer0 --preset "$TRACE" --world-size 4 --tokens 4096 --trace "$R/trace.json" \
    --json "$R/trace_run.json" --md "$R/bench.md"
fi
cp "$MOE_OVERLAP_CONFIGS" "$R/configs.json" 2>/dev/null
tar czf "$OUT/bench.tgz" -C "$R" .
