"""kiln.load and kiln.save_safetensors: kiln's checkpoint readers and writer for numpy and
torch users (docs/formats.md has the formats' rules)."""
import os

from . import _C
from ._C import KilnError, Tensor
from ._dlpack import from_dlpack, to_numpy

_FORMATS = ("numpy", "torch", "kiln")


def _out(t, fmt):
    if fmt == "kiln":
        return t
    if fmt == "numpy":
        return to_numpy(t)
    import torch
    return torch.from_dlpack(t)


def load(path, *, format="numpy", copy=False):
    """Reads a checkpoint (safetensors, a sharded Hugging Face index or folder, a PyTorch .pt/.bin
    through kiln's restricted unpickler, which never runs code from the file) into a dict
    name -> array: numpy arrays (``format="numpy"``, bf16 through ml_dtypes), torch tensors
    (``"torch"``) or kiln.Tensors (``"kiln"``).

    safetensors tensors are zero-copy views of the file's memory mapping (copy-on-write: writing
    to them never changes the file); ``copy=True`` gives owned copies instead, so the file may be
    rewritten while they live. The safetensors metadata is in ``load_metadata``.
    """
    if format not in _FORMATS:
        raise ValueError(f"kiln.load: format={format!r} is not one of {', '.join(_FORMATS)}")
    tensors, _ = _C.load(os.fspath(path))
    return {name: _out(t.clone() if copy else t, format) for name, t in tensors}


def load_metadata(path):
    """The string -> string metadata of a safetensors file ({} for other formats)."""
    return dict(_C.load(os.fspath(path))[1])


def save_safetensors(path, tensors, metadata=None):
    """Writes `tensors` (a dict name -> numpy array, torch tensor or kiln.Tensor) as one
    safetensors file, atomically (a temporary file renamed into place), with optional
    string -> string `metadata`. Tensors on a GPU are copied to the host as they are written."""
    if not isinstance(tensors, dict):
        raise TypeError(f"kiln.save_safetensors: tensors must be a dict name -> tensor, got {type(tensors).__name__}")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"kiln.save_safetensors: tensor names must be str, got {name!r}")
        if not isinstance(t, Tensor):
            if getattr(t, "requires_grad", False):
                t = t.detach()
            t = from_dlpack(t)
        items.append((name, t))
    meta = {} if metadata is None else dict(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"kiln.save_safetensors: metadata must map str to str, got {k!r}: {v!r}")
    _C.save_safetensors(os.fspath(path), items, meta)
