#!/usr/bin/env python3
"""The PyTorch peer of `kiln train`: by default on the CPU for `--preset small` (issue 3's CPU
benchmark); with --device cuda on the GPU, in bf16 autocast on f32 weights as kiln trains there,
eager or torch.compile'd (--compile), with fused AdamW (scripts/bench_train_gpu.sh runs it at the
shapes of kiln's GPU presets).

Builds the same Llama as kiln's `small` preset (kiln/train/config.cpp, kiln/nn/llama.cpp):
hidden 128, 4 layers, 4 heads, 2 kv heads (GQA), SwiGLU 352, RMSNorm (eps 1e-5), RoPE (theta
1e4, rotate-half), byte vocabulary of 259, untied lm_head, no biases, init normal(0, 0.02),
norms ones; batch 8 x seq 128; AdamW (lr 2e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
matrices only), warmup + cosine (5% warmup, min lr 0.1 x), gradient clipping at 1.0; the loss
is the mean cross-entropy over the next tokens. Data: random byte windows (seeded); with
--data FILE, random windows of FILE tokenized as kiln's byte tokenizer does it (one document:
<bos>=256, the bytes, <eos>=257), from the training split (the last --val-fraction of the
tokens, at least seq+1, are kiln's validation split and never drawn), so the loss curve is
comparable with `kiln train --data FILE` (the windows are drawn by a different generator).
Trains --warmup steps untimed, then --steps timed steps, and prints one JSON line:
  {"impl": "torch", "threads": T, "tokens_per_s": ..., ...}  (on cuda also "peak_bytes")
Needs torch (a benchmark peer, not a kiln dependency).
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_tables(seq, dim, theta):
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [D/2]
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    emb = torch.cat((ang, ang), dim=-1)  # [T, D]
    return emb.cos().float(), emb.sin().float()


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h, self.hkv, self.d = a.heads, a.kv_heads, a.hidden // a.heads
        self.q_proj = nn.Linear(a.hidden, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(a.hidden, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(a.hidden, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, a.hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        q = (q * cos + rotate_half(q) * sin).to(v.dtype)  # bf16 under autocast, as v (SDPA wants one dtype)
        k = (k * cos + rotate_half(k) * sin).to(v.dtype)
        rep = self.h // self.hkv  # query head i uses kv head i // rep, as kiln's repeat_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
        self.up_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, a.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.checkpoint = a.checkpoint
        self.norm = RMSNorm(a.hidden, a.norm_eps)
        self.lm_head = None if a.tie else nn.Linear(a.hidden, a.vocab, bias=False)
        cos, sin = rope_tables(a.seq, a.hidden // a.heads, a.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for m in self.modules():  # Llama's initialisation, as kiln: every Linear and the embedding N(0, std)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=a.init_std)

    def forward(self, ids):
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.embed_tokens(ids)
        for layer in self.layers:
            if self.checkpoint:  # torch.utils.checkpoint per block, as kiln's --checkpoint-activations block
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        h = self.norm(h)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w)


def lr_at(step, a, total):
    """kiln's LrSchedule: linear warmup, then cosine from lr to lr * min_lr_ratio."""
    warm = max(1, total // 20)
    if step < warm:
        return a.lr * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    lo = a.lr * a.min_lr_ratio
    return lo + 0.5 * (a.lr - lo) * (1 + math.cos(math.pi * p))


BOS, EOS = 256, 257  # kiln's ByteTokenizer::kBos, kEos


def load_tokens(path, seq, val_fraction):
    """kiln's token stream of one file (<bos> bytes <eos>) and the end of its training split."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        sys.exit(f"bench_train_torch: {path} is empty")
    tokens = torch.cat((torch.tensor([BOS]), torch.frombuffer(bytearray(data), dtype=torch.uint8).long(),
                        torch.tensor([EOS])))
    val = int(len(tokens) * val_fraction)
    if val_fraction > 0:
        val = max(val, seq + 1)
    if len(tokens) < val + seq + 1:
        sys.exit(f"bench_train_torch: {path} has {len(tokens)} tokens, too few for seq {seq} with a validation split")
    return tokens, len(tokens) - val


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="CPU threads (required on the CPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model (cuda)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=352)
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--checkpoint", action="store_true",
                   help="recompute each block's activations in the backward (torch.utils.checkpoint)")
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embedding (small: untied)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", help="train on this text file (kiln's byte tokenization) instead of random bytes")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out tail of --data (kiln's default)")
    a = p.parse_args()

    cuda = a.device == "cuda"
    if not cuda and a.threads is None:
        p.error("--threads is required on the CPU")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Llama(a).to(a.device)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    run_model = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(a.seed + 1)
    corpus = None
    if a.data:
        corpus, train_end = load_tokens(a.data, a.seq, a.val_fraction)
        offsets = torch.arange(a.seq + 1)
    total = a.warmup + a.steps
    params = list(model.parameters())
    nparams = sum(q.numel() for q in params)
    model.train()

    def step(i):
        if corpus is None:
            window = torch.randint(0, 256, (a.batch, a.seq + 1), generator=gen)  # random bytes
        else:  # starts in [0, train_end - seq - 1], as kiln's window sampler
            starts = torch.randint(0, train_end - a.seq, (a.batch, 1), generator=gen)
            window = corpus[starts + offsets]
        ids, targets = window[:, :-1].to(a.device), window[:, 1:].to(a.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, a, total)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # kiln: bf16 on f32 weights
            logits = run_model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.clip > 0:  # 0: no clipping, as kiln's --clip 0 (clip_grad_norm_ at 0 would zero every gradient)
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        return loss.item()

    first = None
    for i in range(a.warmup):
        first = step(i)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = None
    for i in range(a.warmup, total):
        loss = step(i)
        first = loss if first is None else first
    dt = time.perf_counter() - t0
    tokens = a.steps * a.batch * a.seq
    rec = {"impl": "torch_compile" if a.compile else "torch", "device": a.device, "threads": a.threads,
           "tokens_per_s": tokens / dt, "steps": a.steps, "warmup_steps": a.warmup, "batch": a.batch, "seq": a.seq,
           "parameters": nparams, "checkpoint": a.checkpoint, "first_loss": first, "final_loss": loss, "data": a.data or "random bytes",
           "torch": torch.__version__}
    if cuda:
        rec["peak_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
