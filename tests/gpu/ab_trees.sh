#!/usr/bin/env bash
# Same-machine A/B of whole source trees (a branch against main) in one device call. A fresh
# machine's clock and power state differ from the last one's by more than most kernel changes
# (2026-12-04: grouped_mm itself moved 0.69-0.78 ms between calls), so a branch is judged
# against main timed on the same machine, the trees alternating round by round.
#
# Prepare here (the copy is untracked, so it travels with the working tree; delete it after,
# and the moe_overlap/kernels links this script makes in each tree):
#   git archive --prefix=scratch/ws-layer1/ ws-layer1 | tar x
# There:
#   TREES="main=. ws=scratch/ws-layer1" ROUNDS=2 PYTEST_TREES=ws \
#   PYTEST="-n 4 tests/gpu/test_fused_experts_gpu.py -k 'warp or layer1'" \
#   CMDS="python -m moe_overlap.bench moe --preset qwen3-30b-a3b --backward --baselines unfused --quiet
#         ;; python tests/gpu/ab_layers.py qwen3-30b-a3b" bash tests/gpu/ab_trees.sh
# Each command (a shell line: `A=1 python ...` works) runs inside each tree with that tree first on PYTHONPATH (ahead of any editable
# install), commands separated by ';;'. PYTEST runs once per tree named in PYTEST_TREES
# (default: all), before the timing, with MOE_OVERLAP_COMPILED=1. Logs land in $OUT/ab/, the
# benchmark summary lines of every run in $OUT/ab/summary.txt (also printed). CMD_S bounds one
# command (default 300 s), PYTEST_S the pytest run (default 420 s).
set -u
OUT=${OUT:-/tmp/out}
LOG=$OUT/ab
mkdir -p "$LOG"
ROOT=$PWD
export PYTHONUNBUFFERED=1

declare -A DIR
NAMES=()
for t in ${TREES:?TREES=\"name=dir ...\"}; do
  name=${t%%=*} dir=${t#*=}
  [ -d "$dir/moe_overlap" ] || { echo "tree $name: no moe_overlap/ under $dir" >&2; exit 2; }
  DIR[$name]=$(cd "$dir" && pwd)
  NAMES+=("$name")
  # The editable install maps moe_overlap.kernels to ITS tree's kernels/ (pyproject's
  # package-dir), whatever PYTHONPATH says; a link inside the tree is found first.
  [ -e "$dir/moe_overlap/kernels" ] || ln -s ../kernels "$dir/moe_overlap/kernels"
  got=$(cd "$dir" && PYTHONPATH=$PWD python3 -c \
    "import moe_overlap.kernels.launch as k, os; print(os.path.realpath(k.__file__))")
  case "$got" in
    "${DIR[$name]}"/*) ;;
    *) echo "tree $name imports its kernels from ${got:-nowhere}" >&2; exit 2 ;;
  esac
done

in_tree() {  # in_tree NAME LIMIT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local d=${DIR[$name]} s=$SECONDS
  (cd "$d" && PYTHONPATH=$d${PYTHONPATH:+:$PYTHONPATH} TRITON_CACHE_DIR=$d/.tcache \
    timeout "$limit" "$@") > "$log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - s))s: $*" | cut -c1-200
  return $rc
}

if [ -n "${PYTEST:-}" ]; then
  for name in ${PYTEST_TREES:-${NAMES[*]}}; do
    MOE_OVERLAP_COMPILED=1 in_tree "$name" "${PYTEST_S:-420}" "$LOG/pytest_$name.log" \
      bash -c "python3 -m pytest -q -m gpu $PYTEST"
    tail -3 "$LOG/pytest_$name.log"
  done
fi

IFS=$'\n' read -r -d '' -a COMMANDS < <(printf '%s' "${CMDS:-}" | sed 's/;;/\n/g' && printf '\0')
for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
  # alternate the trees' order from round to round, so neither always runs on a warmer GPU
  order=("${NAMES[@]}")
  ((r % 2 == 0)) && order=($(printf '%s\n' "${NAMES[@]}" | tac))
  for i in "${!COMMANDS[@]}"; do
    cmd=$(printf '%s' "${COMMANDS[$i]}" | sed 's/^ *//; s/ *$//')
    [ -z "$cmd" ] && continue
    for name in "${order[@]}"; do
      log=$LOG/r${r}_c${i}_$name.log
      in_tree "$name" "${CMD_S:-300}" "$log" bash -c "$cmd"
      # the bench's summary lines and ab_layers' table rows
      grep -E "^==|^ *[A-Za-z].* ms" "$log" | sed "s/^/[r$r $name] /" \
        | cut -c1-240 | tee -a "$LOG/summary.txt" | tail -12
    done
  done
done
