"""The batched sampler: filters keep the right tokens, draws follow the distribution, seeds repeat."""

from __future__ import annotations

import torch

from moeserve.layers.sampler import SamplingBatch, sample, uniform_noise


def batch(n: int, vocab: int, **overrides) -> SamplingBatch:
    fields = dict(
        temperature=torch.ones(n),
        top_k=torch.full((n,), vocab, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        seeds=torch.arange(n, dtype=torch.int64),
        steps=torch.zeros(n, dtype=torch.int64),
        all_greedy=False,
        needs_sorting=False,
        needs_min_p=False,
        num_logprobs=-1,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def test_noise_is_uniform_and_keyed():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 50_000)
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform_noise(torch.tensor([1]), torch.tensor([0]), 50_000)[0])


def test_samples_follow_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 1.5
    n = 20_000
    b = batch(n, 8, seeds=torch.arange(n, dtype=torch.int64))
    tokens = sample(logits.expand(n, 8), b).token_ids
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.015


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4)
    cold = sample(logits, batch(4000, 4, temperature=torch.full((4000,), 0.2))).token_ids
    hot = sample(logits, batch(4000, 4, temperature=torch.full((4000,), 2.0))).token_ids
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_top_k_top_p_min_p_keep_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])).expand(3000, 5)
    n = 3000
    top_k = sample(logits, batch(n, 5, top_k=torch.full((n,), 2), needs_sorting=True)).token_ids
    assert set(top_k.tolist()) == {0, 1}
    top_p = sample(logits, batch(n, 5, top_p=torch.full((n,), 0.8), needs_sorting=True)).token_ids
    assert set(top_p.tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.8, so the nucleus needs token 2
    min_p = sample(logits, batch(n, 5, min_p=torch.full((n,), 0.45), needs_min_p=True)).token_ids
    assert set(min_p.tolist()) == {0, 1, 2}  # 0.06 < 0.45 * 0.4


def test_greedy_rows_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    b = batch(2, 3, temperature=torch.tensor([0.0, 0.0]), all_greedy=True, num_logprobs=2)
    out = sample(logits, b)
    assert out.token_ids.tolist() == [1, 0]
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, expected[[0, 1], [1, 0]])
    assert out.top_ids.tolist() == [[1, 2], [0, 2]]
    assert torch.allclose(out.top_logprobs[:, 0], out.logprobs)


def test_half_precision_logits_are_widened_where_used():
    """A decode graph's bf16 logits: greedy argmax kept as given, logprobs and sampling in float32."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]]).bfloat16()
    greedy = torch.tensor([1, 0])
    assert sample(logits, SamplingBatch.greedy(), greedy).token_ids is greedy
    out = sample(logits, SamplingBatch.greedy(num_logprobs=1), greedy)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, logits.float().log_softmax(-1)[[0, 1], [1, 0]])
    b = batch(2, 3, temperature=torch.tensor([0.0, 1.0]))
    assert sample(logits, b).token_ids[0] == 1  # no greedy ids given: the argmax of the widened logits


def test_same_seed_same_tokens_regardless_of_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    alone = sample(logits[1:2], batch(1, 100, seeds=torch.tensor([42]), steps=torch.tensor([3]))).token_ids
    together = sample(logits, batch(3, 100, seeds=torch.tensor([7, 42, 9]), steps=torch.tensor([0, 3, 1]))).token_ids
    assert alone.item() == together[1].item()
