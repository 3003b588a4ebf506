"""kiln.torch: kiln's fused linear + cross-entropy and FlexAttention for PyTorch training loops
(docs/python.md).

- ``linear_cross_entropy(hidden, weight, target, ...)`` and ``LinearCrossEntropyLoss``: the
  output projection and the loss fused, never holding the N x V logits.
- ``flex_attention(q, k, v, score_mod=None, block_mask=None, ...)`` and ``create_block_mask``
  with the library's mods (``kiln.torch.mods``) or Python functions written as PyTorch's
  (``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)``), traced into
  kiln's run-time mod expressions and compiled by kiln's JIT (docs/jit.md).

In eager mode each op is a ``torch.autograd.Function`` that keeps kiln's autograd graph for
the backward (the fused loss computes its gradients in the forward, so its backward only
scales them). Under ``torch.compile`` the same calls go through ``torch.library`` custom ops
(``torch.ops.kiln.*``, with fake tensors), which the compiler treats as opaque; their backward
recomputes the forward. Tensors cross by DLPack without copies; on CUDA kiln's kernels run on
the caller's stream (``torch.cuda.current_stream()``).
"""
import contextlib
import functools
from typing import Optional, Tuple

import torch
from torch.utils import dlpack as _tdl

from .. import _C
from .._C import KilnError
from . import mods
from .mods import MaskMod, ScoreMod
from ._trace import float_literal, trace_mod

__all__ = ["BlockMask", "LinearCrossEntropyLoss", "create_block_mask", "flex_attention", "linear_cross_entropy", "mods",
           "synchronize"]


# The per-call conversions take torch's C entry points and pre-1.0 capsules (the fastest path);
# no stream synchronisation is needed: inside _scope both sides work on torch's current stream.
_to_capsule = getattr(torch._C, "_to_dlpack", None) or _tdl.to_dlpack
_from_capsule = getattr(torch._C, "_from_dlpack", None) or _tdl.from_dlpack


def _k(t):
    """torch -> kiln, zero copy (no autograd history crosses)."""
    return None if t is None else _C.from_capsule(_to_capsule(t))


def _t(k):
    """kiln -> torch, zero copy."""
    return None if k is None else _from_capsule(k.__dlpack__(stream=-1))


def _scope(t):
    """kiln's kernels on `t`'s CUDA device launch on the caller's current stream in this scope."""
    return _device_scope(t.device)


try:
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # a CPU-only torch, or one without it: torch.cuda.current_stream
    _raw_stream = None


def _device_scope(device):
    """kiln's kernels on a CUDA `device` (a torch.device) launch on the caller's current stream."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if not _C.has_streams:
        raise KilnError("kiln.torch: this build of kiln cannot run on the caller's CUDA stream (no kiln/core/stream.h)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # The raw handle (as Inductor's generated code reads it) where torch has it: no Stream object
    # built per call.
    stream = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream
    return _C.StreamScope(f"cuda:{index}", stream)


def synchronize(device=None):
    """Waits for kiln's work on `device` (default: torch's current CUDA device; nothing on the CPU)
    on the caller's current stream, and raises a range check that failed on the device (a target
    of linear_cross_entropy out of range) as KilnError. On CUDA that check does not stop the host:
    its failure is raised here or at kiln's next copy to the host, as a device-side assert of
    torch's is; ``torch.cuda.synchronize()`` waits but does not raise it."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _device_scope(device):
        _C.synchronize(f"cuda:{index}")


def _check_tensor(name, t, op):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


# ---------------------------------------------------------------- the fused loss

class _LinearCrossEntropyFunction(torch.autograd.Function):
    # Outputs: the loss, then the z-loss part and the lse when asked (`extras`).
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, opts, extras):
        need = ctx.needs_input_grad
        with _scope(hidden):
            loss, z, lse, graph = _C.linear_cross_entropy(
                _k(hidden), _k(weight), _k(target), bias=_k(bias), class_weight=_k(class_weight),
                hidden_grad=need[0], weight_grad=need[1], bias_grad=bias is not None and need[3],
                return_lse="lse" in extras, **opts)
            ctx.graph, ctx.device_tensor = graph, hidden
            if not extras:
                return _t(loss)
            out = (_t(loss),) + tuple(_t(z) if e == "z" else _t(lse) for e in extras)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad_loss, *_grad_extras):
        # The graph stays with ctx (torch frees ctx with its graph): retain_graph works as in torch.
        graph = ctx.graph
        if graph is None or grad_loss is None:
            return None, None, None, None, None, None, None
        with _scope(ctx.device_tensor):
            gh, gw, gb = graph.run([_k(grad_loss)], retain=True)
            return _t(gh), _t(gw), None, _t(gb), None, None, None


def _lce_options(ignore_index, reduction, label_smoothing, z_loss, softcap, num_items):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"kiln.torch.linear_cross_entropy: reduction={reduction!r} is not one of mean, sum, none")
    return dict(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                z_loss=float(z_loss), softcap=float(softcap), num_items=float(num_items))


_LCE_DEFAULTS = _lce_options(-100, "mean", 0.0, 0.0, 0.0, 0.0)


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=0.0, class_weight=None, num_items=0.0,
                         return_z_loss=False, return_lse=False):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without the N x V logits.

    hidden [N, d] or [B, T, d]; weight [V, d]; target [N] or [B, T] (int64 or int32); f32, bf16,
    f16 or f64 (16-bit inputs accumulate in f32). Options as ``F.cross_entropy`` (ignore_index,
    reduction, label_smoothing, class_weight = its `weight`) plus z_loss (s * lse^2 per token),
    softcap (softcap * tanh(logits / softcap)) and num_items (divide the summed loss by it: for
    gradient accumulation). Returns the loss, or (loss, z_loss part, lse) as asked.
    """
    op = "kiln.torch.linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        _check_tensor(name, t, op)
    opts = _lce_options(ignore_index, reduction, label_smoothing, z_loss, softcap, num_items)
    if torch.compiler.is_compiling():
        if return_lse:
            raise KilnError(f"{op}: return_lse is not available under torch.compile (the custom op gives loss and z_loss)")
        loss, z = torch.ops.kiln.linear_cross_entropy(hidden, weight, target, bias, class_weight, **opts)
        return (loss, z) if return_z_loss else loss
    extras = ("z",) * bool(return_z_loss) + ("lse",) * bool(return_lse)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                         (bias is not None and bias.requires_grad))):
        # Nothing to differentiate: the kernel call alone, without an autograd.Function (whose
        # apply costs more than a small call's kernel).
        with _scope(hidden):
            if opts == _LCE_DEFAULTS and bias is None and class_weight is None and not return_lse:
                # the defaults: no keyword arguments to convert
                loss, z, lse, _ = _C.linear_cross_entropy(_k(hidden), _k(weight), _k(target))
            else:
                loss, z, lse, _ = _C.linear_cross_entropy(_k(hidden), _k(weight), _k(target), bias=_k(bias),
                                                          class_weight=_k(class_weight), return_lse=return_lse,
                                                          **opts)
            if not extras:
                return _t(loss)
            return (_t(loss),) + tuple(_t(z) if e == "z" else _t(lse) for e in extras)
    return _LinearCrossEntropyFunction.apply(hidden, weight, target, bias, class_weight, opts, extras)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The output projection and the loss as a module: ``loss = module(hidden, target)``.

    Owns a weight [num_classes, in_features] initialised as ``nn.Linear``'s (and a bias when
    ``bias=True``), or uses `weight` (a tied Parameter such as the embedding's; its gradient
    accumulates there). Options as linear_cross_entropy.
    """

    def __init__(self, in_features=None, num_classes=None, bias=False, *, weight=None, ignore_index=-100,
                 reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=0.0, device=None, dtype=None):
        super().__init__()
        if weight is not None:
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise ValueError("kiln.torch.LinearCrossEntropyLoss: weight must be a 2-D tensor [V, d]")
            self.weight = weight
        else:
            if in_features is None or num_classes is None:
                raise ValueError("kiln.torch.LinearCrossEntropyLoss: give in_features and num_classes, or weight")
            lin = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
            self.weight = lin.weight
        self.bias = (torch.nn.Parameter(torch.zeros(self.weight.shape[0], device=self.weight.device,
                                                    dtype=self.weight.dtype)) if bias and weight is not None
                     else (lin.bias if bias else None))
        self.options = _lce_options(ignore_index, reduction, label_smoothing, z_loss, softcap, 0.0)

    def forward(self, hidden, target, num_items=0.0):
        return linear_cross_entropy(hidden, self.weight, target, self.bias, **dict(self.options, num_items=num_items))

    def extra_repr(self):
        v, d = self.weight.shape
        return f"in_features={d}, num_classes={v}, bias={self.bias is not None}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items() if k != "num_items")


# ---------------------------------------------------------------- FlexAttention

class BlockMask:
    """The block-sparse schedule of a library mask_mod for one (Q_LEN, KV_LEN), built once and
    reused every step (PyTorch's BlockMask, for kiln's mods)."""

    def __init__(self, mask_mod, q_len, kv_len, block_size, device, native, traced=None):
        self.mask_mod, self.q_len, self.kv_len = mask_mod, q_len, kv_len
        # the device as the mask's tensors name it ("cuda:0" for "cuda"), compared with the inputs' per call
        self.BLOCK_SIZE, self.device, self._native = block_size, torch.device(native.device), native
        self._traced = traced  # (expression, capture names, capture tensors) of a Python mask_mod

    @property
    def expression(self):
        """The run-time expression of a traced Python mask_mod (None for a library mask)."""
        return None if self._traced is None else self._traced[0]

    @property
    def shape(self):
        return (1, 1, self.q_len, self.kv_len)

    def sparsity(self):
        """Percentage of tiles skipped (as PyTorch's BlockMask.sparsity)."""
        return 100.0 * self._native.sparsity()

    def to_dense(self):
        """Tile classes [1, 1, nQ, nKV]: 0 skipped, 1 partial (the mask is evaluated), 2 full."""
        return _t(self._native.to_dense())

    def __repr__(self):
        return (f"kiln.torch.BlockMask({self.mask_mod!r}, Q_LEN={self.q_len}, KV_LEN={self.kv_len}, "
                f"BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.1f}%)")


def _native_mask(mask_mod, q_len, kv_len, block_size, device):
    ids = None if mask_mod.document_ids is None else _k(torch.as_tensor(mask_mod.document_ids))
    return _C.create_block_mask(mask_mod.kind, q_len, kv_len, window=mask_mod.window, prefix=mask_mod.prefix,
                                document_ids=ids, block_size=block_size, device=str(device))


def create_block_mask(mask_mod, B=None, H=None, Q_LEN=None, KV_LEN=None, device="cpu", BLOCK_SIZE=128, _compile=False):
    """A BlockMask for a library mask_mod (``kiln.torch.mods.causal``, ``sliding_window(256)``,
    ``prefix_lm(n)``, ``document(ids)``, ``noop_mask``). B and H are accepted as PyTorch's; the
    library's masks do not depend on them (the mask broadcasts)."""
    op = "kiln.torch.create_block_mask"
    if not isinstance(mask_mod, MaskMod) and not callable(mask_mod):
        raise TypeError(f"{op}: mask_mod must be a kiln.torch.mods mask or a function (b, h, q_idx, kv_idx), got "
                        f"{type(mask_mod).__name__}")
    if Q_LEN is None or KV_LEN is None:
        raise ValueError(f"{op}: Q_LEN and KV_LEN are required")
    device = torch.device(device)
    if not isinstance(mask_mod, MaskMod):
        # A Python mask_mod: traced once into an expression, its tiles classified by a JIT kernel.
        expr, names, tensors = trace_mod(mask_mod, "mask_mod")
        tensors = [t.detach().to(device) for t in tensors]
        with _device_scope(device):  # built on the caller's stream, where the attention will read it
            native = _C.create_runtime_block_mask(expr, names, [_k(t) for t in tensors], int(Q_LEN), int(KV_LEN),
                                                  block_size=int(BLOCK_SIZE), device=str(device))
        return BlockMask(mask_mod, int(Q_LEN), int(KV_LEN), int(BLOCK_SIZE), device, native, (expr, names, tensors))
    with _device_scope(device):
        native = _native_mask(mask_mod, int(Q_LEN), int(KV_LEN), int(BLOCK_SIZE), device)
    return BlockMask(mask_mod, int(Q_LEN), int(KV_LEN), int(BLOCK_SIZE), device, native)


def _score_args(score_mod, q):
    """(kind, cap, slopes as a torch tensor or None) of a library score_mod."""
    if score_mod is None:
        return "none", 0.0, None
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(f"kiln.torch.flex_attention: score_mod must be a kiln.torch.mods score mod, got "
                        f"{type(score_mod).__name__}")
    slopes = None
    if score_mod.kind == "alibi":
        slopes = score_mod.slopes if score_mod.slopes is not None else _t(_C.alibi_slopes(q.shape[1]))
        slopes = torch.as_tensor(slopes, dtype=torch.float32)
    return score_mod.kind, score_mod.cap, slopes


class _FlexAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, native_mask, score_kind, cap, slopes, scale):
        ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad
        with _scope(q):
            out, lse, graph = _C.flex_attention(_k(q), _k(k), _k(v), native_mask, score_mod=score_kind, softcap=cap,
                                                alibi_slopes=_k(slopes), scale=scale, return_lse=True,
                                                q_grad=need[0], k_grad=need[1], v_grad=need[2])
            ctx.graph, ctx.device_tensor = graph, q
            return _t(out), _t(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        graph = ctx.graph
        if graph is None or (grad_out is None and grad_lse is None):
            return (None,) * 8
        with _scope(ctx.device_tensor):
            dq, dk, dv = graph.run([_k(grad_out), _k(grad_lse)], retain=True)
            return _t(dq), _t(dk), _t(dv), None, None, None, None, None


class _RuntimeFlexFunction(torch.autograd.Function):
    # Inputs: q, k, v, the native RuntimeBlockMask (or None), the score expression, its capture
    # names and which learn, scale, then the captured tensors (their gradients come back).
    @staticmethod
    def forward(ctx, q, k, v, native_mask, expr, names, learn, scale, *caps):
        ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad
        learn = [bool(l and need[8 + i]) for i, l in enumerate(learn)]
        with _scope(q):
            out, lse, graph = _C.flex_attention_runtime(
                _k(q), _k(k), _k(v), native_mask, score_mod=expr, names=names, tensors=[_k(c.detach()) for c in caps],
                learn=learn, scale=scale, return_lse=True, q_grad=need[0], k_grad=need[1], v_grad=need[2])
            ctx.graph, ctx.device_tensor, ctx.n_caps = graph, q, len(caps)
            return _t(out), _t(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        graph = ctx.graph
        if graph is None or (grad_out is None and grad_lse is None):
            return (None,) * (8 + ctx.n_caps)
        with _scope(ctx.device_tensor):
            grads = graph.run([_k(grad_out), _k(grad_lse)], retain=True)
            dq, dk, dv = grads[:3]
            return (_t(dq), _t(dk), _t(dv), None, None, None, None, None) + tuple(_t(g) for g in grads[3:])


# The library's mods as run-time expressions (docs/jit.md: each gives its built-in kernel's bits),
# for a call that mixes a library mod with a traced one.
def _library_score_expr(score_mod, q):
    kind, cap, slopes = _score_args(score_mod, q)
    if kind == "none":
        return "score", [], []
    if kind == "softcap":
        c = float_literal(cap)
        return f"{c} * tanh(score * (1.0f / {c}))", [], []
    return "score + slopes[h] * (kv_idx - q_idx)", ["slopes"], [slopes]


def _library_mask_expr(m):
    if m.kind == "none":
        return "true", [], []
    if m.kind == "causal":
        return "q_idx >= kv_idx", [], []
    if m.kind == "sliding_window":
        return f"q_idx - kv_idx >= 0 && q_idx - kv_idx < {m.window}", [], []
    if m.kind == "prefix_lm":
        return f"kv_idx < {m.prefix} || q_idx >= kv_idx", [], []
    return "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]", ["doc"], [torch.as_tensor(m.document_ids)]


def _runtime_flex(query, key, value, score_mod, block_mask, scale):
    op = "kiln.torch.flex_attention"
    if torch.compiler.is_compiling():
        raise KilnError(f"{op}: traced Python mods run in eager mode only (under torch.compile use the library's "
                        f"mods by name, kiln.torch.mods)")
    if score_mod is None or isinstance(score_mod, ScoreMod):
        expr, names, caps = _library_score_expr(score_mod, query)
    else:
        expr, names, caps = trace_mod(score_mod, "score_mod")
    native = None
    if block_mask is not None:
        if block_mask._traced is not None:
            native = block_mask._native
        else:
            mexpr, mnames, mcaps = _library_mask_expr(block_mask.mask_mod)
            mcaps = [c.to(query.device) for c in mcaps]
            native = _C.library_mask_as_runtime(block_mask._native, mexpr, mnames, [_k(c) for c in mcaps])
        if block_mask.device != query.device:
            raise ValueError(f"{op}: block_mask is on {block_mask.device}, the inputs on {query.device}")
    caps = [c if c.device == query.device else c.to(query.device) for c in caps]
    learn = [bool(c.requires_grad) for c in caps]
    return _RuntimeFlexFunction.apply(query, key, value, native, expr, names, learn, scale, *caps)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None):
    """PyTorch's ``flex_attention`` on kiln's kernels: query [B, Hq, L, E], key [B, Hkv, S, E],
    value [B, Hkv, S, Ev] (Hq a multiple of Hkv: GQA without copies); f32, bf16 or f16. Returns
    the output [B, Hq, L, Ev], and the log-sum-exp [B, Hq, L] (f32, natural log) with
    ``return_lse=True``. Fully masked rows give 0 (lse -inf)."""
    op = "kiln.torch.flex_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t, op)
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [B, H, seq, dim], got shape {tuple(t.shape)}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"{op}: block_mask must come from kiln.torch.create_block_mask, got "
                            f"{type(block_mask).__name__}")
        if (block_mask.q_len, block_mask.kv_len) != (query.shape[2], key.shape[2]):
            raise ValueError(f"{op}: block_mask is for Q_LEN={block_mask.q_len}, KV_LEN={block_mask.kv_len}; "
                             f"the inputs have L={query.shape[2]}, S={key.shape[2]}")
    scale = None if scale is None else float(scale)
    traced_score = score_mod is not None and not isinstance(score_mod, ScoreMod)
    if traced_score or (block_mask is not None and block_mask._traced is not None):
        if traced_score and not callable(score_mod):
            raise TypeError(f"{op}: score_mod must be a kiln.torch.mods score mod or a function "
                            f"(score, b, h, q_idx, kv_idx), got {type(score_mod).__name__}")
        out, lse = _runtime_flex(query, key, value, score_mod, block_mask, scale)
        return (out, lse) if return_lse else out
    kind, cap, slopes = _score_args(score_mod, query)
    if torch.compiler.is_compiling():
        m = block_mask.mask_mod if block_mask is not None else mods.noop_mask
        bs = block_mask.BLOCK_SIZE if block_mask is not None else 128
        ids = None if m.document_ids is None else torch.as_tensor(m.document_ids)
        out, lse = torch.ops.kiln.flex_attention(query, key, value, m.kind, m.window, m.prefix, ids, bs, kind, cap,
                                                 slopes, scale)
    else:
        native = block_mask._native if block_mask is not None else None
        if native is not None and block_mask.device != query.device:
            raise ValueError(f"{op}: block_mask is on {block_mask.device}, the inputs on {query.device}")
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            out, lse = _FlexAttentionFunction.apply(query, key, value, native, kind, cap, slopes, scale)
        else:  # nothing to differentiate: the kernel call alone, without an autograd.Function
            with _scope(query):
                if kind == "none" and scale is None and not return_lse:  # the defaults: no keywords to convert
                    out, lse, _ = _C.flex_attention(_k(query), _k(key), _k(value), native)
                else:
                    out, lse, _ = _C.flex_attention(_k(query), _k(key), _k(value), native, score_mod=kind,
                                                    softcap=cap, alibi_slopes=_k(slopes), scale=scale,
                                                    return_lse=return_lse)
                out, lse = _t(out), _t(lse)
    return (out, lse) if return_lse else out


from . import _ops  # noqa: E402,F401  (registers torch.ops.kiln.*)
