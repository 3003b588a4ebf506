"""kiln.train (kiln's trainer in this process, with a callback per logged step) and
kiln.generate (sampling from a checkpoint); docs/training.md describes the settings."""
import json
import os

from . import _C


def _split(config, overrides):
    if config is None:
        return "", "", json.dumps(overrides) if overrides else ""
    if isinstance(config, dict):
        return json.dumps(config), "", json.dumps(overrides) if overrides else ""
    if isinstance(config, (str, os.PathLike)):
        return "", os.fspath(config), json.dumps(overrides) if overrides else ""
    raise TypeError(f"kiln.train: config must be a dict, a path to a .toml/.json file or None, got {type(config).__name__}")


def config(config=None, **overrides):
    """The complete, validated settings kiln.train(config, **overrides) would run, as a dict."""
    return json.loads(_C.config_json(*_split(config, overrides)))


def train(config=None, *, callback=None, progress=True, **overrides):
    """Runs kiln's trainer in this process, as ``kiln train`` does: the preset named by the
    config's "preset" (default "small"), then `config` (a dict of keys, or a .toml/.json file:
    keys are ``kiln train``'s flag names without dashes, e.g. lr, steps, out), then `overrides`
    (keyword arguments, the same keys).

    `callback(record)` is called with each metrics record as it is logged (a dict: step, loss,
    lr, grad_norm, tokens_per_s, ...; every ``log_every`` steps). An exception raised by the
    callback, or Ctrl-C, stops the run after that step with a checkpoint, then is raised here.
    `progress=False` silences the progress bar. Returns the run's summary as a dict.
    """
    cb = None if callback is None else (lambda text: callback(json.loads(text)))
    return _C.train(*_split(config, overrides), cb, bool(progress))


def generate(ckpt, prompt, *, max_tokens=200, temperature=0.8, top_k=40, top_p=0.95, seed=0, device="cpu",
             tokenizer=""):
    """Samples up to `max_tokens` tokens after `prompt` from a checkpoint (a checkpoint folder, or
    a run folder: its latest checkpoint), as ``kiln generate`` does. Returns the generated text
    (the prompt not included; bytes that are not UTF-8, which a byte-level model can sample, are
    replaced with U+FFFD). The same seed gives the same text."""
    text, _ids = _C.generate(os.fspath(ckpt), prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, device=device, tokenizer=tokenizer)
    return text.decode("utf-8", errors="replace")
