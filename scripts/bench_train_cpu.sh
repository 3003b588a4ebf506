#!/usr/bin/env bash
# The issue-3 CPU training benchmark: kiln vs PyTorch on the `small` preset (same model, batch
# 8 x 128, AdamW, clipping), THREADS threads pinned with taskset to cores 0..THREADS-1.
# No OMP_PROC_BIND: with taskset it made kiln's OpenMP threads share one core on the GPU
# machine's Xeon (measured 3,370 tokens/s with it, 10,719 without, same run).
# Prints two JSON lines: {"impl":"kiln",...} and {"impl":"torch",...} (scripts/bench_train_torch.py).
# Both train on the same text, DATA (default: README.md and docs/*.md concatenated), tokenized by
# kiln's byte tokenizer, so their first/final losses are comparable (DATA=random: kiln on its
# embedded default corpus, torch on random bytes, the old behaviour).
# kiln's tokens/s is measured over the steps after WARMUP (scripts/train_throughput.py reads
# metrics.jsonl; no eval, no sample, the final checkpoint is not timed).
#   usage: scripts/bench_train_cpu.sh THREADS [STEPS=30] [WARMUP=3]
# Expects build/cpu/kiln or build/cuda/kiln (KILN=path overrides), python3 with torch.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:?usage: scripts/bench_train_cpu.sh THREADS [STEPS] [WARMUP]}
STEPS=${2:-30}
WARMUP=${3:-3}
KILN=${KILN:-$( [ -x build/cpu/kiln ] && echo build/cpu/kiln || echo build/cuda/kiln )}
CORES="0-$((THREADS - 1))"
RUN=$(mktemp -d /tmp/kiln_bench_train.XXXXXX)
trap 'rm -rf "$RUN"' EXIT
DATA=${DATA:-}
if [ -z "$DATA" ]; then
  DATA="$RUN/corpus.txt"
  cat README.md docs/*.md > "$DATA"
fi
KILN_DATA=(); TORCH_DATA=()
if [ "$DATA" != random ]; then KILN_DATA=(--data "$DATA"); TORCH_DATA=(--data "$DATA"); fi

OMP_NUM_THREADS=$THREADS taskset -c "$CORES" "$KILN" train --device cpu --preset small \
  --steps $((STEPS + WARMUP)) --warmup -1 --eval-every 0 --sample-tokens 0 --log-every 1 \
  --ckpt-every 0 "${KILN_DATA[@]}" --out "$RUN/kiln" >&2
python3 scripts/train_throughput.py "$RUN/kiln/metrics.jsonl" "$WARMUP" device=cpu threads="$THREADS" batch=8 seq=128
OMP_NUM_THREADS=$THREADS taskset -c "$CORES" python3 scripts/bench_train_torch.py --threads "$THREADS" \
  --steps "$STEPS" --warmup "$WARMUP" "${TORCH_DATA[@]}"
