"""kiln: the fused linear + cross-entropy, FlexAttention, checkpoint formats and the trainer of
the kiln engine, for numpy and PyTorch users (docs/python.md).

Tensors cross between kiln, numpy and torch through DLPack without copies:
``kiln.from_dlpack(x)`` takes a numpy array or a torch tensor, ``numpy.from_dlpack(t)`` and
``torch.from_dlpack(t)`` take a ``kiln.Tensor``. ``kiln.torch`` has the ops as
``torch.autograd.Function``s and ``torch.library`` custom ops.
"""
from . import _C
from ._C import (BlockMask, KilnError, Tensor, cuda_built, cuda_device_count, memory_stats, reset_peak_memory_stats,
                 synchronize)
from ._dlpack import from_dlpack, to_numpy
from ._io import load, save_safetensors
from ._train import config, generate, train
from . import telemetry

__version__ = _C.version()

__all__ = [
    "BlockMask", "KilnError", "Tensor", "config", "cuda_built", "cuda_device_count", "from_dlpack", "generate",
    "load", "memory_stats", "reset_peak_memory_stats", "save_safetensors", "synchronize", "telemetry", "to_numpy",
    "train",
]
