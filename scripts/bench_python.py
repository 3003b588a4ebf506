#!/usr/bin/env python3
"""Per-call overhead of kiln.torch over the C++ call, on tiny inputs (the issue's target: at most
10 us on the CPU, 15 us on CUDA). For each op it times the kiln.torch call (DLPack both ways,
the autograd.Function, the caller's-stream scope) and the binding's direct call on kiln tensors
made beforehand (the C++ call plus nanobind's argument conversion), and prints one JSON object
per case on stdout (bench, impl, device, shape, dtype, ms_median, ms_min, peak_bytes, overhead_us,
overhead_us_min) and a
table on stderr.

  PYTHONPATH=build/cpu/python .venv/bin/python scripts/bench_python.py            # needs torch
  ... scripts/bench_python.py --timer process   # CPU time of this process (a shared machine)
  PYTHONPATH=build/cuda/python python3 scripts/bench_python.py --device cuda
"""
import argparse
import json
import statistics
import sys
import time

import torch

import kiln
import kiln.torch as kt
from kiln import _C


def timed(fn, device, iters, repeats, clock=time.perf_counter):
    """(median, fastest) seconds per call over `repeats` batches of `iters` calls (the fastest batch
    is the figure least disturbed by other work on a shared machine). `clock`: wall time, or this
    process's CPU time (--timer process: on a machine whose cores other work shares, wall time
    counts the waits for a core too)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(max(iters // 10, 5)):
        fn()
    sync()
    per = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(iters):
            fn()
        sync()
        per.append((clock() - t0) / iters)
    return statistics.median(per), min(per)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=2000, help="calls per timed batch")
    ap.add_argument("--repeats", type=int, default=15, help="timed batches (the median is reported)")
    ap.add_argument("--timer", default="wall", choices=["wall", "process"],
                    help="wall time, or this process's CPU time (CPU only; for a shared machine)")
    a = ap.parse_args()
    if a.timer == "process" and a.device != "cpu":
        ap.error("--timer process measures the CPU only (it does not see the GPU's time)")
    clock = time.process_time if a.timer == "process" else time.perf_counter
    dev = a.device
    g = torch.Generator().manual_seed(0)
    n, d, v = 4, 8, 16
    h = torch.randn(n, d, generator=g).to(dev)
    w = torch.randn(v, d, generator=g).to(dev)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    B, H, L, E = 1, 1, 16, 8
    q = torch.randn(B, H, L, E, generator=g).to(dev)
    qg = q.clone().requires_grad_()
    bm = kt.create_block_mask(kt.mods.causal, 1, 1, L, L, device=dev, BLOCK_SIZE=16)
    kh, kw, ktgt, kq = (kiln.from_dlpack(x) for x in (h, w, t, q))

    def lce_bwd_kiln():
        _, _, _, graph = _C.linear_cross_entropy(kh, kw, ktgt, hidden_grad=True, weight_grad=True)
        graph.run([one])

    one = kiln.from_dlpack(torch.ones((), device=dev))
    cases = [
        ("lce_forward", (n, d, v), lambda: kt.linear_cross_entropy(h, w, t),
         lambda: _C.linear_cross_entropy(kh, kw, ktgt)),
        ("lce_forward_backward", (n, d, v), lambda: kt.linear_cross_entropy(hg, wg, t).backward(), lce_bwd_kiln),
        ("flex_forward", (B, H, L, E), lambda: kt.flex_attention(q, q, q, block_mask=bm),
         lambda: _C.flex_attention(kq, kq, kq, bm._native)),
        ("flex_forward_backward", (B, H, L, E), lambda: kt.flex_attention(qg, qg, qg, block_mask=bm).sum().backward(),
         None),
        ("dlpack_round_trip", (n, d), lambda: torch.from_dlpack(kiln.from_dlpack(h)), None),
    ]
    print(f"{'case (median of batches)':24} {'kiln.torch us':>14} {'C++ call us':>12} {'overhead us':>12}",
          file=sys.stderr)
    for name, shape, py, cpp in cases:
        (tp, tp_min) = timed(py, dev, a.iters, a.repeats, clock)
        (tc, tc_min) = timed(cpp, dev, a.iters, a.repeats, clock) if cpp else (None, None)
        for impl, sec, sec_min in (("kiln.torch", tp, tp_min), ("kiln._C", tc, tc_min)):
            if sec is None:
                continue
            rec = {"bench": f"python_{name}", "impl": impl, "device": dev, "shape": list(shape), "dtype": "f32",
                   "ms_median": sec * 1e3, "ms_min": sec_min * 1e3, "timer": a.timer,
                   "peak_bytes": kiln.memory_stats(dev if dev == "cpu" else "cuda:0")["peak_bytes"]}
            if impl == "kiln.torch" and tc is not None:
                rec["overhead_us"] = (tp - tc) * 1e6
                rec["overhead_us_min"] = (tp_min - tc_min) * 1e6
            print(json.dumps(rec))
        print(f"{name:24} {tp * 1e6:14.2f} {tc * 1e6 if tc else float('nan'):12.2f} "
              f"{(tp - tc) * 1e6 if tc else float('nan'):12.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
