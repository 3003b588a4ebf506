#!/usr/bin/env python3
"""kiln train's throughput from its metrics.jsonl, as one JSON line for the training benchmarks
(scripts/bench_train_cpu.sh, scripts/bench_train_gpu.sh): tokens/s over the steps after WARMUP
(tokens and elapsed_s between the warm-up step and the last step; the first steps, the final
checkpoint and the sample are not timed), the first and final losses, and kiln's peak bytes.
Usage: train_throughput.py METRICS.jsonl WARMUP KEY=VALUE...  (extra fields, values as JSON or text)
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    warm = int(sys.argv[2])
    rows = [r for r in rows if "elapsed_s" in r]
    a = next((r for r in rows if r["step"] == warm), None)
    b = rows[-1] if rows else None
    if a is None or b is None or b["step"] <= warm:
        sys.exit(f"train_throughput: {sys.argv[1]} has no step after the warm-up step {warm}")
    rec = {"impl": "kiln"}
    for kv in sys.argv[3:]:
        k, _, v = kv.partition("=")
        try:
            rec[k] = json.loads(v)
        except json.JSONDecodeError:
            rec[k] = v
    rec.update({"tokens_per_s": (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"]),
                "steps": b["step"] - a["step"], "warmup_steps": warm, "first_loss": rows[0]["loss"],
                "final_loss": b["loss"]})
    # The allocator's peak in every record (the telemetry's, at step 1 and every 50 steps, missed
    # the later steps' peak: AdamW's state exists only from the first update on).
    peak = max((r.get("peak_memory_bytes") or r.get("telemetry", {}).get("kiln_peak_bytes") or 0 for r in rows),
               default=0)
    if peak:
        rec["peak_bytes"] = peak
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
