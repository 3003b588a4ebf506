#!/usr/bin/env python3
"""Where kiln.torch.flex_attention's backward spends host time under torch's autograd (issue 37).

The same backward graph is run four ways, each timed per call (host: perf_counter around the
call; GPU: CUDA events from before the call to after it), median of --iters calls:
  direct    graph.run on the main thread (the binding alone);
  thread    graph.run on a second Python thread (a worker fed through a queue);
  autograd  out.backward(g) through torch's engine (kiln.torch's autograd.Function), with the
            backward's own parts timed inside it (the stream scope, graph.run, the DLPack hand-off);
  autograd_switch  the same with sys.setswitchinterval(1e-6) (a GIL hand-off that waits for the
            interpreter's switch interval would shrink).
One JSON line per way. Usage (CUDA, torch installed, kiln's module on PYTHONPATH):
  diag_flex_autograd.py --seq 32768 --mask window:256 --iters 20
"""
import argparse
import json
import queue
import statistics
import sys
import threading
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mask", default="window:256", help="causal or window:N")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (a dry run of the script: no GPU span)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    import kiln.torch as kt
    ktm = sys.modules["kiln.torch"]
    S, H, D = a.seq, a.heads, a.head_dim
    mm = kt.mods.causal if a.mask == "causal" else kt.mods.sliding_window(int(a.mask.split(":")[1]))
    bm = kt.create_block_mask(mm, None, None, S, S, device=a.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    q, k, v, g = (torch.randn(1, H, S, D, device=a.device, dtype=dtype) for _ in range(4))

    def timed(fn):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3, 0.0
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        e1.record()
        torch.cuda.synchronize()
        return host * 1e3, e0.elapsed_time(e1)

    def report(way, rows, extra=None):
        host = statistics.median(r[0] for r in rows)
        gpu = statistics.median(r[1] for r in rows)
        rec = {"diag": "flex_autograd", "way": way, "seq": S, "mask": a.mask, "host_ms": round(host, 4),
               "span_ms": round(gpu, 4)}
        rec.update(extra or {})
        print(json.dumps(rec), flush=True)

    # A graph from kiln.torch's forward, its backward run directly.
    captured = {}
    orig_forward = ktm._FlexAttentionFunction.forward

    def capturing_forward(ctx, *args):
        out = orig_forward(ctx, *args)
        captured["graph"] = ctx.graph
        return out

    ktm._FlexAttentionFunction.forward = staticmethod(capturing_forward)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = kt.flex_attention(qq, kk, vv, block_mask=bm)
    graph = captured["graph"]
    ktm._FlexAttentionFunction.forward = staticmethod(orig_forward)
    gk = ktm._k(g)

    def run_direct():
        with ktm._scope(q):
            graph.run([gk, None], retain=True)

    for _ in range(3):
        run_direct()
    report("direct", [timed(run_direct) for _ in range(a.iters)])

    jobs, done = queue.Queue(), queue.Queue()

    def worker():
        while True:
            fn = jobs.get()
            if fn is None:
                return
            t0 = time.perf_counter()
            fn()
            done.put(time.perf_counter() - t0)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    inner = []

    def run_thread():
        jobs.put(run_direct)
        inner.append(done.get() * 1e3)

    for _ in range(3):
        run_thread()
    inner.clear()
    rows = [timed(run_thread) for _ in range(a.iters)]
    report("thread", rows, {"inner_host_ms": round(statistics.median(inner), 4)})
    jobs.put(None)

    # Through torch's autograd, with the backward's parts timed inside it.
    parts = {"scope": [], "run": [], "to_torch": [], "total": []}
    orig_backward = ktm._FlexAttentionFunction.backward

    def timed_backward(ctx, grad_out, grad_lse):
        t0 = time.perf_counter()
        scope = ktm._scope(ctx.device_tensor)
        scope.__enter__()
        t1 = time.perf_counter()
        dq, dk, dv = ctx.graph.run([ktm._k(grad_out), ktm._k(grad_lse)], retain=True)
        t2 = time.perf_counter()
        res = (ktm._t(dq), ktm._t(dk), ktm._t(dv), None, None, None, None, None)
        t3 = time.perf_counter()
        scope.__exit__(None, None, None)
        parts["scope"].append((t1 - t0) * 1e3)
        parts["run"].append((t2 - t1) * 1e3)
        parts["to_torch"].append((t3 - t2) * 1e3)
        parts["total"].append((time.perf_counter() - t0) * 1e3)
        parts["thread"] = threading.get_ident() != threading.main_thread().ident
        return res

    ktm._FlexAttentionFunction.backward = staticmethod(timed_backward)
    for way, interval in (("autograd", sys.getswitchinterval()), ("autograd_switch", 1e-6)):
        old = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        rows = []
        for i in range(a.iters + 3):
            for p in parts.values():
                if isinstance(p, list):
                    p.clear()
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = kt.flex_attention(qq, kk, vv, block_mask=bm)
            r = timed(lambda: out.backward(g))
            if i >= 3:
                rows.append(r + tuple(parts[n][0] for n in ("scope", "run", "to_torch", "total")))
        sys.setswitchinterval(old)
        report(way, rows, {f"inside_{n}_ms": round(statistics.median(r[2 + j] for r in rows), 4)
                           for j, n in enumerate(("scope", "run", "to_torch", "total"))}
               | {"on_device_thread": parts.get("thread"), "switch_interval_s": interval,
                  "python_threads": threading.active_count()})
    ktm._FlexAttentionFunction.backward = staticmethod(orig_backward)


if __name__ == "__main__":
    main()
