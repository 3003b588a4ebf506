# The transformers client (kiln/hf.py): Hugging Face's LlamaForCausalLM with kiln's FlexAttention
# registered as its attention implementation (AttentionInterface, attn_implementation="kiln") and
# kiln's fused linear + cross-entropy as its loss, trained side by side with the unmodified model
# (sdpa attention, transformers' own loss) from the same weights: the same loss curve and
# gradients within f32 rounding on the CPU; on a GPU (where torch has CUDA) the same in bf16 within
# bf16's tolerance. Skipped without torch and transformers.
import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed for this Python: the transformers client "
                                            "test runs where it is")
transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")

import kiln  # noqa: E402
import kiln.hf  # noqa: E402


def tiny_llama(seed, **over):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.0, tie_word_embeddings=False, **over)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture
def seed(rng):
    return int(rng.integers(1 << 31))


CASES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() and
                                   kiln.cuda_built() else [])


@pytest.mark.parametrize("device,dtype", CASES, ids=[f"{d}-{str(t)[6:]}" for d, t in CASES])
def test_kiln_attention_and_loss_train_like_the_unmodified_model(seed, device, dtype):
    kiln.hf.register()
    ref = tiny_llama(seed).to(device=device, dtype=dtype)
    ref.config._attn_implementation = "sdpa"
    ours = copy.deepcopy(ref)
    ours.config._attn_implementation = "kiln"
    g = torch.Generator().manual_seed(seed)
    # two batches in turn (a curve that falls); 29 tokens: not a multiple of kiln's blocks
    batches = [torch.randint(0, 97, (2, 29), generator=g).to(device) for _ in range(2)] * 4
    # f32: f32 rounding; bf16 (the GPU): bf16's, and no gradient comparison (bf16 gradients of
    # two different kernels differ by more than a loss curve does)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    opt_r = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    curve_r, curve_o = [], []
    for step, ids in enumerate(batches):
        loss_r = ref(input_ids=ids, labels=ids).loss
        loss_o = kiln.hf.causal_lm_loss(ours, ids)
        loss_r.backward()
        loss_o.backward()
        if step == 0 and dtype == torch.float32:  # the same gradients before any update
            for (name, pr), po in zip(ref.named_parameters(), ours.parameters()):
                torch.testing.assert_close(po.grad, pr.grad, rtol=1e-4, atol=1e-5, msg=name)
        opt_r.step(), opt_o.step(), opt_r.zero_grad(), opt_o.zero_grad()
        curve_r.append(loss_r.item())
        curve_o.append(loss_o.item())
    assert curve_r[-1] < curve_r[0] - 0.05, curve_r  # it trains
    for a, b in zip(curve_o, curve_r):
        assert abs(a - b) <= tol * abs(b), (curve_o, curve_r)
    # The kiln model's own forward (logits through transformers' head) agrees too.
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=batches[0]).logits.float(), ref(input_ids=batches[0]).logits.float(),
                                   rtol=tol, atol=tol * 10 if dtype != torch.float32 else tol)


def test_padding_and_dropout_are_refused_not_ignored(seed):
    kiln.hf.register()
    m = tiny_llama(seed)
    m.config._attn_implementation = "kiln"
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(NotImplementedError, match="padding"):
        m(input_ids=ids, attention_mask=mask)
    m(input_ids=ids, attention_mask=torch.ones(2, 9, dtype=torch.long))  # all ones: fine
    d = tiny_llama(seed)
    d.config.attention_dropout = 0.1
    for layer in d.model.layers:
        layer.self_attn.attention_dropout = 0.1
    d.config._attn_implementation = "kiln"
    d.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        d(input_ids=ids)
