#!/usr/bin/env bash
# GPU training, kiln against PyTorch on the same model, batch and data: `kiln train --device
# cuda --preset PRESET` (flex attention; with FUSED=1 also the fused loss) and
# scripts/bench_train_torch.py --device cuda at that preset's shape (bf16 autocast on f32
# weights, SDPA, fused AdamW), eager and torch.compile'd. Sequence 2048, batch 4 (BATCH, SEQ
# override); all train on README.md and docs/*.md, tokenized by kiln's byte tokenizer.
# Prints one JSON line per implementation (impl kiln, kiln_fused, torch, torch_compile): tokens/s
# over the steps after WARMUP, peak bytes, first and final loss.
#   usage: scripts/bench_train_gpu.sh PRESET [STEPS=20] [WARMUP=3]   (PRESET: 125m, 1b, llama1.5b, llama8b)
# llama1.5b is issue 35's target: the 1b shape untied at vocabulary 128256, on uniform random ids
# (kiln --data random:128256, torch's random ids) instead of the byte-tokenized docs. llama8b is
# Llama 3 8B's shape (hidden 4096, 32 layers, 32/8 heads, SwiGLU 14336, vocabulary 128256, untied)
# on random ids; LAYERS=N keeps its width with N layers (the largest that fits one GPU).
# CKPT=block|mlp: kiln with --checkpoint-activations CKPT, torch with torch.utils.checkpoint per
# block (for both values: torch has no MLP-only form here). KILN_ARGS: more flags for kiln;
# TORCH_ARGS: more flags for bench_train_torch.py (--clip 0 beside kiln's --optimizer-in-backward);
# TORCH_MODES: which of torch's runs (default "eager compile").
# Expects build/cuda/kiln (KILN=path overrides) and python3 with torch on a CUDA machine
# (PEERS=0: kiln only). FSDP=1 adds kiln_fsdp: the same run FSDP-sharded over a world of one
# (`kiln train --fsdp`), the sharded path's overhead against the one-process trainer (issue 32).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:?usage: scripts/bench_train_gpu.sh PRESET [STEPS] [WARMUP]}
STEPS=${2:-20}
WARMUP=${3:-3}
BATCH=${BATCH:-4}
SEQ=${SEQ:-2048}
KILN=${KILN:-build/cuda/kiln}
case "$PRESET" in  # kiln/train/config.cpp's shapes (both tie the embedding)
  125m) shape=(--hidden 768 --layers 12 --heads 12 --kv-heads 4 --intermediate 2048 --tie) ;;
  1b) shape=(--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --rope-theta 500000 --tie) ;;
  llama1.5b) shape=(--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --rope-theta 500000
                    --vocab 128256) ;;
  llama8b) shape=(--hidden 4096 --layers "${LAYERS:-32}" --heads 32 --kv-heads 8 --intermediate 14336
                  --rope-theta 500000 --vocab 128256) ;;
  *) echo "bench_train_gpu: PRESET must be 125m, 1b, llama1.5b or llama8b, got '$PRESET'" >&2; exit 2 ;;
esac
RUN=$(mktemp -d /tmp/kiln_bench_train_gpu.XXXXXX)
trap 'rm -rf "$RUN"' EXIT
DATA="$RUN/corpus.txt"
cat README.md docs/*.md > "$DATA"
KILN_DATA=(--data "$DATA")
TORCH_DATA=(--data "$DATA")
if [ "$PRESET" = llama1.5b ]; then  # the 1b preset's shape, untied, vocabulary 128256 (a config file unties it)
  printf 'preset = "1b"\ntie_embeddings = false\n' > "$RUN/llama1.5b.toml"
  KILN_DATA=(--config "$RUN/llama1.5b.toml" --data random:128256)
  TORCH_DATA=()
  PRESET=1b
elif [ "$PRESET" = llama8b ]; then
  printf 'preset = "1b"\nhidden = 4096\nlayers = %d\nheads = 32\nkv_heads = 8\nintermediate = 14336\ntie_embeddings = false\n' \
    "${LAYERS:-32}" > "$RUN/llama8b.toml"
  KILN_DATA=(--config "$RUN/llama8b.toml" --data random:128256)
  TORCH_DATA=()
  PRESET=1b
fi
KILN_EXTRA=()
TORCH_EXTRA=()
if [ -n "${CKPT:-}" ]; then KILN_EXTRA=(--checkpoint-activations "$CKPT"); TORCH_EXTRA=(--checkpoint); fi
# shellcheck disable=SC2206
KILN_EXTRA+=(${KILN_ARGS:-})

kiln_run() {  # name, extra flags
  local name=$1; shift
  "$KILN" train --device cuda --preset "$PRESET" --steps $((STEPS + WARMUP)) --warmup -1 --seq "$SEQ" \
    --batch "$BATCH" --eval-every 0 --sample-tokens 0 --log-every 1 --ckpt-every 0 "${KILN_DATA[@]}" \
    --out "$RUN/$name" ${KILN_EXTRA[@]+"${KILN_EXTRA[@]}"} "$@" > "$RUN/$name.out" 2>&1 || { tail -5 "$RUN/$name.out" >&2; return 1; }
  python3 scripts/train_throughput.py "$RUN/$name/metrics.jsonl" "$WARMUP" impl="$name" device=cuda \
    preset="$PRESET" batch="$BATCH" seq="$SEQ" checkpoint="${CKPT:-none}" kiln_args="${KILN_ARGS:-}"
}
kiln_run kiln || true
if [ "${FUSED:-0}" = 1 ]; then kiln_run kiln_fused --fused-loss || true; fi
if [ "${FSDP:-0}" = 1 ]; then kiln_run kiln_fsdp --fsdp || true; fi
if [ "${PEERS:-1}" = 1 ]; then
  for mode in ${TORCH_MODES:-eager compile}; do
    case "$mode" in eager) c="" ;; compile) c=--compile ;;
      *) echo "bench_train_gpu: TORCH_MODES takes eager and compile, got '$mode'" >&2; exit 2 ;; esac
    python3 scripts/bench_train_torch.py --device cuda $c --steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH" \
      --seq "$SEQ" "${shape[@]}" ${TORCH_DATA[@]+"${TORCH_DATA[@]}"} ${TORCH_EXTRA[@]+"${TORCH_EXTRA[@]}"} ${TORCH_ARGS:-} --lr 6e-4 || echo "bench_train_gpu: torch $c failed" >&2
  done
fi
