#!/usr/bin/env bash
# The CPU layer benchmark of another revision and of this working tree, alternated run by run, so
# both see the same machine load:
#   bash experiments/bench/layer_ab.sh REV [RUNS]        # e.g. REV=HEAD~5, RUNS=4 (default 3)
# Each run prints experiments.bench.moe_layer's S1/S2 rows (fraction of the 2048^3 matmul rate
# measured in that run); compare the columns of the two trees.
set -eu
rev=${1:?usage: layer_ab.sh REV [RUNS]}
runs=${2:-3}
here=$(git rev-parse --show-toplevel)
old=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || rm -rf "$old"' EXIT
git -C "$here" worktree add --detach -q "$old" "$rev"
for i in $(seq "$runs"); do
  for tree in "$old" "$here"; do
    label=$([ "$tree" = "$here" ] && echo "this tree" || echo "$rev")
    # a revision from before experiments/bench/ existed has the benchmark under its old name
    mod=experiments.bench.moe_layer
    [ -f "$tree/experiments/bench/moe_layer.py" ] || mod=experiments.bench_moe_layer
    echo "== $label, run $i"
    (cd "$tree" && PYTHONPATH="$tree" python -m "$mod" --no-phases --reps 7 | grep -E "^\| S[12] ")
  done
done
