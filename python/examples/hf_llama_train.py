#!/usr/bin/env python3
"""Trains Hugging Face transformers' LlamaForCausalLM on a text file's bytes, with kiln's
FlexAttention as its attention implementation and kiln's fused linear + cross-entropy as its
loss (--kiln), or unmodified (sdpa attention, transformers' loss): the loss curve, tokens/s and
peak memory, one JSON object per run on stdout (bench, impl, device, shape, dtype, ms_median
per step, peak_bytes, tokens_per_s, losses). --vocab V > 256 gives the model a V-token embedding
and head while the ids stay the text's bytes: a throughput and memory benchmark at a real
vocabulary's head (where the fused loss matters), not a tokenizer.

  PYTHONPATH=build/cpu/python python3 python/examples/hf_llama_train.py --data ../shared/data/tinyshakespeare.txt
  PYTHONPATH=build/cuda/python python3 python/examples/hf_llama_train.py --device cuda --dtype bf16 \\
      --hidden 1024 --layers 8 --batch 8 --seq 1024 --steps 30 --impl kiln,reference
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers

import kiln
import kiln.hf


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a text file (trained on as bytes)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--vocab", type=int, default=256, help="model vocabulary (>= 256; the ids are bytes)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="kiln,reference", help="comma-separated: kiln, reference (unmodified)")
    a = ap.parse_args()
    if a.vocab < 256:
        raise SystemExit(f"--vocab must be at least 256 (the ids are the text's bytes), got {a.vocab}")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    data = torch.frombuffer(bytearray(open(a.data, "rb").read()), dtype=torch.uint8).long()
    kiln_device = str(torch.device(a.device))  # kiln's name of it, for its allocator's statistics
    kiln.hf.register()
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                                   attention_dropout=0.0, tie_word_embeddings=False)
    for impl in a.impl.split(","):
        torch.manual_seed(a.seed)
        model = transformers.LlamaForCausalLM(cfg).to(device=a.device, dtype=dtype)
        model.config._attn_implementation = "kiln" if impl == "kiln" else "sdpa"
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        g = torch.Generator().manual_seed(a.seed)
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            kiln.reset_peak_memory_stats(kiln_device)
        losses, times = [], []
        for _ in range(a.steps):
            starts = torch.randint(0, len(data) - a.seq - 1, (a.batch,), generator=g)
            ids = torch.stack([data[s:s + a.seq] for s in starts]).to(a.device)
            t0 = time.perf_counter()
            loss = (kiln.hf.causal_lm_loss(model, ids) if impl == "kiln" else model(input_ids=ids, labels=ids).loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # synchronises
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:] if len(times) > 1 else times) * 1e3
        peak = None
        if a.device.startswith("cuda"):  # torch's allocator, plus kiln's (which torch's statistics do not see)
            peak = torch.cuda.max_memory_allocated() + kiln.memory_stats(kiln_device)["peak_bytes"]
        print(json.dumps({"bench": "hf_llama_train", "impl": impl, "device": a.device,
                          "shape": {"batch": a.batch, "seq": a.seq, "hidden": a.hidden, "layers": a.layers,
                                    "vocab": a.vocab},
                          "dtype": a.dtype, "ms_median": ms, "peak_bytes": peak,
                          "tokens_per_s": a.batch * a.seq / (ms * 1e-3), "losses": losses}))
        print(f"{impl:10} {ms:9.1f} ms/step  {a.batch * a.seq / (ms * 1e-3):10.0f} tokens/s  loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()
