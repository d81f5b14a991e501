"""Open blocks (``kv_open_block=model``): beside an 8-bit dense pool each running sequence keeps the
block its tokens are written into in the model's dtype, and attention reads it from there.

What must hold: while every token a query attends sits in open blocks or in the step's own K/V
(contexts within one block, prefilled in chunks or not), an 8-bit pool gives the tokens of the
16-bit pool exactly; a chunk whose prefix ends inside a block reads that block exact even when the
chunk itself goes on into the next block (which reuses the same open slot); with ``kv`` the open
block is read from the 8-bit pool as every other; sequence slots never leak."""
import pytest
import torch

from oasiskv import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def run(path, prompts, params, **kw):
    llm = LLM(str(path), num_kv_blocks=256, max_num_seqs=4, **kw)
    outs = llm.generate(prompts, params)
    alloc = llm.engine.allocator
    assert alloc.slot_of == {} and len(alloc.free_slots) == (alloc.num_seq_slots or 0)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("chunk", [8192, 4], ids=["one-prefill", "chunks-of-4"])
def test_contexts_within_one_block_decode_as_the_16_bit_pool(tiny, kv, chunk):
    prompts = [[5, 9, 17, 3, 11, 250, 7], [40, 41, 42], [300, 2, 2, 2, 2, 8, 9, 10, 11]]
    want = run(tiny, prompts, SHORT, max_num_batched_tokens=chunk)
    got = run(tiny, prompts, SHORT, max_num_batched_tokens=chunk, kv_cache_dtype=kv)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        torch.testing.assert_close(lp_got, lp_want, rtol=0, atol=1e-5)
    # read from the 8-bit pool instead, the same steps differ
    quantized = run(tiny, prompts, SHORT, max_num_batched_tokens=chunk, kv_cache_dtype=kv,
                    kv_open_block="kv")
    assert any(q != w for (_, q), (_, w) in zip(quantized, want))


def test_a_chunk_past_its_prefix_block_reads_the_prefix_block_exact(tiny):
    """Chunks of 12 over a 30-token prompt: the second chunk's prefix ends inside block 0 and the
    chunk writes block 1 into the same open slot. Layer 0's attention (its K/V depend on the
    tokens only) then sees exact keys wherever the 16-bit pool does: its outputs equal that
    pool's for the chunks whose prefix has no full block yet."""
    prompt = list(range(3, 33))
    seen = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tiny), num_kv_blocks=64, max_num_batched_tokens=12, kv_cache_dtype=kv,
                  block_size=16)  # (the blocks the chunks are laid over)
        outs = seen[kv] = []
        attn = llm.engine.runner.model.layers[0].attn
        handle = attn.register_forward_hook(lambda m, args, out: outs.append(out.clone()))
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        handle.remove()
    first, second = seen["auto"][:2], seen["fp8"][:2]  # chunks [0, 12) and [12, 24)
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # the third chunk's prefix holds block 0 whole, read from the 8-bit pool: it differs
    assert not torch.allclose(seen["auto"][2], seen["fp8"][2], rtol=0, atol=1e-6)
