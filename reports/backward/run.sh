#!/bin/sh
# The committed CPU run of `fa3-numerics run backward` (reports/backward/): three synthetic families,
# every backward preset with attribution, batch 1, 4 query heads over 2 KV heads (GQA), seqlen 512,
# head dim 128, seed 0; the paper's outliers also causal.
set -e
cd "$(dirname "$0")/../.."
for spec in "outliers --causal false,true" "k-bias" "sink-tokens"; do
  set -- $spec
  fam=$1; shift
  fa3-numerics run backward --dist "$fam" "$@" --seqlen 512 --head-dim 128 --heads 4 --kv-heads 2 \
    --seeds 0 --out "reports/backward/$fam"
done
