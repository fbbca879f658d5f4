#!/usr/bin/env bash
# Times the GEMM and the overlapped ops of two trees in one machine session, alternating: the tree
# this script is in ("new") and another one ("old", e.g. unpacked from `git archive`). Builds each
# into its own folder, runs bench_gemm_vs_cublas (one GPU) and bench_gemm_overlap (every GPU) twice
# per tree in the order old, new, old, new, and writes the JSON of each run and a table of
# new / old time per row (the median of the two runs of each tree) to OUT_DIR.
#   bench/compare_trees.sh OLD_TREE OUT_DIR [bench_gemm_overlap flags...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
new=$(cd "$(dirname "$0")/.." && pwd)
old=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
overlap_flags=("$@")
ngpu=$(nvidia-smi -L | grep -c '^GPU')
for tree in old new; do
  src=$([ $tree = old ] && echo "$old" || echo "$new")
  (cmake -S "$src" -B "/tmp/compare-$tree" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTDIST_BUILD_TESTS=OFF &&
     ninja -C "/tmp/compare-$tree" tdistrun bench_gemm_overlap bench_gemm_vs_cublas) >"$out/build_$tree.log" 2>&1 ||
    { tail -30 "$out/build_$tree.log"; echo "compare_trees: the $tree build failed"; exit 1; }
done
for round in 1 2; do
  for tree in old new; do
    b=/tmp/compare-$tree
    "$b/bench/bench_gemm_vs_cublas" --json "$out/gemm_${tree}_$round.json" >"$out/gemm_${tree}_$round.log" 2>&1 ||
      echo "compare_trees: bench_gemm_vs_cublas ($tree, round $round) failed"
    "$b/tools/tdistrun" -n "$ngpu" -- "$b/bench/bench_gemm_overlap" "${overlap_flags[@]}" \
      --json "$out/overlap_${tree}_$round.json" >"$out/overlap_${tree}_$round.log" 2>&1 ||
      echo "compare_trees: bench_gemm_overlap ($tree, round $round) failed"
  done
done
python3 "$new/bench/compare_trees.py" "$out" | tee "$out/compare.txt"
