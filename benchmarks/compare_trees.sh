#!/usr/bin/env bash
# Compare train_step.py and adjoint.py between another checkout and this one, on one machine:
#   benchmarks/compare_trees.sh OTHER_CHECKOUT [tolerance]
# e.g. OTHER_CHECKOUT from `git archive 0926b85 | tar -x -C ../before`. Both trees are built in place
# (torchckpt._C), then run in the order train A, train B, adjoint A, adjoint B, each with its own PYTHONPATH;
# benchmarks/compare.py prints the ratio per figure and writes compare.json and compare.png to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
[[ $# -ge 1 && -d $1 ]] || { echo "usage: $0 OTHER_CHECKOUT [tolerance]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")/.." && pwd)
OTHER=$(cd "$1" && pwd)
TOL=${2:-0.03}
OUT=${OUT:-$HERE/benchmarks/results}
mkdir -p "$OUT/before" "$OUT/after"
for d in "$OTHER" "$HERE"; do
  ( cd "$d" && python3 setup.py -q build_ext --inplace > "$OUT/build_$(basename "$d").log" 2>&1 ); echo "build $d: exit $?"
done
run() {  # label dir script
  ( cd "$2" && PYTHONPATH="$2" python3 "benchmarks/$3.py" --out "$OUT/$1" > "$OUT/$1/$3.log" 2>&1 ); echo "$1 $3: exit $?"
}
run before "$OTHER" train_step
run after "$HERE" train_step
run before "$OTHER" adjoint
run after "$HERE" adjoint
python3 "$HERE/benchmarks/compare.py" "$OUT/before" "$OUT/after" --tolerance "$TOL" --out "$OUT"
