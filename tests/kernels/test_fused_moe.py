"""fused_moe (Triton) and align_pairs vs the torch reference, and the reference vs a dense
computation of every expert."""
import pytest
import torch

from oasiskv.kernels import fused_moe, reference


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    probs = torch.rand(tokens, experts, generator=gen).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def test_reference_equals_every_expert_computed_and_weighted():
    x, w13, w2, weights, ids = _case(9, 6, 2, 16, 8, torch.float64)
    dense = torch.zeros_like(x)
    for e in range(6):
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        dense += y * ((ids == e) * weights).sum(-1, keepdim=True)
    torch.testing.assert_close(reference.fused_moe_ref(x, w13, w2, weights, ids), dense)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 4, 1, 16), (13, 8, 3, 16),
                                                         (40, 5, 2, 4), (0, 3, 2, 16)])
def test_align_pairs_sorts_pairs_into_whole_blocks_of_one_expert(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, top_k, dtype=torch.long)
    pair_ids, block_expert = fused_moe.align_pairs(ids, experts, block_m)
    pairs = tokens * top_k
    assert pair_ids.numel() % block_m == 0 and block_expert.numel() == pair_ids.numel() // block_m
    assert pair_ids.numel() >= pairs + experts * (block_m - 1)
    real = pair_ids[pair_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (pair_ids[pair_ids >= pairs] == pairs).all()  # the rest is padding
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = pair_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows.long()] == e).all()
    # each expert's pairs keep their order (stable), in consecutive blocks
    for e in range(experts):
        mine = [p for p in real.tolist() if flat[p] == e]
        assert mine == sorted(mine)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 4, 2, 32, 16),
                                                                (19, 8, 3, 64, 48),
                                                                (3, 16, 1, 48, 32)])
def test_fused_moe_equals_reference(dtype, tol, tokens, experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens)
    got = fused_moe.fused_moe(x, w13, w2, weights, ids)
    want = reference.fused_moe_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_fused_moe_compiled_at_a_qwen3_30b_a3b_shape_equals_reference(cuda_device):
    """128 experts, top-8, hidden 2048, expert width 768, a decode batch of 64 tokens, bf16."""
    x, w13, w2, weights, ids = _case(64, 128, 8, 2048, 768, torch.bfloat16)
    x, w13, w2, weights, ids = (t.to(cuda_device) for t in (x, w13, w2, weights, ids))
    got = fused_moe.fused_moe(x, w13, w2, weights, ids)
    want = reference.fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
