"""kiln inside Hugging Face transformers models (docs/python.md): kiln's FlexAttention as an
attention implementation registered with transformers' ``AttentionInterface``, and kiln's fused
linear + cross-entropy as a causal LM's loss (no [B, T, V] logits).

    import kiln.hf
    kiln.hf.register()                                    # once: attn_implementation="kiln"
    model = LlamaForCausalLM(config, attn_implementation="kiln")   # or from_pretrained(...)
    loss = kiln.hf.causal_lm_loss(model, input_ids)       # next-token loss through kiln's fused op
    loss.backward()

The attention is causal (transformers' causal LMs; ``module.is_causal``), optionally within a
sliding window (``config.sliding_window``), on kiln's block-sparse kernels, with GQA taken as
it comes (no repeated key / value heads). Padding masks are not taken: batches are packed or
unpadded (a padded batch is refused with a message, never silently attended).
"""
import torch

from . import torch as kt

NAME = "kiln"
_masks = {}  # (kind, window, L, S, device) -> BlockMask, built once per shape


def _block_mask(window, q_len, kv_len, device):
    key = (window, q_len, kv_len, str(device))
    if key not in _masks:
        mod = kt.mods.sliding_window(window) if window else kt.mods.causal
        _masks[key] = kt.create_block_mask(mod, 1, 1, q_len, kv_len, device=device)
    return _masks[key]


def kiln_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                   **kwargs):
    """transformers' attention function signature: query [B, Hq, L, E], key / value [B, Hkv, S, E];
    returns (output [B, L, Hq, E], None)."""
    if dropout:
        raise NotImplementedError(f"kiln.hf: attention dropout ({dropout}) is not supported by kiln's attention; "
                                  f"set config.attention_dropout = 0")
    if attention_mask is not None:
        raise NotImplementedError("kiln.hf: kiln's attention is causal over the whole sequence and takes no padding "
                                  "mask; pass unpadded (or packed) batches without attention_mask")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("kiln.hf: kiln's attention implementation serves causal attention only")
    L, S = query.shape[2], key.shape[2]
    if L != S:
        raise NotImplementedError(f"kiln.hf: query length {L} != key length {S} (a KV cache); kiln's attention here "
                                  f"serves training and full-sequence forwards")
    window = sliding_window or getattr(module, "sliding_window", None) or 0
    mask = _block_mask(int(window), L, S, query.device)
    out = kt.flex_attention(query, key, value, block_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, attention_mask=None, **kwargs):
    """transformers' mask function for kiln: no dense mask (the causal rule is kiln's BlockMask).
    A padding mask that hides a position is refused rather than dropped."""
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise NotImplementedError("kiln.hf: kiln's attention takes no padding mask; pass unpadded (or packed) "
                                  "batches (attention_mask all ones, or None)")
    return None


def register():
    """Registers kiln's attention under the name "kiln" (``attn_implementation="kiln"``)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, kiln_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface.register(NAME, _no_mask)
    except ImportError:  # transformers without mask interfaces builds none for unknown implementations
        pass


def causal_lm_loss(model, input_ids, labels=None, *, ignore_index=-100, **forward_kwargs):
    """The next-token cross-entropy of a transformers causal LM (``LlamaForCausalLM`` and its
    kin: ``model.model`` gives the last hidden states, ``model.lm_head`` the projection) through
    kiln's fused linear + cross-entropy: equal to ``model(input_ids, labels=labels).loss``
    (mean over the non-ignored targets) without the logits. `labels` default to `input_ids`."""
    labels = input_ids if labels is None else labels
    out = model.model(input_ids=input_ids, **forward_kwargs)
    hidden = out.last_hidden_state[:, :-1]
    target = labels[:, 1:]
    head = model.get_output_embeddings()
    return kt.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, target.reshape(-1),
                                   getattr(head, "bias", None), ignore_index=ignore_index)
