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

# SmolLM2-135M with real gradients (capture --grads): 256 tokens of the default text, layers 0, 3, 15, 29;
# every backward preset with attribution on the capture's own dO, then the same Q, K, V with synthetic dO.
# The capture (6 MiB) goes to results/ (git-ignored); its sha256 is in the datasets' provenance (dist_key).
fa3-numerics capture --model smollm2 --grads --tokens 256 --layers 0,3,15,29 \
  --out results/smollm2-grads-256.safetensors
for do in auto synthetic; do
  if [ "$do" = auto ]; then dir=smollm2-grads; extra=""; else dir=smollm2-synthetic-do; extra="--no-attribution"; fi
  fa3-numerics run backward --dist capture-file:results/smollm2-grads-256.safetensors --layer 0,3,15,29 \
    --seqlen 256 --head-dim 64 --heads 9 --kv-heads 3 --causal true --seeds 0 --do "$do" $extra \
    --out "reports/backward/$dir"
done
