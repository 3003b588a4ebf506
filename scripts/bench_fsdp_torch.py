#!/usr/bin/env python3
"""The PyTorch FSDP2 peer of `kiln train --nproc N` (issue 33, runs 3 and 4): transformers'
LlamaForCausalLM with SDPA attention, `fully_shard` on every decoder layer and on the root,
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) over f32 sharded parameters, fused
AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices), gradient clipping at 1.0,
on uniform random token ids (seeded per rank), one GPU per rank.

Default shape (--preset llama1.5b): hidden 2048, 16 layers, 32 heads, 8 kv heads, SwiGLU 8192,
vocabulary 128256, untied, RoPE theta 500000, batch 4 x 2048 tokens per GPU (kiln's 1b preset
untied, as scripts/bench_train_gpu.sh llama1.5b). --preset tiny is a small shape for a CPU check:
  python3 scripts/bench_fsdp_torch.py --device cpu --preset tiny --nproc 2 --steps 2 --warmup 1
--preset kiln-tiny / kiln-small are kiln train's CPU presets (with --param-dtype f32, kiln's CPU
default, against `kiln train --preset tiny|small --nproc N`); peak_rss_bytes_per_rank is every
rank's peak resident set (getrusage).

Starts --nproc ranks itself (torch.multiprocessing, 127.0.0.1): NCCL with --device cuda
(cuda:<rank>), gloo with --device cpu. Trains --warmup untimed steps, then --steps timed ones, and
rank 0 prints one JSON line:
  {"bench": "fsdp", "impl": "torch_fsdp2", "world_size": N, "tokens_per_s_per_gpu": ...,
   "tokens_per_s": ..., "step_ms_median": ..., "peak_bytes": (the largest rank's), ...}
--separate-rs-group calls set_separate_reduce_scatter_group(True) where this torch has it
(2.13+; recorded as null when it does not). NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set). Needs torch and transformers (a benchmark
peer, not a kiln dependency).
"""
import argparse
import json
import statistics
import time

from dist_spawn import spawn_ranks

PRESETS = {
    "llama1.5b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, seq=2048, batch=4),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, seq=64, batch=2),
    # kiln train's CPU presets (kiln/train/config.cpp) with the byte tokenizer's 259 ids, untied
    "kiln-tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, vocab=259, seq=64, batch=8),
    "kiln-small": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=352, vocab=259, seq=128, batch=8),
}


def fsdp_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 - 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def build_model(a, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate, vocab_size=a.vocab,
                      max_position_embeddings=a.seq, rope_theta=a.rope_theta, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                      initializer_range=0.02, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(a.seed)  # the same initial weights on every rank before sharding
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model, cfg


def worker(rank, a, port):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = a.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(a.threads)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.nproc)
    mesh = init_device_mesh(dev.type, (a.nproc,))
    fully_shard, MixedPrecisionPolicy = fsdp_api()
    model, cfg = build_model(a, dev)
    pdt = torch.bfloat16 if a.param_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    separate = None
    if a.separate_rs_group:
        fn = getattr(model, "set_separate_reduce_scatter_group", None)
        if fn is not None:
            fn(True)
            separate = True
    n_params = sum(p.numel() for p in model.parameters())  # DTensors: the global sizes
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # a torch without fused AdamW on this device
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        fused = False
    gen = torch.Generator(device="cpu").manual_seed(a.seed + 1 + rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses, times = [], []
    for i in range(a.warmup + a.steps):
        if i == a.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time per step
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) if cuda else 0], dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    import resource  # every rank's peak resident set (Linux: ru_maxrss in KiB)
    rss = torch.zeros(a.nproc, dtype=torch.float64, device=dev)
    rss[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_reduce(rss, op=dist.ReduceOp.SUM)
    total = float(t.sum())
    tokens = a.batch * a.seq * a.steps
    if rank == 0:
        import transformers

        rec = {"bench": "fsdp", "impl": "torch_fsdp2", "torch": torch.__version__,
               "transformers": transformers.__version__, "device": dev.type, "backend": backend,
               "world_size": a.nproc, "preset": a.preset, "params": n_params,
               "shape": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
               "batch": a.batch, "seq": a.seq, "steps": a.steps, "warmup_steps": a.warmup,
               "tokens_per_s_per_gpu": tokens / total, "tokens_per_s": tokens * a.nproc / total,
               "step_ms_median": statistics.median(t.tolist()) * 1e3, "first_loss": losses[0],
               "final_loss": losses[-1], "fused_adamw": fused, "separate_reduce_scatter_group": separate,
               "param_dtype": a.param_dtype, "reduce_dtype": "f32", "threads": a.threads,
               "peak_rss_bytes_per_rank": [int(x) for x in rss.tolist()],
               "attn_implementation": getattr(model.config, "_attn_implementation", None)}
        if cuda:
            rec["peak_bytes"] = int(peak.item())
            rec["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        print(json.dumps(rec), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks (one GPU each with --device cuda)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="llama1.5b", choices=sorted(PRESETS))
    for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch"):
        p.add_argument("--" + k.replace("_", "-"), type=int, help=f"override the preset's {k}")
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (--device cpu)")
    p.add_argument("--param-dtype", default="bf16", choices=["bf16", "f32"],
                   help="MixedPrecisionPolicy's param_dtype (f32: as kiln train on the CPU)")
    p.add_argument("--separate-rs-group", action="store_true",
                   help="reduce-scatter on its own process group (torch 2.13's set_separate_reduce_scatter_group)")
    a = p.parse_args()
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.nproc < 1 or a.steps < 1 or a.warmup < 0:
        p.error(f"--nproc {a.nproc} and --steps {a.steps} must be >= 1, --warmup {a.warmup} >= 0")
    if a.heads % a.kv_heads or a.hidden % a.heads:
        p.error(f"--heads {a.heads} must divide --hidden {a.hidden} and be a multiple of --kv-heads {a.kv_heads}")
    spawn_ranks(worker, a, a.nproc, a.device, "bench_fsdp_torch")


if __name__ == "__main__":
    main()
