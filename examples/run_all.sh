#!/usr/bin/env bash
# Builds the tutorials and runs each through tdistrun at every world size from 2 to the number of
# GPUs (or the sizes given); prints one line per run and exits non-zero if any run failed.
#   examples/run_all.sh [-b BUILD_DIR] [-n "2 4 8"] [-- extra program options]
# Logs: $OUT/examples or BUILD_DIR/examples/logs, one file per run.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
sizes=""
while [ $# -gt 0 ]; do
  case "$1" in
    -b) build=$2; shift 2 ;;
    -n) sizes=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-b BUILD_DIR] [-n \"2 4 8\"] [-- extra program options]" >&2; exit 2 ;;
  esac
done
programs=(example_01_notify_wait example_02_allgather example_03_low_latency_all_to_all example_04_gemm_wait_flags)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
logs=${OUT:+$OUT/examples}
logs=${logs:-$build/examples/logs}
mkdir -p "$logs"
ulimit -c 0  # a crashing rank must not spend minutes dumping its GPU mappings

{ cmake -S "$root" -B "$build" -G Ninja && ninja -C "$build" tdistrun "${programs[@]}"; } >"$logs/build.log" 2>&1 ||
  { tail -30 "$logs/build.log"; echo "build failed (log: $logs/build.log)"; exit 1; }

if [ -z "$sizes" ]; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "$ngpu" -ge 2 ] || { echo "the tutorials need at least 2 GPUs; nvidia-smi sees ${ngpu:-0}"; exit 1; }
  sizes=$(seq 2 "$ngpu")
fi

failed=0
for n in $sizes; do
  for program in "${programs[@]}"; do
    log=$logs/${program}_n$n.log
    start=$SECONDS
    timeout --kill-after=10 900 "$build/tools/tdistrun" -n "$n" -- "$build/examples/$program" "$@" >"$log" 2>&1
    rc=$?
    summary=$(grep -Eo '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)
    printf '%-36s n=%-2s %-8s %5ss  %s\n' "$program" "$n" "$([ $rc -eq 0 ] && echo ok || echo "FAIL:$rc")" \
      $((SECONDS - start)) "${summary:-no result line}"
    if [ $rc -ne 0 ]; then
      failed=$((failed + 1))
      grep -E 'FAIL|mismatch|error|timed out' "$log" | head -10 | sed 's/^/    /'
    fi
  done
done
echo "logs: $logs"
[ $failed -eq 0 ]
