#!/usr/bin/env bash
# The issue-4 benchmark on the GPU machine, in one call: kiln's fused loss and reference
# (`kiln bench lce --device cuda`) and the PyTorch peers (scripts/bench_lce_peers.py) at the two
# target shapes, bf16, forward + backward. JSON lines go to $OUT/lce.jsonl (or ./lce.jsonl),
# tables to stderr. Expects build/cuda/kiln (scripts/gpu-check builds it).
#   usage: scripts/bench_lce_gpu.sh [--quick]   (--quick: fewer iterations)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTF=${OUT:-.}/lce.jsonl
ITERS=10; PEER_ITERS=20
[ "${1:-}" = "--quick" ] && { ITERS=3; PEER_ITERS=5; }
: > "$OUTF"
for shape in "16384 4096 128256" "8192 2304 256000"; do
  set -- $shape
  build/cuda/kiln bench lce --device cuda --tokens "$1" --dim "$2" --vocab "$3" --dtype bf16 \
    --iters "$ITERS" --warmup 2 >> "$OUTF" || echo "kiln bench lce failed at $shape" >&2
  python3 scripts/bench_lce_peers.py --tokens "$1" --dim "$2" --vocab "$3" --dtype bf16 \
    --iters "$PEER_ITERS" --warmup 3 >> "$OUTF" || echo "peers failed at $shape" >&2
done
cat "$OUTF"
