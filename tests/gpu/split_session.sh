#!/usr/bin/env bash
# The WS_SPLIT experiment (2026-12-06), one device call a part: its GPU tests, its A/B on the
# row GEMMs, the CLI's forward+backward with it off and on.
# Usage there: PART=tests|ab|bench [P=preset] bash tests/gpu/split_session.sh; results under $OUT.
set -u
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1 MOE_OVERLAP_COMPILED=1 TRITON_CACHE_DIR=$PWD/.tcache
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
step() {  # step SECONDS NAME CMD...
  local t=$1 n=$2; shift 2; local s=$SECONDS
  timeout -s INT "$t" "$@" > "$OUT/$n.log" 2>&1
  echo "== $n rc=$? $((SECONDS - s))s"; grep -v "Repeat.cu\|^$" "$OUT/$n.log" | tail -${TAILN:-12} | cut -c1-300
}
B="python3 -m moe_overlap.bench"
case ${PART:-tests} in
tests)
  step 260 pytest python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
    tests/gpu/test_fused_experts_gpu.py -k split tests/gpu/test_bench_gpu.py
  ;;
ab)
  AB_WGRAD=0 AB="default= split=MOE_OVERLAP_WS_SPLIT=1" AB_ROUNDS=3 TAILN=40 step 480 ab \
    python3 tests/gpu/ab_layers.py deepseek-v3 qwen3-30b-a3b mixtral-8x7b
  ;;
bench)
  for v in 0 1; do
    MOE_OVERLAP_WS_SPLIT=$v step 260 "moe_bwd_split$v" $B moe --preset ${P:-deepseek-v3} --backward \
      --baselines unfused --json "$OUT/moe_bwd_split$v.json" --md "$OUT/bench.md"
  done
  ;;
esac
