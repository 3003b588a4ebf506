#!/usr/bin/env bash
# Issue 32's CPU figures: `kiln train --nproc N` (FSDP over kiln's Gloo backend; N = 1 through
# --fsdp, the same sharded code at one rank) against PyTorch FSDP2 over gloo
# (scripts/bench_fsdp_torch.py: transformers' LlamaForCausalLM, fully_shard per layer and root,
# f32 parameters as kiln's CPU default) at kiln's tiny or small preset, batch per rank as the
# preset's, on this machine. Both get max(1, cores / N) threads per rank (kiln launch's default).
# kiln trains on text (README.md and docs/*.md), torch on random ids: tokens/s and memory compare,
# losses do not. Prints one JSON line per run: kiln's (scripts/train_throughput.py over the steps
# after WARMUP, plus peak_rss_bytes: the largest process of the job, from GNU time) and torch's.
#   usage: scripts/bench_fsdp_cpu.sh tiny|small [STEPS=20] [WARMUP=3]    (NPROCS="1 2 4" by default)
# Expects build/cpu/kiln (KILN=path overrides) and PYTHON, a python3 with torch and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:?usage: scripts/bench_fsdp_cpu.sh tiny|small [STEPS] [WARMUP]}
STEPS=${2:-20}
WARMUP=${3:-3}
KILN=${KILN:-build/cpu/kiln}
PYTHON=${PYTHON:-python3}
NPROCS=${NPROCS:-1 2 4}
CORES=$(nproc)
RUN=$(mktemp -d /tmp/kiln_bench_fsdp.XXXXXX)
trap 'rm -rf "$RUN"' EXIT
cat README.md docs/*.md > "$RUN/corpus.txt"
for N in $NPROCS; do
  T=$(( CORES / N > 0 ? CORES / N : 1 ))
  shard=(--nproc "$N"); [ "$N" = 1 ] && shard=(--fsdp)
  OMP_NUM_THREADS=$T /usr/bin/time -f %M -o "$RUN/rss" "$KILN" train --device cpu --preset "$PRESET" "${shard[@]}" \
    --steps $((STEPS + WARMUP)) --warmup -1 --eval-every 0 --sample-tokens 0 --log-every 1 --ckpt-every 0 \
    --data "$RUN/corpus.txt" --out "$RUN/kiln$N" > "$RUN/kiln$N.log" 2>&1 || { cat "$RUN/kiln$N.log" >&2; exit 1; }
  "$PYTHON" scripts/train_throughput.py "$RUN/kiln$N/metrics.jsonl" "$WARMUP" bench=fsdp preset="$PRESET" \
    world_size="$N" threads_per_rank="$T" peak_rss_bytes=$(( $(cat "$RUN/rss") * 1024 ))
  "$PYTHON" scripts/bench_fsdp_torch.py --device cpu --preset "kiln-$PRESET" --nproc "$N" --threads "$T" \
    --param-dtype f32 --steps "$STEPS" --warmup "$WARMUP"
done
