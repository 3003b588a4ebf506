#!/usr/bin/env python3
"""Checks kiln's Llama against Hugging Face transformers, both ways (run on the GPU machine,
which has torch + transformers + safetensors; everything runs on CPU in float32).

1. HF -> kiln: builds a tiny random LlamaForCausalLM (GQA, untied and tied), saves it with
   save_pretrained (single file, and sharded with a small max_shard_size), runs
   `kiln eval --ckpt DIR --ids ... --logits-out F` and compares with transformers' logits.
2. kiln -> HF: trains a tiny kiln model for a few steps (`kiln train --preset tiny`), loads the
   checkpoint with LlamaForCausalLM.from_pretrained and compares logits with kiln's.

usage: scripts/hf_interop.py [--kiln build/cpu/kiln] [--out DIR]
Prints one JSON object per case and exits non-zero when any case differs by more than --tol.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM


def kiln_logits(kiln, ckpt, ids, out_dir, name):
    path = os.path.join(out_dir, name + ".logits.safetensors")
    subprocess.run([kiln, "eval", "--ckpt", ckpt, "--ids", ",".join(map(str, ids)), "--logits-out", path],
                   check=True, stdout=subprocess.DEVNULL)
    return load_file(path)["logits"].double()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.double()


def report(case, a, b, tol):
    diff = (a - b).abs().max().item()
    ok = diff <= tol * max(1.0, b.abs().max().item())
    print(json.dumps({"case": case, "max_abs_diff": diff, "max_abs_logit": b.abs().max().item(), "ok": ok}))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="build/cpu/kiln")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="kiln_hf_")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    ok = True
    ids = [1, 17, 42, 5, 99, 3, 250, 7, 11]

    for tied in (False, True):
        cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                          attn_implementation="eager", torch_dtype=torch.float32)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # larger weights than the default init, so differences show
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        ref = hf_logits(model, ids)
        for shard in (None, "20KB"):
            d = os.path.join(out, f"hf_tied{int(tied)}_{'sharded' if shard else 'single'}")
            kw = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(d, safe_serialization=True, **kw)
            ok &= report(f"hf->kiln tied={tied} {'sharded' if shard else 'single'}",
                         kiln_logits(a.kiln, d, ids, out, os.path.basename(d)), ref, a.tol)

    run = os.path.join(out, "kiln_run")
    subprocess.run([a.kiln, "train", "--preset", "tiny", "--steps", "20", "--out", run, "--overwrite", "--sample-tokens", "0",
                    "--eval-every", "0"], check=True, stderr=subprocess.DEVNULL)
    with open(os.path.join(run, "latest")) as f:
        ckpt = os.path.join(run, f.read().strip())
    model = LlamaForCausalLM.from_pretrained(ckpt, attn_implementation="eager", torch_dtype=torch.float32).eval()
    ok &= report("kiln->hf", kiln_logits(a.kiln, ckpt, ids, out, "kiln"), hf_logits(model, ids), a.tol)

    # trained on a token file (kiln tokenize, vocabulary 512 recorded in its sidecar): config.json says 512
    tf = os.path.join(out, "tokens.bin")
    subprocess.run([a.kiln, "tokenize", "--tokenizer", "byte", "README.md", "--vocab", "512", "--out", tf], check=True,
                   stderr=subprocess.DEVNULL)
    run = os.path.join(out, "kiln_run_tokens")
    subprocess.run([a.kiln, "train", "--preset", "tiny", "--steps", "20", "--out", run, "--overwrite", "--data", tf,
                    "--sample-tokens", "0", "--eval-every", "0"], check=True, stderr=subprocess.DEVNULL)
    with open(os.path.join(run, "latest")) as f:
        ckpt = os.path.join(run, f.read().strip())
    model = LlamaForCausalLM.from_pretrained(ckpt, attn_implementation="eager", torch_dtype=torch.float32).eval()
    if model.config.vocab_size != 512:
        print(json.dumps({"case": "kiln->hf token file", "vocab_size": model.config.vocab_size, "ok": False}))
        ok = False
    ok &= report("kiln->hf token file", kiln_logits(a.kiln, ckpt, ids, out, "kiln_tokens"), hf_logits(model, ids),
                 a.tol)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
