"""Sampler: greedy, filters, seeded determinism, distribution, logprobs."""
import torch

from oasiskv.layers.sampler import SamplingTensors, sample


def tensors(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None, logprobs=-1):
    return SamplingTensors(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), float(top_p)), min_p=torch.full((n,), float(min_p)),
        generators=generators or [None] * n, all_greedy=temperature == 0,
        needs_filter=top_k > 0 or top_p < 1 or min_p > 0, max_logprobs=logprobs)


def test_greedy_and_filters_that_leave_one_token_pick_the_argmax():
    logits = torch.randn(8, 50)
    want = logits.argmax(-1)
    assert torch.equal(sample(logits, tensors(8, temperature=0)).tokens, want)
    assert torch.equal(sample(logits, tensors(8, top_k=1)).tokens, want)
    assert torch.equal(sample(logits, tensors(8, top_p=1e-6)).tokens, want)
    assert torch.equal(sample(logits, tensors(8, min_p=1.0)).tokens, want)


def test_top_k_and_top_p_never_sample_outside_their_set():
    logits = torch.randn(1, 30).repeat(2000, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(sample(logits, tensors(2000, top_k=5)).tokens.tolist()) <= top5
    probs = logits[0].softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    keep = set(order[: int((sorted_p.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(sample(logits, tensors(2000, top_p=0.5)).tokens.tolist()) <= keep


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, tensors(20000, temperature=0.7), gen).tokens,
                            minlength=4).float()
    want = (logits[0] / 0.7).softmax(-1)
    assert torch.allclose(counts / counts.sum(), want, atol=0.015)


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = torch.randn(4, 100)
    g1 = [torch.Generator().manual_seed(7) if i == 2 else None for i in range(4)]
    a = sample(logits, tensors(4, generators=g1), torch.Generator().manual_seed(1)).tokens[2]
    g2 = [torch.Generator().manual_seed(7)]
    b = sample(logits[2:3], tensors(1, generators=g2), torch.Generator().manual_seed(99)).tokens[0]
    assert a == b


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, 40)
    out = sample(logits, tensors(3, temperature=0.5, logprobs=4), torch.Generator().manual_seed(0))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.token_logprobs, ref.gather(-1, out.tokens[:, None])[:, 0])
    assert torch.allclose(out.top_logprobs, ref.topk(4).values)
    assert torch.equal(out.top_ids, ref.topk(4).indices)
