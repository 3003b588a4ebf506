"""torch.library custom ops over kiln (torch.ops.kiln.*), with fake (meta) implementations, so
torch.compile treats kiln's fused loss and FlexAttention as opaque ops; kiln.torch's functions
call them while compiling. Their backward ops recompute the forward (kiln's graph cannot cross
an op boundary), as Cut Cross-Entropy does."""
import functools
from typing import List, Optional, Tuple

import torch

from .. import _C
from . import _k, _scope, _t
from .mods import MaskMod

# ---------------------------------------------------------------- linear_cross_entropy


def _lce_run(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
             num_items, grads):
    return _C.linear_cross_entropy(_k(hidden), _k(weight), _k(target), bias=_k(bias), class_weight=_k(class_weight),
                                   hidden_grad=grads, weight_grad=grads, bias_grad=grads and bias is not None,
                                   ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                   z_loss=z_loss, softcap=softcap, num_items=num_items)


@torch.library.custom_op("kiln::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor], class_weight: Optional[torch.Tensor], ignore_index: int,
                         reduction: str, label_smoothing: float, z_loss: float, softcap: float,
                         num_items: float) -> Tuple[torch.Tensor, torch.Tensor]:
    with _scope(hidden):
        loss, z, _, _ = _lce_run(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
                                 z_loss, softcap, num_items, False)
        return _t(loss), _t(z)


@linear_cross_entropy.register_fake
def _(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
      num_items):
    shape = tuple(target.shape) if reduction == "none" else ()
    return hidden.new_empty(shape), hidden.new_empty(shape)


@torch.library.custom_op("kiln::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  target: torch.Tensor, bias: Optional[torch.Tensor],
                                  class_weight: Optional[torch.Tensor], ignore_index: int, reduction: str,
                                  label_smoothing: float, z_loss: float, softcap: float,
                                  num_items: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _scope(hidden):
        _, _, _, graph = _lce_run(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                                  label_smoothing, z_loss, softcap, num_items, True)
        gh, gw, gb = graph.run([_k(grad_loss)])
        gb = _t(gb) if gb is not None else hidden.new_empty(0)
        return _t(gh), _t(gw), gb


@linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, target, bias, class_weight, *args):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else hidden.new_empty(0))


def _lce_setup(ctx, inputs, output):
    hidden, weight, target, bias, class_weight = inputs[:5]
    ctx.save_for_backward(hidden, weight, target, bias, class_weight)
    ctx.scalars = inputs[5:]


def _lce_backward(ctx, grad_loss, _grad_z):
    hidden, weight, target, bias, class_weight = ctx.saved_tensors
    gh, gw, gb = torch.ops.kiln.linear_cross_entropy_backward(grad_loss, hidden, weight, target, bias, class_weight,
                                                             *ctx.scalars)
    return (gh, gw, None, gb if bias is not None else None, None) + (None,) * len(ctx.scalars)


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)

# ---------------------------------------------------------------- flex_attention


# Built block masks by their parameters (a small cache, so a compiled step does not rebuild its
# mask every call; document masks, whose ids are data, are not cached).
@functools.lru_cache(maxsize=32)
def _cached_mask(kind, window, prefix, q_len, kv_len, block_size, device):
    return _C.create_block_mask(kind, q_len, kv_len, window=window, prefix=prefix, block_size=block_size,
                                device=device)


def _mask(kind, window, prefix, document_ids, q, k, block_size):
    device = str(q.device)
    if kind == "document":
        return _C.create_block_mask(kind, q.shape[2], k.shape[2], document_ids=_k(document_ids),
                                    block_size=block_size, device=device)
    return _cached_mask(kind, window, prefix, q.shape[2], k.shape[2], block_size, device)


def _flex_run(q, k, v, mask_kind, window, prefix, document_ids, block_size, score_kind, cap, slopes, scale, grads):
    mask = _mask(mask_kind, window, prefix, document_ids, q, k, block_size)
    return _C.flex_attention(_k(q), _k(k), _k(v), mask, score_mod=score_kind, softcap=cap, alibi_slopes=_k(slopes),
                             scale=scale, return_lse=True, q_grad=grads, k_grad=grads, v_grad=grads)


@torch.library.custom_op("kiln::flex_attention", mutates_args=())
def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_kind: str, window: int, prefix: int,
                   document_ids: Optional[torch.Tensor], block_size: int, score_kind: str, cap: float,
                   slopes: Optional[torch.Tensor], scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    with _scope(q):
        out, lse, _ = _flex_run(q, k, v, mask_kind, window, prefix, document_ids, block_size, score_kind, cap,
                                slopes, scale, False)
        return _t(out), _t(lse)


@flex_attention.register_fake
def _(q, k, v, *args):
    b, h, l, _ = q.shape
    return q.new_empty((b, h, l, v.shape[3])), q.new_empty((b, h, l), dtype=torch.float32)


@torch.library.custom_op("kiln::flex_attention_backward", mutates_args=())
def flex_attention_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, mask_kind: str, window: int, prefix: int,
                            document_ids: Optional[torch.Tensor], block_size: int, score_kind: str, cap: float,
                            slopes: Optional[torch.Tensor],
                            scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _scope(q):
        _, _, graph = _flex_run(q, k, v, mask_kind, window, prefix, document_ids, block_size, score_kind, cap,
                                slopes, scale, True)
        dq, dk, dv = graph.run([_k(grad_out), _k(grad_lse)])
        return _t(dq), _t(dk), _t(dv)


@flex_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flex_setup(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.save_for_backward(q, k, v)
    ctx.scalars = inputs[3:]


def _flex_backward(ctx, grad_out, grad_lse):
    q, k, v = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
    dq, dk, dv = torch.ops.kiln.flex_attention_backward(grad_out, grad_lse, q, k, v, *ctx.scalars)
    return (dq, dk, dv) + (None,) * len(ctx.scalars)


flex_attention.register_autograd(_flex_backward, setup_context=_flex_setup)
