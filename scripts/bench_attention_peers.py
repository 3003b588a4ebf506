#!/usr/bin/env python3
"""Peers for `kiln bench attention`: torch.compile'd flex_attention and SDPA on the GPU, at the
same shapes and masks, printing one JSON line per implementation in kiln's format (bench, impl,
device, shape, dtype, mask, backward, ms_median, peak_bytes (torch's allocator, plus kiln's for
kiln_torch), tflops on unmasked pairs; with
--backward also bwd_ms_median and bwd_tflops, the backward alone timed after untimed forwards).
SDPA runs dense causal for causal/window/document masks (is_causal=True), as in the issue's
anchors. --score-mod softcap:C|alibi (as `kiln bench attention --score-mod`) gives torch's
flex_attention that score_mod and skips SDPA, which has none. --impls kiln_torch adds kiln's
Python module inside the same torch step (`kiln.torch.flex_attention` through torch's autograd,
on torch's stream): the library's mods by name, and the docwindow mask as the same Python
mask_mod torch's flex_attention gets, traced into a run-time mod (needs kiln's module on
PYTHONPATH, e.g. build/cuda/python).
Usage: bench_attention_peers.py --seq 32768 --heads 16 --head-dim 128 --mask window:256 --backward
       [--impls torch_flex,torch_sdpa,kiln_torch]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def count_pairs(mask, L):
    idx = torch.arange(L, dtype=torch.float64)
    causal = idx + 1
    if mask == "none":
        return float(L * L)
    if mask == "causal":
        return float(causal.sum())
    kind, n = mask.split(":")[:2]
    n = int(n)
    if kind == "window":
        return float(torch.clamp(causal, max=n).sum())
    if kind == "document":
        return float((idx - (idx // n) * n + 1).sum())
    if kind == "docwindow":  # docwindow:N:W, causal in N-token documents and at most W tokens back
        n, w = (int(x) for x in mask.split(":")[1:])
        return float(torch.clamp(idx - (idx // n) * n + 1, max=w).sum())
    raise SystemExit(f"bad mask {mask}")


def mask_mod_for(mask):
    if mask == "none":
        return None
    if mask == "causal":
        return lambda b, h, q, kv: q >= kv
    kind, n = mask.split(":")[:2]
    n = int(n)
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < n)
    if kind == "docwindow":
        w = int(mask.split(":")[2])
        return lambda b, h, q, kv: (q >= kv) & (q // n == kv // n) & (q - kv < w)
    return lambda b, h, q, kv: (q >= kv) & (q // n == kv // n)


def score_mod_for(spec, heads):
    """torch's score_mod for kiln's --score-mod spec (None for 'none')."""
    if spec == "none":
        return None
    if spec.startswith("softcap:"):
        cap = float(spec.split(":", 1)[1])
        if not cap > 0:
            raise SystemExit(f"--score-mod softcap:C needs a positive C, got {spec!r}")
        return lambda s, b, h, q, kv: cap * torch.tanh(s / cap)
    if spec == "alibi":  # the paper's geometric slopes, as kiln's alibi_slopes
        start = 2.0 ** (-8.0 / heads)
        slopes = torch.tensor([start ** (i + 1) for i in range(heads)], device="cuda", dtype=torch.float32)
        return lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
    raise SystemExit(f"--score-mod must be none, softcap:C or alibi, got {spec!r}")


def kiln_torch_impl(mask, spec, S, heads):
    """kiln.torch.flex_attention for the same mask and score_mod: the library's mods by name where
    kiln has them, else (docwindow) torch's own Python mask_mod, traced by kiln."""
    import kiln.torch as kt
    if mask == "none":
        mm = None
    elif mask == "causal":
        mm = kt.mods.causal
    elif mask.startswith("window:"):
        mm = kt.mods.sliding_window(int(mask.split(":")[1]))
    elif mask.startswith("document:"):
        n = int(mask.split(":")[1])
        mm = kt.mods.document((torch.arange(S) // n).to(torch.int32))
    else:
        mm = mask_mod_for(mask)
    bm = kt.create_block_mask(mm, None, None, S, S, device="cuda") if mm is not None else None
    if spec == "none":
        sm = None
    elif spec.startswith("softcap:"):
        sm = kt.mods.softcap(float(spec.split(":", 1)[1]))
    else:
        sm = kt.mods.alibi
    return lambda q, k, v: kt.flex_attention(q, k, v, score_mod=sm, block_mask=bm)


def kiln_peak(name):
    """kiln's allocator's peak on the GPU for kiln_torch (torch's statistics do not see it), else 0."""
    return sys.modules["kiln"].memory_stats("cuda:0")["peak_bytes"] if name == "kiln_torch" else 0


def time_ms(fn, iters, warmup=0, prepare=None):
    """Median ms of fn between two CUDA events, after `warmup` untimed calls; with `prepare`,
    each timed call is fn(prepare()), prepare's work untimed."""
    for _ in range(warmup):
        fn(prepare() if prepare else None)
    ts = []
    for _ in range(iters):
        x = prepare() if prepare else None
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mask", default="causal")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--score-mod", default="none")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--impls", default="torch_flex,torch_sdpa", help="comma-separated: torch_flex, torch_sdpa, kiln_torch")
    a = ap.parse_args()
    wanted = a.impls.split(",")
    for name in wanted:
        if name not in ("torch_flex", "torch_sdpa", "kiln_torch"):
            raise SystemExit(f"--impls: unknown implementation {name!r} (torch_flex, torch_sdpa, kiln_torch)")
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    B, H, S, D = a.batch, a.heads, a.seq, a.head_dim
    q, k, v, g = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(4))
    mm = mask_mod_for(a.mask)
    bm = create_block_mask(mm, None, None, S, S, device="cuda") if mm else None
    flex = torch.compile(flex_attention)
    causal = a.mask != "none"
    sm = score_mod_for(a.score_mod, H)
    impls = {}
    if "torch_flex" in wanted:
        impls["torch_flex"] = lambda q, k, v: flex(q, k, v, score_mod=sm, block_mask=bm)
    if sm is None and "torch_sdpa" in wanted:
        impls["torch_sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if "kiln_torch" in wanted:
        impls["kiln_torch"] = kiln_torch_impl(a.mask, a.score_mod, S, H)
    shape = f"B={B},H={H},S={S},D={D}"
    for name, f in impls.items():
        def forward():
            qq, kk, vv = (t.detach().requires_grad_(a.backward) for t in (q, k, v))
            return f(qq, kk, vv)

        def once(_):
            out = forward()
            if a.backward:
                out.backward(g)
        torch.cuda.reset_peak_memory_stats()
        if name == "kiln_torch":
            sys.modules["kiln"].reset_peak_memory_stats("cuda:0")
        ms = time_ms(once, a.iters, a.warmup)
        # The pairs this implementation computes (SDPA: dense causal, or all of them) times D.
        mask = a.mask if name != "torch_sdpa" else ("causal" if causal else "none")
        pairs_d = count_pairs(mask, S) * B * H * D
        rec = {"bench": "attention", "impl": name, "device": "cuda", "shape": shape, "dtype": a.dtype,
               "mask": mask, "backward": a.backward, "ms_median": ms,
               "peak_bytes": torch.cuda.max_memory_allocated() + kiln_peak(name),
               "tflops": pairs_d * (14.0 if a.backward else 4.0) / (ms * 1e-3) / 1e12}
        if a.backward:
            bwd = time_ms(lambda out: out.backward(g), a.iters, prepare=forward)
            rec["bwd_ms_median"] = bwd
            rec["bwd_tflops"] = pairs_d * 10.0 / (bwd * 1e-3) / 1e12
        if sm is not None:
            rec["score_mod"] = a.score_mod
        print(json.dumps(rec), flush=True)
        print(f"{name:12s} {shape:28s} {a.mask:14s} {ms:10.3f} ms {rec['tflops']:8.1f} TFLOP/s", file=sys.stderr)


if __name__ == "__main__":
    main()
