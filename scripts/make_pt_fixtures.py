#!/usr/bin/env python3
"""Writes the small PyTorch checkpoints kiln's .pt reader is tested on (tests/io/fixtures/).

Needs torch and safetensors (the GPU machine has both). For each checkpoint X.pt it writes
X.expected.safetensors holding what kiln::io::load(X.pt) must return: the same tensors,
flattened with dots (nested dicts and lists), made contiguous. legacy.pt is written in the
pre-1.6 pickle format, which kiln must refuse with an explanation.

    python3 scripts/make_pt_fixtures.py [OUT_DIR]   # default tests/io/fixtures
"""
import collections
import os
import sys

import torch
from safetensors.torch import save_file


def flatten(obj, prefix, out):
    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = obj.detach().contiguous().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, (str, int)):
                flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}.{i}" if prefix else str(i), out)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "io", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(20261130)

    # 1. every dtype kiln maps, plus views sharing one storage
    base = torch.randn(6, 5, generator=g)
    dtypes = collections.OrderedDict()
    for name, dt in [("f32", torch.float32), ("f64", torch.float64), ("f16", torch.float16),
                     ("bf16", torch.bfloat16), ("i64", torch.int64), ("i32", torch.int32),
                     ("i16", torch.int16), ("i8", torch.int8), ("u8", torch.uint8), ("bool", torch.bool)]:
        dtypes[name] = (base * 10).to(dt)
    dtypes["scalar"] = torch.tensor(2.5)
    dtypes["empty"] = torch.zeros(0, 3)
    dtypes["base"] = base
    dtypes["transposed"] = base.t()
    dtypes["row2"] = base[2]
    dtypes["col1"] = base[:, 1]
    dtypes["strided"] = base[1::2, ::2]
    dtypes["expanded"] = torch.randn(1, 4, generator=g).expand(3, 4)
    torch.save(dtypes, os.path.join(out_dir, "dtypes.pt"))
    written = [("dtypes", dtypes)]

    # 1b. 8-bit floats, separately: older torch versions cannot pickle them
    try:
        f8 = {"f8_e4m3": base.to(torch.float8_e4m3fn), "f8_e5m2": base.to(torch.float8_e5m2)}
        torch.save(f8, os.path.join(out_dir, "float8.pt"))
        written.append(("float8", f8))
    except Exception as e:  # noqa: BLE001
        print("float8 fixture skipped:", e)

    # 2. a module's state_dict nested in a training checkpoint, with parameters and non-tensors
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    ckpt = {"model": model.state_dict(), "step": 17, "name": "tiny",
            "params": [p for p in model.parameters()][:2], "extra": {"scale": torch.tensor([0.5, 2.0])}}
    torch.save(ckpt, os.path.join(out_dir, "checkpoint.pt"))
    # The same, as a Hugging Face-style .bin
    torch.save(model.state_dict(), os.path.join(out_dir, "pytorch_model.bin"))

    written += [("checkpoint", ckpt), ("pytorch_model", model.state_dict())]
    for name, obj in written:
        flat = {}
        flatten(obj, "", flat)
        save_file(flat, os.path.join(out_dir, f"{name}.expected.safetensors"))

    # 3. legacy (pre-zip) format
    torch.save({"w": torch.ones(2)}, os.path.join(out_dir, "legacy.pt"), _use_new_zipfile_serialization=False)
    for f in sorted(os.listdir(out_dir)):
        print(f, os.path.getsize(os.path.join(out_dir, f)))


if __name__ == "__main__":
    main()
