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

    # Through torch's autograd: kiln.torch's own backward, its parts timed by wrapping what it
    # calls (the stream scope, the graph's run, the DLPack hand-off back to torch).
    parts = {"scope": 0.0, "run": 0.0, "to_torch": 0.0}
    on_thread = []

    class TimedScope:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            t0 = time.perf_counter()
            self.inner.__enter__()
            parts["scope"] += time.perf_counter() - t0
            on_thread.append(threading.get_ident() != threading.main_thread().ident)

        def __exit__(self, *exc):
            t0 = time.perf_counter()
            self.inner.__exit__(*exc)
            parts["scope"] += time.perf_counter() - t0

    class TimedGraph:
        def __init__(self, inner):
            self.inner = inner

        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = self.inner.run(*args, **kwargs)
            parts["run"] += time.perf_counter() - t0
            return out

    def wrap_forward(ctx, *args):
        out = orig_forward(ctx, *args)
        ctx.graph = TimedGraph(ctx.graph)
        return out

    orig_scope, orig_t = ktm._scope, ktm._t

    def timed_to_torch(k):
        t0 = time.perf_counter()
        out = orig_t(k)
        parts["to_torch"] += time.perf_counter() - t0
        return out

    ktm._FlexAttentionFunction.forward = staticmethod(wrap_forward)
    for way, interval in (("autograd", sys.getswitchinterval()), ("autograd_switch", 1e-6)):
        old = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        rows = []
        for i in range(a.iters + 3):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = kt.flex_attention(qq, kk, vv, block_mask=bm)  # the forward, untimed
            for n in parts:
                parts[n] = 0.0
            ktm._scope, ktm._t = (lambda t: TimedScope(orig_scope(t))), timed_to_torch
            r = timed(lambda: out.backward(g))
            ktm._scope, ktm._t = orig_scope, orig_t
            if i >= 3:
                rows.append(r + tuple(parts[n] * 1e3 for n in parts))
        sys.setswitchinterval(old)
        inside = {f"inside_{n}_ms": round(statistics.median(r[2 + j] for r in rows), 4) for j, n in enumerate(parts)}
        report(way, rows, inside | {"on_device_thread": any(on_thread), "switch_interval_s": interval,
                                    "python_threads": threading.active_count()})
    ktm._FlexAttentionFunction.forward = staticmethod(orig_forward)

if __name__ == "__main__":
    main()
