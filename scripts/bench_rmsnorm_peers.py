#!/usr/bin/env python3
"""RMSNorm forward and backward in PyTorch on CUDA, the peers of kiln's kernels (issue 34).

For each shape (rows x d, bf16, weight bf16, eps 1e-5) times torch.compile'd and eager RMSNorm
(x * rsqrt(mean(x^2) + eps) * w, statistics in f32, as kiln computes it), and a device-to-device
copy of x in the same process, the ceiling: one JSON line per (impl, pass, shape) on stdout with
ms_median and GB/s, counting the bytes kiln's lab does (build/cuda/dev/dev_rmsnorm): forward reads
x and writes y; backward reads x and dy and writes dx (dweight's d elements are not counted).

  python3 scripts/bench_rmsnorm_peers.py [--rows 16384] [--d 2048,4096,8192,16384] [--iters 30]
"""
import argparse
import json
import sys

import torch


def rmsnorm(x, w, eps: float = 1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def median_ms(fn, iters):
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--d", default="2048,4096,8192,16384")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rmsnorm_peers: needs a CUDA device")
    compiled = torch.compile(rmsnorm)
    for d in (int(v) for v in args.d.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(args.rows, d, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.randn(d, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(args.rows, d, device="cuda", generator=gen).to(torch.bfloat16)
        nbytes = args.rows * d * 2
        copy = torch.empty_like(x)
        ms = median_ms(lambda: copy.copy_(x), args.iters)
        shape = {"rows": args.rows, "d": d}
        print(json.dumps({"bench": "rmsnorm", "impl": "copy", "pass": "copy", "shape": shape, "ms_median": ms,
                          "gbps": 2 * nbytes / (ms * 1e-3) / 1e9}), flush=True)
        for name, fn in (("torch_compile", compiled), ("torch_eager", rmsnorm)):
            with torch.no_grad():
                ms = median_ms(lambda: fn(x, w), args.iters)
            print(json.dumps({"bench": "rmsnorm", "impl": name, "pass": "forward", "shape": shape, "ms_median": ms,
                              "gbps": 2 * nbytes / (ms * 1e-3) / 1e9}), flush=True)
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            y = fn(xg, wg)
            ms = median_ms(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True), args.iters)
            print(json.dumps({"bench": "rmsnorm", "impl": name, "pass": "backward", "shape": shape, "ms_median": ms,
                              "gbps": 3 * nbytes / (ms * 1e-3) / 1e9}), flush=True)


if __name__ == "__main__":
    main()
