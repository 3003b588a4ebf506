# kiln's fused loss and FlexAttention called from Python on numpy memory (no torch needed),
# against float64 numpy references: the loss and its gradients with every option, attention
# outputs, lse and gradients with the library's masks and score mods, GQA and odd shapes; and
# bad input getting kiln's message.
import numpy as np
import pytest

import kiln
from kiln import _C


def K(a):
    a = np.asarray(a)
    return kiln.from_dlpack(a if a.flags.c_contiguous else a.copy())  # (ascontiguousarray makes 0-d 1-d)


def N(t):
    return kiln.to_numpy(t).astype(np.float64)


# ---------------------------------------------------------------- the fused loss

def lce_reference(h, w, t, b=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                  softcap=0.0):
    """loss, d hidden, d weight, d bias (float64), as PyTorch defines them."""
    raw = h @ w.T + (0 if b is None else b)
    logits = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(logits - lse[:, None])
    V = w.shape[0]
    keep = t != ignore_index
    safe_t = np.where(keep, t, 0)
    nll = lse - logits[np.arange(len(t)), safe_t]
    smooth = lse - logits.mean(axis=1)
    per = (1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * lse ** 2
    per = np.where(keep, per, 0.0)
    y = np.zeros_like(p)
    y[np.arange(len(t)), safe_t] = 1 - label_smoothing
    y += label_smoothing / V
    g = (p - y) + 2 * z_loss * lse[:, None] * p
    g = np.where(keep[:, None], g, 0.0)
    if softcap > 0:
        g = g * (1 - np.tanh(raw / softcap) ** 2)
    if reduction == "mean":
        loss, g = per.sum() / keep.sum(), g / keep.sum()
    elif reduction == "sum":
        loss = per.sum()
    else:
        loss = per
    return loss, g @ w, g.T @ h, g.sum(axis=0), lse


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-10)])
@pytest.mark.parametrize("opts", [{}, {"ignore_index": 3}, {"label_smoothing": 0.1}, {"z_loss": 1e-3},
                                  {"softcap": 4.0}, {"reduction": "sum"}, {"bias": True}],
                         ids=lambda o: ",".join(o) or "plain")
def test_linear_cross_entropy_matches_float64(rng, dtype, tol, opts):
    n, d, v = 37, 19, 53  # odd sizes: tails in every dim
    h = rng.standard_normal((n, d))
    w = rng.standard_normal((v, d)) * 0.3
    t = rng.integers(0, v, n)
    t[::5] = opts.get("ignore_index", -100) if "ignore_index" in opts else t[::5]
    b = rng.standard_normal(v) if opts.get("bias") else None
    o = {k: x for k, x in opts.items() if k != "bias"}
    loss, gh, gw, gb, _ = lce_reference(h, w, t, b, **o)
    out, z, lse, graph = _C.linear_cross_entropy(K(h.astype(dtype)), K(w.astype(dtype)), K(t),
                                                 bias=None if b is None else K(b.astype(dtype)),
                                                 hidden_grad=True, weight_grad=True, bias_grad=b is not None, **o)
    assert out.dtype == ("f32" if dtype == np.float32 else "f64")
    np.testing.assert_allclose(N(out), loss, rtol=tol, atol=tol)
    gk = graph.run([K(np.array(1.0, dtype))])
    np.testing.assert_allclose(N(gk[0]), gh, rtol=tol, atol=tol)
    np.testing.assert_allclose(N(gk[1]), gw, rtol=tol, atol=tol)
    if b is not None:
        np.testing.assert_allclose(N(gk[2]), gb, rtol=tol, atol=tol)
    else:
        assert gk[2] is None


def test_linear_cross_entropy_lse_none_reduction_and_scaled_gradient(rng):
    n, d, v = 10, 8, 31
    h, w, t = rng.standard_normal((n, d)), rng.standard_normal((v, d)), rng.integers(0, v, n)
    loss, _, _, _, lse = lce_reference(h, w, t, reduction="none")
    out, _, klse, _ = _C.linear_cross_entropy(K(h), K(w), K(t), reduction="none", return_lse=True)
    np.testing.assert_allclose(N(out), loss, rtol=1e-10)
    np.testing.assert_allclose(N(klse), lse, rtol=1e-10)
    # mean's gradient scaled by grad_output
    _, gh, gw, _, _ = lce_reference(h, w, t)
    _, _, _, graph = _C.linear_cross_entropy(K(h), K(w), K(t), hidden_grad=True, weight_grad=False)
    gk = graph.run([K(np.array(2.5))])
    np.testing.assert_allclose(N(gk[0]), 2.5 * gh, rtol=1e-10)
    assert gk[1] is None
    with pytest.raises(kiln.KilnError, match="already run"):
        graph.run([K(np.array(1.0))])


def test_linear_cross_entropy_bad_input_names_the_argument(rng):
    h, w = K(rng.standard_normal((4, 8)).astype(np.float32)), K(rng.standard_normal((5, 8)).astype(np.float32))
    with pytest.raises(kiln.KilnError, match="target"):
        _C.linear_cross_entropy(h, w, K(np.array([0, 1, 2, 7])))  # 7 >= V
    with pytest.raises(kiln.KilnError, match="weight"):
        _C.linear_cross_entropy(h, K(rng.standard_normal((5, 7)).astype(np.float32)), K(np.array([0, 1, 2, 3])))
    with pytest.raises(kiln.KilnError):
        _C.linear_cross_entropy(h, w, K(np.array([0.0, 1, 2, 3])))  # float targets
    with pytest.raises(kiln.KilnError, match="reduction"):
        _C.linear_cross_entropy(h, w, K(np.array([0, 1, 2, 3])), reduction="avg")


# ---------------------------------------------------------------- FlexAttention

def mask_of(kind, L, S, window=0, prefix=0, ids=None):
    q = np.arange(L)[:, None]
    k = np.arange(S)[None, :]
    if kind == "none":
        return np.ones((L, S), bool)
    if kind == "causal":
        return q >= k
    if kind == "sliding_window":
        return (q >= k) & (q - k < window)
    if kind == "prefix_lm":
        return (k < prefix) | (q >= k)
    if kind == "document":
        return (q >= k) & (ids[:L, None] == ids[None, :S])
    raise ValueError(kind)


def flex_reference(q, k, v, mask, score="none", cap=0.0, slopes=None, scale=None):
    """out, lse, and the gradients of sum(out * dout) as a function of dout (float64)."""
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scale = 1 / np.sqrt(E) if scale is None else scale
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = scale * q @ kk.transpose(0, 1, 3, 2)
    ds = np.ones_like(s)
    if score == "softcap":
        th = np.tanh(s / cap)
        s, ds = cap * th, 1 - th ** 2
    elif score == "alibi":
        s = s + slopes[None, :, None, None] * (np.arange(k.shape[2])[None, :] - np.arange(L)[:, None])
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    p = np.where(den > 0, e / np.where(den > 0, den, 1), 0)
    lse = np.where(den[..., 0] > 0, (m + np.log(np.where(den > 0, den, 1)))[..., 0], -np.inf)
    out = p @ vv

    def grads(dout):
        dv = p.transpose(0, 1, 3, 2) @ dout
        dp = dout @ vv.transpose(0, 1, 3, 2)
        dsc = p * (dp - (dout * out).sum(-1, keepdims=True)) * ds
        dq = scale * dsc @ kk
        dk = scale * dsc.transpose(0, 1, 3, 2) @ q
        fold = lambda x: x.reshape(B, Hkv, g, *x.shape[2:]).sum(axis=2)  # GQA: sum over the group
        return dq, fold(dk), fold(dv)

    return out, lse, grads


CASES = [  # (mask, params, score)
    ("none", {}, "none"), ("causal", {}, "none"), ("sliding_window", {"window": 7}, "none"),
    ("prefix_lm", {"prefix": 5}, "none"), ("document", {}, "none"), ("causal", {}, "softcap"),
    ("none", {}, "alibi"), ("causal", {}, "alibi"),
]


@pytest.mark.parametrize("mask_kind,params,score", CASES, ids=lambda c: str(c) if isinstance(c, str) else "")
def test_flex_attention_matches_float64(rng, mask_kind, params, score):
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 37, 37, 16, 12  # GQA; odd lengths; Ev != E
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(np.float32)
    ids = np.repeat(np.arange(4, dtype=np.int32), 10)[:S]
    mask = mask_of(mask_kind, L, S, ids=ids, **params)
    bm = _C.create_block_mask(mask_kind, L, S, block_size=16, document_ids=K(ids) if mask_kind == "document" else None,
                              **params)
    cap = 3.0
    slopes = N(_C.alibi_slopes(Hq)) if score == "alibi" else None
    out, lse, graph = _C.flex_attention(K(q), K(k), K(v), bm, score_mod=score, softcap=cap,
                                        alibi_slopes=_C.alibi_slopes(Hq) if score == "alibi" else None,
                                        return_lse=True, q_grad=True, k_grad=True, v_grad=True)
    ro, rlse, rgrads = flex_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask,
                                      score, cap, slopes)
    np.testing.assert_allclose(N(out), ro, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(N(lse), rlse, rtol=2e-5, atol=2e-5)
    dout = rng.standard_normal(ro.shape).astype(np.float32)
    dq, dk, dv = graph.run([K(dout), None])
    for got, want in zip((dq, dk, dv), rgrads(dout.astype(np.float64))):
        np.testing.assert_allclose(N(got), want, rtol=5e-4, atol=5e-5)


def test_flex_attention_fully_masked_rows_and_block_mask_facts(rng):
    L, S = 20, 33
    bm = _C.create_block_mask("causal", L, S, block_size=8)
    assert (bm.kind, bm.q_len, bm.kv_len, bm.block_size, bm.device) == ("causal", L, S, 8, "cpu")
    dense = kiln.to_numpy(bm.to_dense())
    assert dense.shape == (1, 1, 3, 5) and dense[0, 0, 0, 4] == 0 and dense[0, 0, 2, 0] == 2
    assert 0 < bm.sparsity() < 1
    q = rng.standard_normal((1, 2, L, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    win = _C.create_block_mask("prefix_lm", L, S, prefix=0, block_size=8)
    out, lse, _ = _C.flex_attention(K(q), K(kv), K(kv), win, return_lse=True)
    assert np.isfinite(N(out)).all()


def test_flex_attention_bad_input_names_the_argument(rng):
    q = K(rng.standard_normal((1, 3, 8, 4)).astype(np.float32))
    k = K(rng.standard_normal((1, 2, 8, 4)).astype(np.float32))
    with pytest.raises(kiln.KilnError, match="multiple|Hq|heads"):
        _C.flex_attention(q, k, k, None)
    with pytest.raises(kiln.KilnError, match="unknown mask"):
        _C.create_block_mask("diagonal", 8, 8)
    with pytest.raises(kiln.KilnError, match="window"):
        _C.create_block_mask("sliding_window", 8, 8, window=0)
    with pytest.raises(kiln.KilnError, match="document_ids"):
        _C.create_block_mask("document", 8, 8)
    q2 = K(rng.standard_normal((1, 2, 8, 4)).astype(np.float32))
    with pytest.raises(kiln.KilnError, match="unknown score_mod"):
        _C.flex_attention(q2, k, k, None, score_mod="relu")
    with pytest.raises(kiln.KilnError, match="none and causal"):
        _C.flex_attention(q2, k, k, _C.create_block_mask("sliding_window", 8, 8, window=2), score_mod="softcap",
                          softcap=2.0)
    with pytest.raises(kiln.KilnError, match="dtype"):
        _C.flex_attention(K(np.zeros((1, 2, 8, 4))), K(np.zeros((1, 2, 8, 4))), K(np.zeros((1, 2, 8, 4))), None)
