"""The library's FlexAttention mods for kiln.torch, by name: mask mods for create_block_mask
(noop, causal, sliding_window(w), prefix_lm(n), document(ids)) and score mods for
flex_attention (softcap(cap), alibi, alibi_with(slopes)). Each runs in kiln's compiled kernels
(docs/attention.md). A Python function written as PyTorch's mod (score, b, h, q_idx, kv_idx)
is taken too: kiln.torch traces it for kiln's JIT (kiln/torch/_trace.py, docs/python.md)."""


class MaskMod:
    """A library mask_mod: `kind` and its parameters (what kiln's BlockMask builder takes)."""

    def __init__(self, kind, *, window=0, prefix=0, document_ids=None):
        self.kind, self.window, self.prefix, self.document_ids = kind, window, prefix, document_ids

    def __repr__(self):
        extra = {"sliding_window": f"({self.window})", "prefix_lm": f"({self.prefix})", "document": "(ids)"}
        return f"kiln.torch.mods.{self.kind}{extra.get(self.kind, '')}"


class ScoreMod:
    """A library score_mod: `kind` and its parameters."""

    def __init__(self, kind, *, cap=0.0, slopes=None):
        self.kind, self.cap, self.slopes = kind, cap, slopes

    def __repr__(self):
        return f"kiln.torch.mods.{self.kind}" + (f"({self.cap})" if self.kind == "softcap" else "")


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"kiln.torch.mods.{name}: expected an int >= 1, got {value!r}")
    return value


noop_mask = MaskMod("none")
causal = MaskMod("causal")


def sliding_window(window):
    """Causal, at most `window` tokens back (the query included)."""
    return MaskMod("sliding_window", window=_positive_int("sliding_window", window))


def prefix_lm(prefix):
    """The first `prefix` tokens are seen by every query; causal after."""
    if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
        raise ValueError(f"kiln.torch.mods.prefix_lm: expected an int >= 0, got {prefix!r}")
    return MaskMod("prefix_lm", prefix=prefix)


def document(document_ids):
    """Causal within documents: `document_ids` (int tensor [S], one id per position) gives each
    position's document (packed sequences)."""
    return MaskMod("document", document_ids=document_ids)


noop = ScoreMod("none")


def softcap(cap):
    """cap * tanh(score / cap) (Gemma 2)."""
    cap = float(cap)
    if not (cap == cap) or cap in (0.0, float("inf"), float("-inf")):
        raise ValueError(f"kiln.torch.mods.softcap: cap must be finite and non-zero, got {cap!r}")
    return ScoreMod("softcap", cap=cap)


alibi = ScoreMod("alibi")  # the paper's geometric slopes for the query heads


def alibi_with(slopes):
    """ALiBi with your own slopes (a float tensor [Hq])."""
    return ScoreMod("alibi", slopes=slopes)
