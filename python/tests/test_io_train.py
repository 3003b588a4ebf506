# kiln.load / kiln.save_safetensors against the safetensors package (every dtype, metadata, the
# bits), kiln.telemetry.sample, kiln.train in-process with a callback per logged step (and a
# callback that raises), kiln.config, and kiln.generate from the trained checkpoint.
import json
import os

import numpy as np
import pytest

import kiln

ml_dtypes = pytest.importorskip("ml_dtypes")


def sample_tensors(rng):
    return {
        "f64": rng.standard_normal((3, 4)),
        "f32": rng.standard_normal((5,)).astype(np.float32),
        "f16": rng.standard_normal((2, 3)).astype(np.float16),
        "bf16": rng.standard_normal((7, 2)).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-(1 << 40), 1 << 40, (4,)),
        "i32": rng.integers(-1000, 1000, (2, 2)).astype(np.int32),
        "i16": rng.integers(-1000, 1000, (3,)).astype(np.int16),
        "i8": rng.integers(-100, 100, (3,)).astype(np.int8),
        "u8": rng.integers(0, 255, (6,)).astype(np.uint8),
        "bool": rng.random((4,)) < 0.5,
        "scalar": np.array(2.5, np.float32),
        "strided": rng.standard_normal((6, 8)).astype(np.float32)[::2, 1::3],
    }


def test_save_and_load_every_dtype_bit_exact(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    tensors = sample_tensors(rng)
    path = tmp_path / "t.safetensors"
    kiln.save_safetensors(path, tensors, metadata={"format": "np", "note": "kiln"})
    got = kiln.load(path)
    assert sorted(got) == sorted(tensors)
    for name, a in tensors.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(np.atleast_1d(got[name]).view(np.uint8), np.atleast_1d(np.ascontiguousarray(a)).view(np.uint8))
    assert kiln._io.load_metadata(path) == {"format": "np", "note": "kiln"}
    # the reference reader agrees (bf16 through its raw bytes)
    ref = st.load_file(str(path))
    for name, a in tensors.items():
        if name != "bf16":
            np.testing.assert_array_equal(ref[name], a)
    # and kiln reads what the reference writes
    ref_path = tmp_path / "ref.safetensors"
    st.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items() if k != "bf16"}, str(ref_path))
    again = kiln.load(ref_path)
    np.testing.assert_array_equal(again["i64"], tensors["i64"])


def test_load_is_a_view_of_the_mapping_unless_copied(tmp_path, rng):
    a = rng.standard_normal((64, 64)).astype(np.float32)
    path = tmp_path / "v.safetensors"
    kiln.save_safetensors(path, {"a": a})
    view = kiln.load(path)["a"]
    assert not view.flags.owndata
    k = kiln.load(path, format="kiln")["a"]
    assert isinstance(k, kiln.Tensor) and k.shape == [64, 64]
    view[0, 0] = 123.0  # copy-on-write: the file is unchanged
    np.testing.assert_array_equal(kiln.load(path)["a"], a)
    owned = kiln.load(path, copy=True)["a"]
    np.testing.assert_array_equal(owned, a)


def test_io_errors_are_clear(tmp_path):
    with pytest.raises(kiln.KilnError, match="missing.safetensors"):
        kiln.load(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(kiln.KilnError):
        kiln.load(bad)
    with pytest.raises(TypeError, match="names must be str"):
        kiln.save_safetensors(tmp_path / "x.safetensors", {1: np.zeros(2)})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        kiln.save_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2)}, metadata={"a": 1})
    with pytest.raises(ValueError, match="format"):
        kiln.load(tmp_path / "x", format="jax")
    assert not (tmp_path / "x.safetensors").exists()


def test_telemetry_sample():
    s = kiln.telemetry.sample("cpu")
    assert s["device"] == "cpu" and s["memory_total_bytes"] > 0 and "kiln_peak_bytes" in s
    assert "cpu" in kiln.telemetry.devices()
    if not kiln.cuda_built():
        with pytest.raises(kiln.KilnError, match="cuda"):
            kiln.telemetry.sample("cuda:0")


def tiny(tmp_path, **kw):
    cfg = {"preset": "tiny", "steps": 4, "batch": 2, "seq": 32, "eval_every": 0, "sample_tokens": 0,
           "telemetry_every": 0, "out": str(tmp_path / "run")}
    cfg.update(kw)
    return cfg


def test_train_in_process_with_a_callback_then_generate(tmp_path):
    records = []
    summary = kiln.train(tiny(tmp_path), callback=records.append, progress=False, log_every=2)
    assert [r["step"] for r in records] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["tokens"] > 0 for r in records)
    assert summary["steps_done"] == 4 and len(summary["losses"]) == 4
    assert os.path.isdir(summary["checkpoint"])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4]
    text = kiln.generate(tmp_path / "run", "The ", max_tokens=8, seed=3)
    assert isinstance(text, str) and text == kiln.generate(tmp_path / "run", "The ", max_tokens=8, seed=3)
    with pytest.raises(kiln.KilnError, match="no checkpoint"):
        kiln.generate(tmp_path / "nothing", "x")


def test_train_config_file_overrides_and_errors(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('preset = "tiny"\nsteps = 3\n[model]\nhidden = 32\n')
    c = kiln.config(toml, lr=1e-3)
    assert (c["preset"], c["steps"], c["hidden"], c["lr"]) == ("tiny", 3, 32, 1e-3)
    with pytest.raises(kiln.KilnError, match="lr"):
        kiln.config({"lr": "fast"})
    with pytest.raises(kiln.KilnError, match="no_such_key"):
        kiln.config({"no_such_key": 1})
    with pytest.raises(TypeError, match="config must be"):
        kiln.train(42)


def test_a_callback_that_raises_stops_the_run_with_a_checkpoint(tmp_path):
    class Stop(Exception):
        pass

    def cb(record):
        if record["step"] == 2:
            raise Stop("enough")

    with pytest.raises(Stop, match="enough"):
        kiln.train(tiny(tmp_path, steps=50), callback=cb, progress=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2
    assert any(p.name.startswith("step-") for p in (tmp_path / "run").iterdir())


def test_optimizer_in_backward_from_python_gives_the_same_run(tmp_path):
    # kiln.train takes every config key; this one updates each parameter in the backward. The same
    # run (clip 0, the one it allows) with and without it: the same losses, bit for bit.
    a = kiln.train(tiny(tmp_path / "a", clip=0, deterministic=True), progress=False)
    b = kiln.train(tiny(tmp_path / "b", clip=0, deterministic=True, optimizer_in_backward=True), progress=False)
    assert a["losses"] == b["losses"]
    with pytest.raises(kiln.KilnError, match="needs clip=0"):
        kiln.train(tiny(tmp_path / "c", optimizer_in_backward=True), progress=False)
