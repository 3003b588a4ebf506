# kiln.torch against torch's own ops: DLPack with torch (zero copy, every dtype, strides,
# tensors that require grad refused with kiln's message); the fused loss (loss, z-loss, lse,
# gradients; gradcheck in float64; the module, tied weights); FlexAttention (output, lse,
# gradients) with the library's mods against a float64 composition of torch ops; the
# torch.library custom ops (opcheck: schema, fake tensors, autograd) and torch.compile; bad
# input (Python mods traced for the JIT: test_trace.py). On CUDA (where torch and kiln both have it) every
# test also runs on a non-default stream. Without torch the module is skipped with a message.
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed for this Python: kiln.torch's tests run where it is (on the GPU "
                    "machine: PYTHONPATH=build/cuda/python python3 -m pytest python/tests/test_torch.py)")
import torch.nn.functional as F  # noqa: E402

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402
from kiln.torch import mods  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kiln.cuda_built() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """A device, and on CUDA a non-default stream current for the test (kiln must follow it)."""
    if request.param == "cuda":
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            yield "cuda"
        torch.cuda.synchronize()
    else:
        yield "cpu"


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(1 << 31)))


def randn(gen, *shape, device="cpu", dtype=torch.float32):
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- DLPack with torch

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_torch_round_trip_every_dtype_zero_copy(device, gen, dtype):
    x = (randn(gen, 5, 6, device=device) * 50).to(dtype)
    t = kiln.from_dlpack(x)
    assert t.shape == [5, 6] and t.data_ptr == x.data_ptr() and t.device.startswith(device)
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr() and y.dtype == dtype
    assert torch.equal(y, x)


def test_torch_views_strides_and_requires_grad(device, gen):
    x = randn(gen, 6, 8, device=device)
    for v in (x.t(), x[::2, 1:], x[:, 5]):
        t = kiln.from_dlpack(v)
        assert t.strides == list(v.stride()) and t.data_ptr == v.data_ptr()
        assert torch.equal(torch.from_dlpack(t), v)
    w = x.clone().requires_grad_()
    with pytest.raises(kiln.KilnError, match="requires grad.*detach"):
        kiln.from_dlpack(w)
    assert kiln.from_dlpack(w.detach()).data_ptr == w.data_ptr()


# ---------------------------------------------------------------- the fused loss

def torch_lce(h, w, t, b=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=0.0):
    logits = F.linear(h, w, b).float() if h.dtype != torch.float64 else F.linear(h, w, b)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    keep = t != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    loss = loss + torch.where(keep, z_loss * lse ** 2, torch.zeros_like(lse))
    if reduction == "mean":
        return loss.sum() / keep.sum()
    return loss.sum() if reduction == "sum" else loss


@pytest.mark.parametrize("opts", [{}, {"ignore_index": 2}, {"label_smoothing": 0.1}, {"z_loss": 1e-3},
                                  {"softcap": 5.0}, {"reduction": "sum"}, {"reduction": "none"}, {"bias": True}],
                         ids=lambda o: ",".join(o) or "plain")
def test_linear_cross_entropy_matches_torch(device, gen, opts):
    n, d, v = 45, 24, 67
    h = randn(gen, n, d, device=device).requires_grad_()
    w = (0.3 * randn(gen, v, d, device=device)).requires_grad_()
    b = randn(gen, v, device=device).requires_grad_() if opts.get("bias") else None
    t = torch.randint(0, v, (n,), generator=gen).to(device)
    o = {k: x for k, x in opts.items() if k != "bias"}
    if "ignore_index" in o:
        t[::4] = o["ignore_index"]
    loss = kt.linear_cross_entropy(h, w, t, b, **o)
    ref = torch_lce(h, w, t, b, **o)
    torch.testing.assert_close(loss, ref, rtol=2e-5, atol=2e-5)
    go = randn(gen, *loss.shape, device=device)
    grads = torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None], go)
    refs = torch.autograd.grad(ref, [x for x in (h, w, b) if x is not None], go)
    for g, r in zip(grads, refs):  # mean's gradients are ~1/N: the atol must sit far below them
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_linear_cross_entropy_bf16_lse_and_3d(device, gen):
    B, T, d, v = 2, 9, 32, 51
    h = randn(gen, B, T, d, device=device, dtype=torch.bfloat16).requires_grad_()
    w = randn(gen, v, d, device=device, dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (B, T), generator=gen).to(device)
    loss, z, lse = kt.linear_cross_entropy(h, w, t, z_loss=1e-4, return_z_loss=True, return_lse=True)
    assert loss.dtype == torch.bfloat16 and lse.shape == (B, T) and lse.dtype == torch.float32
    logits = F.linear(h.double(), w.double())
    # On CUDA each chunk's logits are the bf16 output of its GEMM (docs/loss.md), as torch's bf16
    # F.linear gives them: the LSE moves by at most one bf16 rounding (2^-8 relative) of the
    # largest logit. On the CPU the logits are f32.
    tol = 1e-5 if device == "cpu" else 2.0 ** -8 * logits.abs().amax().item()
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).float(), rtol=1e-5, atol=tol)
    ref = torch_lce(h.double().reshape(-1, d), w.double(), t.reshape(-1), z_loss=1e-4)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all()


def test_linear_cross_entropy_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=gen)
    for opts in ({}, {"label_smoothing": 0.2, "z_loss": 0.01}, {"softcap": 3.0, "reduction": "sum"}):
        assert torch.autograd.gradcheck(lambda h, w, b: kt.linear_cross_entropy(h, w, t, b, **opts), (h, w, b))


def test_linear_cross_entropy_module_and_tied_weight(device, gen):
    torch.manual_seed(0)
    m = kt.LinearCrossEntropyLoss(16, 40, bias=True, device=device)
    assert m.weight.shape == (40, 16) and m.bias.shape == (40,)
    h = randn(gen, 10, 16, device=device)
    t = torch.randint(0, 40, (10,), generator=gen).to(device)
    m(h, t).backward()
    ref = torch_lce(h, m.weight, t, m.bias)
    gw = torch.autograd.grad(ref, m.weight)[0]
    torch.testing.assert_close(m.weight.grad, gw, rtol=1e-4, atol=1e-6)
    emb = torch.nn.Embedding(40, 16, device=device)
    tied = kt.LinearCrossEntropyLoss(weight=emb.weight)
    (tied(h, t) + emb(t).sum()).backward()  # both uses accumulate into the one parameter
    assert emb.weight.grad is not None and "num_classes=40" in repr(tied)


def test_linear_cross_entropy_bad_input(device, gen):
    h = randn(gen, 4, 8, device=device)
    w = randn(gen, 5, 8, device=device)
    with pytest.raises(kiln.KilnError, match=r"target\[3\]=9 out of range"):
        # On CUDA the range check runs on the device and fails at the next synchronisation
        # through kiln (as torch's device-side asserts do): kiln.torch.synchronize raises it.
        kt.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 9], device=device))
        kt.synchronize(device)
    kt.synchronize(device)  # raised once: the next synchronisation is clean
    with pytest.raises(kiln.KilnError):
        kt.linear_cross_entropy(h, w.double(), torch.tensor([0, 1, 2, 3], device=device))
    with pytest.raises(kiln.KilnError, match="weight"):
        kt.linear_cross_entropy(h, randn(gen, 5, 7, device=device), torch.tensor([0, 1, 2, 3], device=device))
    with pytest.raises(ValueError, match="reduction"):
        kt.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3], device=device), reduction="avg")
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        kt.linear_cross_entropy(np.zeros((4, 8)), w, torch.tensor([0, 1, 2, 3]))


# ---------------------------------------------------------------- FlexAttention

def torch_attention(q, k, v, mask, score=None, cap=0.0, slopes=None, scale=None):
    """float64 attention from torch ops (autograd gives the reference gradients)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    L, S = q.shape[2], k.shape[2]
    if score == "softcap":
        s = cap * torch.tanh(s / cap)
    elif score == "alibi":
        rel = (torch.arange(S) - torch.arange(L)[:, None]).to(s)
        s = s + slopes.to(s)[None, :, None, None] * rel
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p @ vv, lse


def dense_mask(kind, L, S, window=0, prefix=0, ids=None):
    q, k = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return {"none": torch.ones(L, S, dtype=torch.bool), "causal": q >= k, "sliding_window": (q >= k) & (q - k < window),
            "prefix_lm": (k < prefix) | (q >= k),
            "document": (q >= k) & (ids[:L, None] == ids[None, :S]) if ids is not None else None}[kind]


FLEX_CASES = [(mods.causal, "causal", {}, None), (mods.sliding_window(9), "sliding_window", {"window": 9}, None),
              (mods.prefix_lm(6), "prefix_lm", {"prefix": 6}, None), (mods.noop_mask, "none", {}, None),
              (mods.causal, "causal", {}, mods.softcap(4.0)), (mods.noop_mask, "none", {}, mods.alibi),
              ("document", "document", {}, None)]


@pytest.mark.parametrize("mask_mod,kind,params,score_mod", FLEX_CASES,
                         ids=["causal", "window", "prefix", "none", "softcap", "alibi", "document"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_matches_torch(device, gen, mask_mod, kind, params, score_mod, dtype):
    B, Hq, Hkv, L, E = 2, 4, 2, 41, 16
    ids = torch.repeat_interleave(torch.arange(5, dtype=torch.int32), 9)[:L]
    if mask_mod == "document":
        mask_mod = mods.document(ids.to(device))
    q = randn(gen, B, Hq, L, E, device=device, dtype=dtype).requires_grad_()
    k = randn(gen, B, Hkv, L, E, device=device, dtype=dtype).requires_grad_()
    v = randn(gen, B, Hkv, L, E, device=device, dtype=dtype).requires_grad_()
    bm = kt.create_block_mask(mask_mod, None, None, L, L, device=device, BLOCK_SIZE=16)
    out, lse = kt.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True, enable_gqa=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    qd, kd, vd = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    slopes = torch.from_dlpack(kiln._C.alibi_slopes(Hq)) if score_mod is mods.alibi else None
    ro, rlse = torch_attention(qd, kd, vd, dense_mask(kind, L, L, ids=ids, **params),
                               score_mod.kind if score_mod else None, getattr(score_mod, "cap", 0.0), slopes)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), rlse, rtol=tol, atol=tol)
    dout = randn(gen, *out.shape, device=device, dtype=dtype)
    (out * dout).sum().backward()
    (ro * dout.double().cpu()).sum().backward()
    for got, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got.double().cpu(), ref, rtol=5 * tol, atol=5 * tol)


def test_flex_attention_lse_gradient(device, gen):
    q, k, v = (randn(gen, 1, 2, 19, 8, device=device).requires_grad_() for _ in range(3))
    out, lse = kt.flex_attention(q, k, v, block_mask=kt.create_block_mask(mods.causal, 1, 1, 19, 19, device=device),
                                 return_lse=True)
    (out.sum() + lse.sum()).backward()
    qd, kd, vd = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    ro, rlse = torch_attention(qd, kd, vd, dense_mask("causal", 19, 19))
    (ro.sum() + rlse.sum()).backward()
    torch.testing.assert_close(q.grad.double().cpu(), qd.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k.grad.double().cpu(), kd.grad, rtol=1e-4, atol=1e-4)


def test_block_mask_facts(device):
    bm = kt.create_block_mask(mods.causal, 1, 1, 256, 256, device=device)
    assert bm.shape == (1, 1, 256, 256) and bm.BLOCK_SIZE == 128 and abs(bm.sparsity() - 25.0) < 1e-9
    assert bm.to_dense().tolist() == [[[[2, 0], [2, 2]]]] or bm.to_dense().tolist() == [[[[1, 0], [2, 1]]]]
    assert "causal" in repr(bm)
    # Python mods are traced into run-time expressions: test_trace.py
    with pytest.raises(ValueError, match="sliding_window"):
        mods.sliding_window(0)


def test_flex_attention_bad_input(device, gen):
    q = randn(gen, 1, 2, 16, 8, device=device)
    with pytest.raises(ValueError, match="4-D"):
        kt.flex_attention(q[0], q, q)
    with pytest.raises(kiln.KilnError, match="dtype"):
        kt.flex_attention(q.double(), q.double(), q.double())
    with pytest.raises(kiln.KilnError):
        kt.flex_attention(q, randn(gen, 1, 2, 16, 4, device=device), q)  # E mismatch
    with pytest.raises(ValueError, match="Q_LEN=32"):
        kt.flex_attention(q, q, q, block_mask=kt.create_block_mask(mods.causal, 1, 1, 32, 32, device=device))
    with pytest.raises(TypeError, match="block_mask"):
        kt.flex_attention(q, q, q, block_mask="causal")


# ---------------------------------------------------------------- custom ops and torch.compile

def test_custom_ops_opcheck(gen):
    h, w = randn(gen, 6, 8).requires_grad_(), randn(gen, 13, 8).requires_grad_()
    t = torch.randint(0, 13, (6,), generator=gen)
    torch.library.opcheck(torch.ops.kiln.linear_cross_entropy.default,
                          (h, w, t, None, None, -100, "mean", 0.0, 0.0, 0.0, 0.0))
    q, k, v = (randn(gen, 1, 2, 20, 8).requires_grad_() for _ in range(3))
    torch.library.opcheck(torch.ops.kiln.flex_attention.default,
                          (q, k, v, "causal", 0, 0, None, 16, "none", 0.0, None, None))


def test_torch_compile_treats_kiln_ops_as_opaque(gen):
    h, w = randn(gen, 12, 16).requires_grad_(), randn(gen, 29, 16).requires_grad_()
    t = torch.randint(0, 29, (12,), generator=gen)
    q, k, v = (randn(gen, 1, 2, 24, 8).requires_grad_() for _ in range(3))
    bm = kt.create_block_mask(mods.causal, 1, 1, 24, 24, BLOCK_SIZE=16)

    def step(h, w, q, k, v):
        return kt.linear_cross_entropy(h, w, t) + kt.flex_attention(q, k, v, block_mask=bm).square().mean()

    eager = step(h, w, q, k, v)
    ge = torch.autograd.grad(eager, (h, w, q, k, v))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(h, w, q, k, v)
    gc = torch.autograd.grad(got, (h, w, q, k, v))
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
