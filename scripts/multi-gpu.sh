#!/usr/bin/env bash
# Everything that needs several GPUs, in one run: the multi-GPU tests (two ranks and, where four GPUs are
# present, four) and `bench tp` / `bench ddp` at WORLD ranks (default: every GPU present), each step under
# a hard timeout (a hang is a failure, never a wait). Prints a short table last; the steps' own output is
# in $LOGS (default build/multi-gpu/), the benchmarks' JSON in $OUT (default results/).
#
#     scripts/multi-gpu.sh [WORLD]
#
# Uses python3 (or $PYTHON) as it is, with this checkout on PYTHONPATH: a GPU machine's own torch. Exits 3
# with fewer than two GPUs (nothing to run), 1 where a step failed or timed out, 0 otherwise; a world
# larger than the GPUs present makes the benchmarks measure nothing (their line in the table says so).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
WORLD="${1:-$GPUS}"
case "$WORLD" in
    '' | *[!0-9]*) echo "scripts/multi-gpu.sh: WORLD=$WORLD: expected a number of ranks" >&2; exit 2 ;;
esac
if [ "$GPUS" -lt 2 ] || [ "$WORLD" -lt 2 ]; then
    echo "scripts/multi-gpu.sh: needs two or more GPUs and a world of two or more ranks; found $GPUS GPU(s)," \
        "world $WORLD: nothing run" >&2
    exit 3
fi
OUT="${OUT:-results}"
LOGS="${LOGS:-build/multi-gpu}"
STEP_S="${STEP_S:-300}"  # each step's deadline
mkdir -p "$LOGS" "$OUT"
: > "$LOGS/summary"

step() {  # step NAME COMMAND...: run it under the deadline, record its exit and seconds
    local name="$1" log="$LOGS/$1.log" start rc
    shift
    start=$(date +%s)
    timeout --kill-after=10 "$STEP_S" "$@" > "$log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$LOGS/summary"
}

step tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_multigpu.py tests/gpu/test_gpu_ddp.py -rs
step bench-tp "$PY" -m graph_opt bench tp --world "$WORLD" --out "$OUT"
step bench-ddp "$PY" -m graph_opt bench ddp --world "$WORLD" --out "$OUT"

for name in bench-tp bench-ddp; do
    echo "== $name (last lines)"
    tail -n 12 "$LOGS/$name.log"
done
echo
echo "multi-GPU run: $GPUS GPU(s) present, world $WORLD"
printf '| step | exit | seconds | result |\n|---|---|---|---|\n'
failed=0
while IFS=$'\t' read -r name rc seconds; do
    case "$name" in
        tests) result="$(grep -E '[0-9]+ (passed|failed|skipped)' "$LOGS/$name.log" | tail -n 1)" ;;
        *) result="$(grep -E 'nothing to measure|wrote ' "$LOGS/$name.log" | tail -n 1)" ;;
    esac
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && result="timed out after $STEP_S s (a hang): $result"
    [ "$rc" = 0 ] || failed=1
    printf '| %s | %s | %s | %s |\n' "$name" "$rc" "$seconds" "${result:-see $LOGS/$name.log}"
done < "$LOGS/summary"
exit "$failed"
