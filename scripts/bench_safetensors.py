#!/usr/bin/env python3
"""safetensors load benchmark: kiln vs Python safetensors, same files, same run.

Writes a ~1 GB and a ~10 MB f32 safetensors file (random data, numpy + safetensors), reads
them once to warm the page cache, runs build/cpu/bench_safetensors_load on both, then times
Python's safetensors.numpy.load_file (and safe_open of the header) on the same files. Prints
one JSON object per case (ARCHITECTURE.md's format) and the ratios.

    python3 scripts/bench_safetensors.py [--dir /tmp/kiln_bench] [--repeat 5] [--bin PATH]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file


def make(path, total_bytes, tensor_bytes):
    if os.path.exists(path):
        return
    rng = np.random.default_rng(0)
    n = max(1, total_bytes // tensor_bytes)
    per = tensor_bytes // 4
    tensors = {f"layer.{i:03d}.weight": rng.standard_normal(per, dtype=np.float32).reshape(-1, 1024) for i in range(n)}
    save_file(tensors, path)


def warm(path):
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def emit(impl, path, ms, peak):
    b = os.path.getsize(path)
    rec = {"bench": "safetensors_load", "impl": impl, "device": "cpu", "shape": path, "file_bytes": b,
           "dtype": "f32", "ms_median": ms, "peak_bytes": peak, "gb_per_s": b / (ms * 1e6)}
    print(json.dumps(rec), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/kiln_bench")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "build", "cpu", "bench_safetensors_load"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    big, small = os.path.join(a.dir, "big_1gb.safetensors"), os.path.join(a.dir, "small_10mb.safetensors")
    make(big, 1 << 30, 16 << 20)
    make(small, 10 << 20, 1 << 20)
    for p in (big, small):
        warm(p)
    recs = []
    out = subprocess.run([a.bin, "--repeat", str(a.repeat), small, big], check=True, stdout=subprocess.PIPE, text=True)
    for line in out.stdout.splitlines():
        print(line, flush=True)
        recs.append(json.loads(line))
    for p in (small, big):
        def header_only():
            with safe_open(p, framework="numpy") as f:
                f.keys()
        recs.append(emit("python_safe_open", p, median_ms(header_only, a.repeat * 4), 0))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ms = median_ms(lambda: load_file(p), a.repeat)
        recs.append(emit("python_load_file", p, ms, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before))
    get = {(r["impl"], r["shape"]): r["ms_median"] for r in recs}
    summary = {
        "bench": "safetensors_load_summary",
        "materialize_speedup_vs_load_file_1gb": get[("python_load_file", big)] / get[("kiln_materialize", big)],
        "views_speedup_vs_load_file_1gb": get[("python_load_file", big)] / get[("kiln_views", big)],
        "kiln_open_ms_10mb": get[("kiln_open", small)],
        "kiln_open_ms_1gb": get[("kiln_open", big)],
        "python_safe_open_ms_10mb": get[("python_safe_open", small)],
        "python_safe_open_ms_1gb": get[("python_safe_open", big)],
    }
    print(json.dumps(summary), flush=True)
    print(json.dumps(summary, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
