#!/usr/bin/env python3
"""The peers of `kiln bench lce` on the GPU: PyTorch eager, torch.compile, Liger-Kernel's and
Cut Cross-Entropy's fused losses, forward + backward at the same shapes, printed as the same
JSON lines (bench, impl, device, shape, dtype, ms_median, peak_bytes above the inputs, tflops,
loss; peak_bytes counts torch's allocator and, for kiln, kiln's own, whose memory torch's
statistics do not see). A peer that is not installed prints a record with "status": "not installed". The impl
"kiln" is kiln's Python module in the same torch step (`kiln.torch.linear_cross_entropy` through
torch's autograd, on torch's stream; kiln's module on PYTHONPATH, e.g. build/cuda/python).

usage: scripts/bench_lce_peers.py [--tokens 16384 --dim 4096 --vocab 128256 --dtype bf16]
                                  [--impls eager,compile,liger,cce,kiln] [--iters 20 --warmup 3]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--impls", default="eager,compile,liger,cce")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shape = {"tokens": a.tokens, "dim": a.dim, "vocab": a.vocab}
    base = {"bench": "lce", "device": "cuda:0", "shape": shape, "dtype": a.dtype}

    def emit(rec):
        print(json.dumps({**base, **rec}), flush=True)

    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        for impl in a.impls.split(","):
            emit({"impl": impl, "status": "not installed", "error": f"torch: {e}"})
        return 0
    if not torch.cuda.is_available():
        for impl in a.impls.split(","):
            emit({"impl": impl, "status": "no CUDA device"})
        return 0

    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    h = torch.randn(a.tokens, a.dim, device="cuda", generator=g).to(dt).requires_grad_()
    w = (torch.randn(a.vocab, a.dim, device="cuda", generator=g) / a.dim ** 0.5).to(dt).requires_grad_()
    t = torch.randint(0, a.vocab, (a.tokens,), device="cuda", generator=g)
    flops = 6.0 * a.tokens * a.vocab * a.dim

    def torch_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    def make(impl):
        if impl == "eager":
            return torch_loss
        if impl == "compile":
            return torch.compile(torch_loss)
        if impl == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            fn = LigerFusedLinearCrossEntropyLoss()
            return lambda h, w, t: fn(w, h, t)
        if impl == "kiln":
            import kiln.torch as kt
            return lambda h, w, t: kt.linear_cross_entropy(h, w, t)
        if impl == "cce":
            from cut_cross_entropy import linear_cross_entropy
            return lambda h, w, t: linear_cross_entropy(h, w, t)
        raise ValueError(f"unknown impl {impl}")

    for impl in a.impls.split(","):
        try:
            fn = make(impl)
        except ImportError as e:
            emit({"impl": impl, "status": "not installed", "error": str(e)})
            continue
        try:
            def step():
                h.grad = None
                w.grad = None
                loss = fn(h, w, t)
                loss.backward()
                return loss

            for _ in range(a.warmup):
                loss = step()
            torch.cuda.synchronize()
            times, peak = [], 0
            for _ in range(a.iters):
                h.grad = None
                w.grad = None
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if impl == "kiln":  # kiln's own allocator, which torch's statistics do not see
                    kiln = sys.modules["kiln"]
                    kiln.reset_peak_memory_stats("cuda:0")
                    kiln_before = kiln.memory_stats("cuda:0")["current_bytes"]
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                loss = step()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
                above = torch.cuda.max_memory_allocated() - before
                if impl == "kiln":  # two allocators: the sum of their peaks (an upper bound)
                    above += kiln.memory_stats("cuda:0")["peak_bytes"] - kiln_before
                peak = max(peak, above)
            times.sort()
            ms = times[len(times) // 2]
            emit({"impl": impl, "ms_median": ms, "peak_bytes": int(peak), "tflops": flops / (ms * 1e-3) / 1e12,
                  "iters": a.iters, "loss": float(loss.item())})
            print(f"{impl:10s} {ms:10.2f} ms {peak / 2**20:12.1f} MiB", file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            emit({"impl": impl, "status": "failed", "error": f"{type(e).__name__}: {e}"})
        h.grad = None
        w.grad = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
