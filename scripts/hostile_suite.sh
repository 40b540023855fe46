#!/usr/bin/env bash
# `make test` on a fresh clone of this repository's HEAD, under the conditions a release must survive:
#
#   scripts/hostile_suite.sh [COND ...]     (no argument: plain avx2 busy twice, one after the other)
#
#   plain  as is
#   avx2   ATEN_CPU_CAPABILITY=avx2: torch's AVX2 kernels (other float rounding than AVX512's)
#   busy   one extra process keeping a core busy for the whole run (started and stopped by its pid)
#   twice  make test twice in a row in the same clone (the second run meets what the first left)
#   joined with '+', several at once: avx2+busy+twice
#
# Each condition gets a clone of its own under $HOSTILE_WORK (default: a new /tmp/prodrl-hostile-*);
# the vLLM and verifiers environments are the machine's cache (~/.cache/prodrl), as for `make test`.
# Prints one line per run and ends with `hostile_suite: <condition>=<pass|FAIL> (<seconds> s) ...`;
# exits 1 when any run failed. Logs: $HOSTILE_WORK/<condition>[-N].log
set -uo pipefail

REPO="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
WORK="${HOSTILE_WORK:-$(mktemp -d /tmp/prodrl-hostile-XXXXXX)}"
mkdir -p "$WORK"
CONDITIONS=("$@")
[ ${#CONDITIONS[@]} -eq 0 ] && CONDITIONS=(plain avx2 busy twice)
for c in "${CONDITIONS[@]}"; do
    for part in ${c//+/ }; do
        case "$part" in plain|avx2|busy|twice) ;; *) echo "unknown condition '$part' (plain, avx2, busy, twice)"; exit 2;; esac
    done
done

BUSY_PID=""
stop_busy() {
    if [ -n "$BUSY_PID" ]; then kill "$BUSY_PID" 2>/dev/null; wait "$BUSY_PID" 2>/dev/null; BUSY_PID=""; fi
}
trap stop_busy EXIT

summary=()
failed=0
run_once() {  # clone-dir label [env...]
    local dir="$1" label="$2"; shift 2
    local log="$WORK/$label.log" t0 rc secs line
    t0=$(date +%s)
    (cd "$dir" && env "$@" make test) >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    line="$(grep -E '^[=]* ?[0-9]+ (passed|failed)' "$log" | tail -1)"
    [ -z "$line" ] && line="$(grep -E '(passed|failed|error)' "$log" | tail -1)"
    if [ "$rc" -eq 0 ]; then summary+=("$label=pass (${secs} s)"); else summary+=("$label=FAIL (${secs} s)"); failed=1; fi
    echo "$label: exit $rc in ${secs} s: $line (log: $log)"
}

for c in "${CONDITIONS[@]}"; do
    dir="$WORK/clone-$c"
    rm -rf "$dir"
    git clone -q "$REPO" "$dir"
    envs=()
    [[ "+$c+" == *+avx2+* ]] && envs+=(ATEN_CPU_CAPABILITY=avx2)
    if [[ "+$c+" == *+busy+* ]]; then
        # a pure busy loop on core 0 (taskset where it exists): half the machine gone for the run
        if command -v taskset >/dev/null; then taskset -c 0 sh -c 'while :; do :; done' & else sh -c 'while :; do :; done' & fi
        BUSY_PID=$!
    fi
    if [[ "+$c+" == *+twice+* ]]; then
        run_once "$dir" "$c-1" "${envs[@]}"
        run_once "$dir" "$c-2" "${envs[@]}"
    else
        run_once "$dir" "$c" "${envs[@]}"
    fi
    stop_busy
done
echo "hostile_suite: ${summary[*]}"
exit "$failed"
