"""paged_decode_attention (Triton split-K) vs paged_decode_ref vs a dense float64 computation.

Caches are poisoned with NaN wherever a correct kernel must not read (tails of last blocks, unused
blocks, which block-table garbage points at) and outputs are pre-filled with NaN.
"""
import math

import pytest
import torch

from oasiskv.kernels.reference import paged_decode_ref
from oasiskv.kernels.paged_decode import default_num_splits, paged_decode_attention
from tests.helpers import capture_graph

NAN = float("nan")


def _case(lens, num_kv_heads, group, head_dim, block_size, dtype, extra_cols=2, poison_blocks=3,
          seed=0, device="cpu"):
    """Random q, NaN-poisoned paged caches, a block table over a random permutation of block ids
    whose unused entries point at all-NaN blocks, and context_lens. Returns
    (q, k_cache, v_cache, tables, lens)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    counts = [-(-n // block_size) for n in lens]
    max_blocks = max(counts) + extra_cols
    num_blocks = sum(counts) + poison_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    poison = perm[sum(counts):]
    k_cache[poison] = NAN
    v_cache[poison] = NAN
    tables = poison[torch.randint(len(poison), (batch, max_blocks), generator=gen)]
    used = 0
    for row, (n, c) in enumerate(zip(lens, counts)):
        tables[row, :c] = perm[used:used + c]
        used += c
        if n % block_size:  # tail of the last block is not part of the context
            k_cache[tables[row, c - 1], :, n % block_size:] = NAN
            v_cache[tables[row, c - 1], :, n % block_size:] = NAN
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, tables.to(torch.int32), lens_t)]


def _dense(q, k_cache, v_cache, tables, lens, scale):
    """Independent float64 attention: gather each row's tokens one by one, softmax per head."""
    batch, num_q_heads, head_dim = q.shape
    block_size, group = k_cache.shape[2], num_q_heads // k_cache.shape[1]
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    kv_of = torch.arange(num_q_heads) // group
    for row, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = tables[row].cpu().long()[pos // block_size]
        k = k_cache.cpu()[blocks, :, pos % block_size].double()[:, kv_of]  # [n, Hq, D]
        v = v_cache.cpu()[blocks, :, pos % block_size].double()[:, kv_of]
        scores = torch.einsum("hd,thd->ht", q[row].cpu().double(), k) * scale
        out[row] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out


def _run_and_check(case, blocks_per_split, rtol, atol):
    q, k_cache, v_cache, tables, lens = case
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full_like(q, NAN)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out,
                                 blocks_per_split=blocks_per_split)
    assert got is out and got.isfinite().all(), "output not fully written or not finite"
    ref = paged_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    dense = _dense(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(ref.double().cpu(), dense.to(q.dtype).double(), rtol=rtol, atol=atol)
    assert (got[lens == 0] == 0).all()
    return got


# Context lengths: a padding row, one not a multiple of the block size, one exactly one block.
LENS = [37, 0, 100, 16]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size,blocks_per_split",
                         [(16, None), (16, 1), (16, 3), (32, None), (32, 1)],
                         ids=["bs16-1split", "bs16-bps1", "bs16-bps3", "bs32-1split", "bs32-bps1"])
def test_paged_decode_fp32(group, block_size, blocks_per_split):
    case = _case(LENS, num_kv_heads=2, group=group, head_dim=64, block_size=block_size,
                 dtype=torch.float32)
    _run_and_check(case, blocks_per_split, rtol=1e-5, atol=1e-5)


def test_paged_decode_split_invariance_and_head_dim_128():
    case = _case([70, 5, 0], num_kv_heads=1, group=4, head_dim=128, block_size=16,
                 dtype=torch.float32, seed=1)
    outs = [_run_and_check(case, bps, rtol=1e-5, atol=1e-5) for bps in (None, 2)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_paged_decode_bf16_noncontiguous_q():
    q, k_cache, v_cache, tables, lens = _case([50, 0, 33], num_kv_heads=2, group=2, head_dim=64,
                                              block_size=16, dtype=torch.bfloat16, seed=2)
    # row/head strides of a wider buffer
    q_view = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :64]
    assert not q_view.is_contiguous()
    # bf16 output: the interpreter truncates fp32 -> bf16 instead of rounding, so allow ~1 ulp.
    _run_and_check((q_view, k_cache, v_cache, tables, lens), 1, rtol=1e-2, atol=1e-2)


def test_paged_decode_default_splits_long_context():
    """A 1024-token table at batch 1 makes the default heuristic split (4 splits, per-row runs)."""
    case = _case([1000], num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32,
                 extra_cols=1, seed=3)
    assert default_num_splits(1, 1, case[3].shape[1], 16) == 4
    _run_and_check(case, None, rtol=1e-5, atol=1e-5)


def test_paged_decode_default_splits_with_table_wider_than_contexts():
    """Graph-style tables (much wider than the contexts): each row spreads its own blocks over the
    splits."""
    case = _case([600, 17, 300], num_kv_heads=1, group=2, head_dim=64, block_size=16,
                 dtype=torch.float32, extra_cols=40, seed=5)
    assert default_num_splits(3, 1, case[3].shape[1], 16) > 2
    _run_and_check(case, None, rtol=1e-5, atol=1e-5)


def test_split_merge_counters_are_zero_after_each_launch():
    """The last split of each (row, kv head) to finish merges the partials and resets its counter:
    after a split launch every counter is 0 again, so the next launch (another batch, reusing the
    same counters) is right too."""
    from oasiskv.kernels.paged_decode import split_workspace
    for seed, lens in ((6, [90, 3, 41]), (7, [12, 77])):
        case = _case(lens, num_kv_heads=2, group=2, head_dim=32, block_size=16,
                     dtype=torch.float32, seed=seed)
        _run_and_check(case, 2, rtol=1e-5, atol=1e-5)
        counters = split_workspace(case[0], 2, len(lens) * 2)[3]
        assert counters.dtype == torch.int32 and not counters.any()


def test_paged_decode_all_padding():
    q, k_cache, v_cache, tables, lens = _case([0, 0], num_kv_heads=1, group=4, head_dim=64,
                                              block_size=16, dtype=torch.float32, extra_cols=3)
    for bps in (None, 1):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                     out=torch.full_like(q, NAN), blocks_per_split=bps)
        assert (out == 0).all()


def test_default_num_splits():
    # Short tables and large batches: one split.
    assert default_num_splits(1, 8, 16, 16) == 1
    assert default_num_splits(64, 8, 2048, 16) == 1
    # Long contexts at small batch: enough splits to fill the GPU.
    assert default_num_splits(1, 8, 2048, 16) == 61
    # 2 splits would leave the second wave half empty
    assert default_num_splits(48, 8, 1024, 16) == 4
    assert default_num_splits(24, 8, 2048, 16) == 8
    assert default_num_splits(48, 8, 1024, 16, wave=264) == 2
    assert default_num_splits(8, 8, 1024, 16) == 8
    assert default_num_splits(32, 8, 2048, 16) == 2


# ---------------------------------------------------------------- GPU (compiled) tests


def _gpu_case(batch, max_len, device, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[::7] = torch.randint(1, 17, lens[::7].shape, generator=gen)  # some very short rows
    return _case(lens.tolist(), num_kv_heads=8, group=4, head_dim=128, block_size=16,
                 dtype=torch.bfloat16, seed=seed, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_split", [None, 8])
def test_paged_decode_gpu_realistic(cuda_device, blocks_per_split):
    q, k_cache, v_cache, tables, lens = _gpu_case(64, 16384, cuda_device, seed=4)
    lens[3] = 0
    scale = 1.0 / math.sqrt(128)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                 out=torch.full_like(q, NAN), blocks_per_split=blocks_per_split)
    ref = paged_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    assert out.isfinite().all() and (out[3] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,block_size,group,head_dim,tol", [
    (torch.float32, 16, 1, 64, 1e-5), (torch.float16, 32, 4, 128, 2e-3)],
    ids=["fp32-bs16", "fp16-bs32"])
def test_paged_decode_gpu_dtypes(cuda_device, dtype, block_size, group, head_dim, tol):
    lens = torch.randint(1, 4097, (16,), generator=torch.Generator().manual_seed(8)).tolist()
    case = _case(lens + [0], num_kv_heads=4, group=group, head_dim=head_dim, block_size=block_size,
                 dtype=dtype, seed=8, device=cuda_device)
    for bps in (None, 4):
        _run_and_check(case, bps, rtol=10 * tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture
def test_split_decode_graphs_sharing_a_pool_replay_in_any_order(cuda_device):
    """Split launches captured at two batch sizes (each warmed up first, as the engine does) and a
    one-split one, all in one memory pool, replayed in every order: every replay equals the
    reference, so the shared split counters are zero whenever a graph starts. A split launch whose
    counters would be made inside the capture is refused."""
    from oasiskv.kernels import paged_decode
    scale = 1.0 / math.sqrt(128)
    cases = [_gpu_case(batch, 4096, cuda_device, seed=seed) for batch, seed in ((3, 11), (5, 12))]
    device = cases[0][0].device
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):  # (more counters than any launch made)
            paged_decode._split_counters(device, 1 << 30)
    torch.cuda.synchronize()
    runs, pool = [], None
    for case, splits in ((cases[1], 1), (cases[1], 6), (cases[0], 4)):
        out = torch.full_like(case[0], NAN)
        def step(case=case, splits=splits, out=out):
            paged_decode_attention(*case, scale, out=out, num_splits=splits)
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        pool = graph.pool() if pool is None else pool
        runs.append((graph, out, paged_decode_ref(*case, scale)))
    for order in ((2, 1, 0, 2), (1, 2, 1, 0)):
        for i in order:
            graph, out, ref = runs[i]
            out.fill_(NAN)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-3)
    assert not paged_decode._counters[device][-1].any()


@pytest.mark.gpu
def test_paged_decode_cuda_graph_replay(cuda_device):
    """Capture once with short contexts, then change q/context_lens/block_tables contents (contexts
    up to the table's 16K capacity, so more splits in use; padding rows) and replay: the graph's
    fixed grid must still give the right answer. Block 0 is all NaN and is what unused table entries
    point at."""
    batch, max_blocks, num_blocks, scale = 8, 1024, 600, 1.0 / math.sqrt(128)
    gen = torch.Generator(device=cuda_device).manual_seed(5)
    shape = (num_blocks, 8, 16, 128)
    k_cache = torch.randn(shape, generator=gen, device=cuda_device).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen, device=cuda_device).to(torch.bfloat16)
    k_cache[0] = NAN
    v_cache[0] = NAN
    static_q = torch.randn(batch, 32, 128, generator=gen, device=cuda_device).to(torch.bfloat16)
    static_tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=cuda_device)
    static_lens = torch.zeros(batch, dtype=torch.int32, device=cuda_device)
    static_out = torch.full_like(static_q, NAN)

    def fill(max_len):
        lens = torch.randint(1, max_len + 1, (batch,), generator=gen, device=cuda_device,
                             dtype=torch.int32)
        lens[1] = 0
        ids = torch.randint(1, num_blocks, (batch, max_blocks), generator=gen, device=cuda_device)
        used = torch.arange(max_blocks, device=cuda_device) < ((lens + 15) // 16)[:, None]
        static_lens.copy_(lens)
        static_tables.copy_(torch.where(used, ids, 0))

    def step():
        paged_decode_attention(static_q, k_cache, v_cache, static_tables, static_lens, scale,
                               out=static_out)

    fill(64)
    graph = capture_graph(step)

    for max_len in (64, 16 * max_blocks, 3000):
        fill(max_len)
        static_q.copy_(torch.randn(static_q.shape, generator=gen, device=cuda_device))
        static_out.fill_(NAN)
        graph.replay()
        ref = paged_decode_ref(static_q, k_cache, v_cache, static_tables, static_lens, scale)
        torch.cuda.synchronize()
        assert static_out.isfinite().all() and (static_out[1] == 0).all()
        torch.testing.assert_close(static_out.float(), ref.float(), rtol=1e-2, atol=2e-3)
