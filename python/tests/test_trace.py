# Python score_mod / mask_mod functions written as PyTorch's, traced into kiln's run-time mod
# expressions (kiln/torch/_trace.py) and compiled by kiln's JIT: the expressions they give, a
# traced mod against the same library mod (the same bits), traced masks with Python's integer
# semantics against a float64 reference evaluated by the same function on index tensors, a
# captured tensor's gradient, and the functions that cannot be traced (an error saying why).
# Needs torch and a C++ compiler for the CPU JIT (else skipped, saying so); where torch and kiln
# have CUDA, the traced masks also run on the GPU (NVRTC).
import shutil

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed for this Python: the traced-mod tests run where it is")

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402
from kiln.torch import mods  # noqa: E402
from kiln.torch._trace import trace_mod  # noqa: E402

if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
    pytest.skip("no C++ compiler for kiln's CPU JIT", allow_module_level=True)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kiln.cuda_built() else [])


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(1 << 31)))


def reference(q, k, v, keep, score=None):
    """float64 attention: `keep` [L, S] bool, `score(s)` on the scaled scores [B, H, L, S]."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if score is not None:
        s = score(s)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p @ v


def test_expressions_and_captures_are_named():
    slopes = torch.rand(4)
    expr, names, tensors = trace_mod(lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
                                     "score_mod")
    assert expr == "score + (slopes[h] * (kv_idx - q_idx))" and names == ["slopes"] and tensors[0] is slopes
    doc = torch.zeros(8, dtype=torch.int64)
    expr, names, _ = trace_mod(lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv]) | ~(kv > 3), "mask_mod")
    assert expr == "((q_idx >= kv_idx) && (doc[q_idx] == doc[kv_idx])) || (!(kv_idx > 3))" and names == ["doc"]
    expr, _, _ = trace_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), "score_mod")
    assert expr == "30.0f * tanh((score / 30.0f))"
    expr, _, _ = trace_mod(lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")), "score_mod")
    assert expr == "where((q_idx >= kv_idx), score, (-inf))"
    expr, _, _ = trace_mod(lambda s, b, h, q, kv: s * 0.1, "score_mod")  # float32 rounding, written exactly
    assert expr == "score * 0.10000000149011612f"
    assert trace_mod(lambda b, h, q, kv: True, "mask_mod")[0] == "true"


def test_untraceable_functions_say_why():
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return score
        return score * 0

    with pytest.raises(kiln.KilnError, match="cannot be traced.*Python control flow.*torch.where"):
        trace_mod(branchy, "score_mod")
    with pytest.raises(kiln.KilnError, match="cannot be traced"):
        trace_mod(lambda b, h, q, kv: q >= kv and q - kv < 4, "mask_mod")
    with pytest.raises(kiln.KilnError, match="as a Python int"):
        trace_mod(lambda b, h, q, kv: [True, False][q], "mask_mod")
    with pytest.raises(kiln.KilnError, match="no expression in kiln's mod language"):
        trace_mod(lambda s, b, h, q, kv: torch.erf(s), "score_mod")
    big = torch.zeros(2, 2, 2, 2, 2)
    with pytest.raises(kiln.KilnError, match="1 to 4"):
        trace_mod(lambda s, b, h, q, kv: s + big[b, h, q, kv, 0], "score_mod")
    table = torch.zeros(4, 4)
    with pytest.raises(kiln.KilnError, match="one index per dim"):
        trace_mod(lambda s, b, h, q, kv: s + table[h], "score_mod")


def test_traced_mods_give_the_library_mods_bits(gen):
    B, H, L, E = 1, 2, 37, 8
    q, k, v = (randn(gen, B, H, L, E) for _ in range(3))
    slopes = torch.rand(H, generator=gen) * 0.5
    causal = kt.create_block_mask(mods.causal, 1, 1, L, L, BLOCK_SIZE=16)
    traced_causal = kt.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, L, L, BLOCK_SIZE=16)
    assert traced_causal.expression == "q_idx >= kv_idx"
    assert torch.equal(traced_causal.to_dense(), causal.to_dense())
    lib = kt.flex_attention(q, k, v, score_mod=mods.alibi_with(slopes), block_mask=causal)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    assert torch.equal(kt.flex_attention(q, k, v, score_mod=alibi, block_mask=causal), lib)
    assert torch.equal(kt.flex_attention(q, k, v, score_mod=alibi, block_mask=traced_causal), lib)
    # the library score mod with a traced mask (the library mod's expression runs)
    assert torch.equal(kt.flex_attention(q, k, v, score_mod=mods.alibi_with(slopes), block_mask=traced_causal), lib)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["floor_blocks", "modulo_stripes"])
def test_traced_masks_keep_pythons_integer_semantics(gen, name, device):
    # Negative operands: Python's // and % floor, C++'s truncate; the trace keeps Python's.
    fn = {"floor_blocks": lambda b, h, q, kv: (q - kv) // 5 == (q - 3) // 5 - (kv - 2) // 7,
          "modulo_stripes": lambda b, h, q, kv: ((kv - q) % 3 == 0) | (q == kv)}[name]
    B, H, L, E = 1, 1, 29, 8
    q, k, v = (randn(gen, B, H, L, E) for _ in range(3))
    keep = fn(None, None, torch.arange(L)[:, None], torch.arange(L)[None, :])
    bm = kt.create_block_mask(fn, 1, 1, L, L, device=device, BLOCK_SIZE=8)
    out = kt.flex_attention(q.to(device), k.to(device), v.to(device), block_mask=bm)  # CUDA: the NVRTC kernels
    torch.testing.assert_close(out.double().cpu(), reference(q.double(), k.double(), v.double(), keep), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_an_index_over_a_positive_constant_traces_to_the_plain_operators(gen, device):
    # q_idx // n and kv_idx % n need no sign fix-up (indices are never negative): C++'s / and %.
    fn = lambda b, h, q, kv: (q >= kv) & (q // 8 == kv // 8) & (kv % 3 != 1)  # noqa: E731
    expr, _, _ = trace_mod(fn, "mask_mod")
    assert expr == "((q_idx >= kv_idx) && ((q_idx / 8) == (kv_idx / 8))) && ((kv_idx % 3) != 1)"
    # a difference of indices can be negative: it keeps Python's floor
    expr2, _, _ = trace_mod(lambda b, h, q, kv: (q - kv) // 8 == 0, "mask_mod")
    assert "where(" in expr2
    B, H, L, E = 1, 1, 37, 8
    q, k, v = (randn(gen, B, H, L, E) for _ in range(3))
    keep = fn(None, None, torch.arange(L)[:, None], torch.arange(L)[None, :])
    bm = kt.create_block_mask(fn, 1, 1, L, L, device=device, BLOCK_SIZE=8)
    out = kt.flex_attention(q.to(device), k.to(device), v.to(device), block_mask=bm)
    torch.testing.assert_close(out.double().cpu(), reference(q.double(), k.double(), v.double(), keep), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_captured_tensor_gets_its_gradient(gen, device):
    B, H, L, E = 1, 2, 23, 8
    q, k, v = (randn(gen, B, H, L, E).to(device).requires_grad_() for _ in range(3))
    bias = (randn(gen, H, 2 * L - 1) * 0.3).to(device).requires_grad_()

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx - q_idx + L - 1]

    out = kt.flex_attention(q, k, v, score_mod=rel_bias,
                            block_mask=kt.create_block_mask(mods.causal, 1, 1, L, L, device=device, BLOCK_SIZE=8))
    dout = randn(gen, *out.shape).to(device)
    (out * dout).sum().backward()
    qd, kd, vd, bd = (x.detach().double().cpu().requires_grad_() for x in (q, k, v, bias))
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    ro = reference(qd, kd, vd, i >= j, lambda s: s + bd[:, j - i + L - 1][None])
    torch.testing.assert_close(out.double().cpu(), ro, rtol=2e-4, atol=2e-4)
    (ro * dout.double().cpu()).sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad), (bias.grad, bd.grad)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-3)
