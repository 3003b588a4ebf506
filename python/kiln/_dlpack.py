"""DLPack both ways: kiln.from_dlpack (any producer: numpy, torch, ...; zero copy) and
kiln.to_numpy (a numpy view of a kiln.Tensor, bf16 and float8 through ml_dtypes)."""
from . import _C
from ._C import KilnError, Tensor

# Dtypes numpy has only through ml_dtypes, which numpy's DLPack does not carry: their bytes
# cross as same-size integers, named here by (ml_dtypes name, kiln dtype, integer carrier).
_ML_DTYPES = {"bfloat16": ("bf16", "int16"), "float8_e4m3fn": ("f8_e4m3", "uint8"), "float8_e5m2": ("f8_e5m2", "uint8")}
_KILN_TO_ML = {k: (name, carrier) for name, (k, carrier) in _ML_DTYPES.items()}
_KILN_CARRIER = {"int16": "i16", "uint8": "u8"}

_CUDA = 2


def _consumer_stream(device):
    """The stream kiln reads a CUDA producer's memory on (DLPack's `stream` argument)."""
    if device[0] != _CUDA:
        return None
    s = _C.current_stream(f"cuda:{device[1]}") if _C.has_streams else None
    return 1 if not s else s  # 1: the legacy default stream (DLPack's CUDA convention)


def from_dlpack(x, *, stream=None, copy=None):
    """A kiln.Tensor over the memory of `x` (a numpy array, a torch tensor, any object with
    ``__dlpack__``, or a DLPack capsule), without a copy unless ``copy=True``.

    On CUDA, `stream` is the stream kiln will read on (default: the one kiln launches on from
    this thread), which the producer orders its work before. Tensors that require grad are
    refused (as torch's DLPack does): pass ``x.detach()``.
    """
    if isinstance(x, Tensor):
        return x.clone() if copy else x
    if type(x).__name__ == "PyCapsule":
        return _C.from_capsule(x)
    if getattr(x, "requires_grad", False):
        raise KilnError("kiln.from_dlpack: the tensor requires grad, and DLPack carries no autograd history; pass "
                        "x.detach() (kiln.torch's ops take tensors that require grad and give their gradients)")
    dtype = getattr(x, "dtype", None)
    ml = _ML_DTYPES.get(getattr(dtype, "name", None)) if type(x).__module__ == "numpy" else None
    if ml is not None:  # numpy + ml_dtypes: the bytes as integers, then kiln's view of them
        t = from_dlpack(x.view(ml[1]), copy=copy)
        return t.view_as(ml[0])
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"kiln.from_dlpack: {type(x).__name__} has no __dlpack__ (expected a numpy array, a torch "
                        "tensor or another DLPack producer)")
    device = x.__dlpack_device__()
    s = stream if stream is not None else _consumer_stream(device)
    kwargs = {} if s is None else {"stream": s}
    try:
        cap = x.__dlpack__(max_version=(1, 1), copy=copy, **kwargs)
    except TypeError:  # a producer from before DLPack 1.0
        if copy:
            raise
        cap = x.__dlpack__(**kwargs)
    return _C.from_capsule(cap)


def to_numpy(t):
    """A numpy array over a CPU kiln.Tensor's memory (no copy); bf16 and float8 come as
    ml_dtypes arrays. A read-only tensor gives a read-only array."""
    import numpy as np
    if not isinstance(t, Tensor):
        raise TypeError(f"kiln.to_numpy: expected a kiln.Tensor, got {type(t).__name__}")
    if t.device != "cpu":
        raise KilnError(f"kiln.to_numpy: the tensor is on {t.device}; numpy arrays live on the CPU (t.to('cpu') copies)")
    ml = _KILN_TO_ML.get(t.dtype)
    if ml is None:
        return np.from_dlpack(t)
    try:
        import ml_dtypes
    except ImportError as e:
        raise KilnError(f"kiln.to_numpy: numpy has {t.dtype} only through the ml_dtypes package "
                        "(pip install ml_dtypes)") from e
    return np.from_dlpack(t.view_as(_KILN_CARRIER[ml[1]])).view(getattr(ml_dtypes, ml[0]))
