#!/usr/bin/env bash
# Collective bandwidth, kiln bench comms against torch.distributed on the same machine in one run
# (BENCHMARKS.md's comms targets): all_reduce, all_gather and reduce_scatter at each size and
# world size.
#   BACKEND=gloo (default): CPU tensors, f32 at 1 MiB and 64 MiB, 2 and 4 ranks.
#   BACKEND=nccl: one GPU per rank, bf16 at 1 MiB, 64 MiB and 1 GiB, 2 ranks; torch's peer uses
#     all_gather_into_tensor / reduce_scatter_tensor on the NCCL backend. Target (issue 33): kiln
#     >= 0.97 x torch's busbw at every size >= 64 MiB ("meets_target" in the summary).
#   ROUNDS=N (default 1) repeats the whole measurement N times, alternating who goes first (kiln in
#     odd rounds, torch in even ones), so a machine whose load drifts (a shared box) weighs on both
#     alike; the summary gives each side's median busbw over the rounds (and the spread) and the
#     ratio of the medians.
#   NPS="2 4 8" sets the world sizes, DTYPE, BYTES, OPS, ITERS the rest; RUN_TIMEOUT (seconds,
#   default 600) bounds each kiln or torch run; PYTHON the interpreter with torch (default python3).
# Writes under $OUT (default build/bench_comms): kiln_<backend>_np<N>.r<round>.jsonl,
# torch_<backend>_np<N>.r<round>.jsonl (one JSON line per op and size), *.log (each run's output)
# and summary.json (kiln's busbw over torch's per case). Needs a built kiln (KILN, default
# build/cuda/kiln, else build/cpu/kiln) and python3 with torch for the peer (PEERS=0 runs kiln
# only). Exits non-zero when a run failed (the others still run).
#   OUT=/some/dir scripts/bench_comms.sh
#   ROUNDS=5 PYTHON=/tmp/torchvenv/bin/python OUT=/some/dir scripts/bench_comms.sh
#   BACKEND=nccl NPS="2 4 8" OUT=/some/dir scripts/bench_comms.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-build/bench_comms}
mkdir -p "$OUT"
KILN=${KILN:-}
if [ -z "$KILN" ]; then
  for k in build/cuda/kiln build/cpu/kiln; do [ -x "$k" ] && KILN=$k && break; done
fi
[ -x "${KILN:-}" ] || { echo "bench_comms: no kiln binary (build one, or set KILN=path)"; exit 1; }
BACKEND=${BACKEND:-gloo}
case "$BACKEND" in
  gloo) dflt_dtype=f32 dflt_bytes=1M,64M dflt_nps="2 4" ;;
  nccl) dflt_dtype=bf16 dflt_bytes=1M,64M,1G dflt_nps="2" ;;
  *) echo "bench_comms: BACKEND='$BACKEND' (expected gloo or nccl)"; exit 1 ;;
esac
DTYPE=${DTYPE:-$dflt_dtype}
OPS=${OPS:-all_reduce,all_gather,reduce_scatter}
BYTES=${BYTES:-$dflt_bytes}
ITERS=${ITERS:-20}
NPS=${NPS:-$dflt_nps}
export OMP_NUM_THREADS=1
ROUNDS=${ROUNDS:-1}
PYTHON=${PYTHON:-python3}
status=0
run_kiln() {  # np round
  local np=$1 rd=$2 kj=$OUT/kiln_${BACKEND}_np$1.r$2.jsonl
  rm -f "$kj"
  for op in ${OPS//,/ }; do
    log=$OUT/kiln_${BACKEND}_np${np}_$op.r$rd.log
    timeout -k 10 "${RUN_TIMEOUT:-600}" "$KILN" launch --nproc-per-node "$np" --master-port 0 -- \
      "$KILN" bench comms --backend "$BACKEND" --op "$op" --bytes "$BYTES" --dtype "$DTYPE" --iters "$ITERS" \
      > "$log" 2>&1
    rc=$?
    sed -n 's/^\[rank 0\] {/{/p' "$log" >> "$kj"
    grep -v '^\[rank 0\] {' "$log" >&2
    [ $rc = 0 ] || { echo "bench_comms: kiln $BACKEND $op at $np ranks: exit $rc (see $log)" >&2; status=1; }
  done
}
run_torch() {  # np round
  local np=$1 rd=$2 tj=$OUT/torch_${BACKEND}_np$1.r$2.jsonl
  rm -f "$tj"
  [ "${PEERS:-1}" != 0 ] || return 0
  timeout -k 10 "${RUN_TIMEOUT:-600}" "$PYTHON" scripts/bench_comms_peers.py --backend "$BACKEND" --nproc "$np" \
    --dtype "$DTYPE" --ops "$OPS" --bytes "$BYTES" --iters "$ITERS" --out "$tj" \
    > "$OUT/torch_${BACKEND}_np$np.r$rd.log" 2>&1
  rc=$?
  grep -v "UserWarning\|_conversion_method_template" "$OUT/torch_${BACKEND}_np$np.r$rd.log" >&2
  [ $rc = 0 ] || { echo "bench_comms: torch $BACKEND at $np ranks: exit $rc" >&2; status=1; }
}
rm -f "$OUT"/kiln_"$BACKEND"_np*.jsonl "$OUT"/torch_"$BACKEND"_np*.jsonl
for rd in $(seq 1 "$ROUNDS"); do
  for np in ${NPS//,/ }; do
    echo "bench_comms: round $rd of $ROUNDS, $np ranks ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    if [ $((rd % 2)) = 1 ]; then run_kiln "$np" "$rd"; run_torch "$np" "$rd"
    else run_torch "$np" "$rd"; run_kiln "$np" "$rd"; fi
  done
done
python3 - "$OUT" "$BACKEND" <<'PY' || status=1
import glob, json, os, statistics, sys
out, backend = sys.argv[1], sys.argv[2]
peer = "torch_" + backend
rows = {}
for f in glob.glob(os.path.join(out, f"*_{backend}_np*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        rows.setdefault((r["op"], r["world_size"], r["bytes"]), {}).setdefault(r["impl"], []).append(r["busbw_GBps"])
summary = []
for (op, n, b), v in sorted(rows.items()):
    med = {k: statistics.median(x) for k, x in v.items()}
    s = {"backend": backend, "peer": peer, "op": op, "world_size": n, "bytes": b, "kiln_busbw_GBps": med.get("kiln"),
         "torch_busbw_GBps": med.get(peer), "rounds": {k: len(x) for k, x in v.items()},
         "kiln_busbw_all": v.get("kiln"), "torch_busbw_all": v.get(peer)}
    if med.get("kiln") and med.get(peer):
        s["ratio"] = med["kiln"] / med[peer]
        if backend == "nccl" and b >= 64 << 20:
            s["meets_target"] = s["ratio"] >= 0.97
    summary.append(s)
    spread = lambda x: f"[{min(x):.3f}-{max(x):.3f}]" if x else ""
    print(f"{backend} {op:15s} {n} ranks {b:>11d} B  kiln {s['kiln_busbw_GBps'] or 0:7.3f} {spread(v.get('kiln'))}  "
          f"torch {s['torch_busbw_GBps'] or 0:7.3f} {spread(v.get(peer))}  ratio {s.get('ratio', float('nan')):.3f}"
          f"  ({len(v.get('kiln', []))} rounds)")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
exit $status
