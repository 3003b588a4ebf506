#!/usr/bin/env bash
# Gloo collectives on the CPU, kiln against torch.distributed's gloo, on one machine in one run:
# all_reduce, all_gather and reduce_scatter of f32 at 1 MiB and 64 MiB, at 2 and 4 ranks
# (BENCHMARKS.md's comms targets). Writes under $OUT (default build/bench_comms):
#   kiln_np<N>.jsonl, torch_gloo_np<N>.jsonl (one JSON line per op and size) and summary.json
#   (kiln's busbw over torch's per case). Needs a built kiln (KILN, default build/cuda/kiln, else
#   build/cpu/kiln) and python3 with torch for the peer (PEERS=0 runs kiln only).
#   OUT=/some/dir scripts/bench_comms.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/bench_comms}
mkdir -p "$OUT"
KILN=${KILN:-}
if [ -z "$KILN" ]; then
  for k in build/cuda/kiln build/cpu/kiln; do [ -x "$k" ] && KILN=$k && break; done
fi
[ -x "${KILN:-}" ] || { echo "bench_comms: no kiln binary (build one, or set KILN=path)"; exit 1; }
OPS=${OPS:-all_reduce,all_gather,reduce_scatter}
BYTES=${BYTES:-1M,64M}
ITERS=${ITERS:-20}
export OMP_NUM_THREADS=1
for np in 2 4; do
  rm -f "$OUT/kiln_np$np.jsonl" "$OUT/torch_gloo_np$np.jsonl"
  for op in ${OPS//,/ }; do
    timeout 600 "$KILN" launch --nproc-per-node "$np" --master-port 0 -- \
      "$KILN" bench comms --backend gloo --op "$op" --bytes "$BYTES" --dtype f32 --iters "$ITERS" \
      | sed -n 's/^\[rank 0\] {/{/p' >> "$OUT/kiln_np$np.jsonl"
  done
  if [ "${PEERS:-1}" != 0 ]; then
    timeout 600 python3 scripts/bench_comms_peers.py --nproc "$np" --ops "$OPS" --bytes "$BYTES" --iters "$ITERS" \
      --out "$OUT/torch_gloo_np$np.jsonl"
  fi
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in glob.glob(os.path.join(out, "*_np*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        rows.setdefault((r["op"], r["world_size"], r["bytes"]), {})[r["impl"]] = r["busbw_GBps"]
summary = []
for (op, n, b), v in sorted(rows.items()):
    s = {"op": op, "world_size": n, "bytes": b, "kiln_busbw_GBps": v.get("kiln"), "torch_busbw_GBps": v.get("torch_gloo")}
    if v.get("kiln") and v.get("torch_gloo"):
        s["ratio"] = v["kiln"] / v["torch_gloo"]
    summary.append(s)
    print(f"{op:15s} {n} ranks {b:>10d} B  kiln {s['kiln_busbw_GBps'] or 0:.3f}  torch {s['torch_busbw_GBps'] or 0:.3f}"
          f"  ratio {s.get('ratio', float('nan')):.2f}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
