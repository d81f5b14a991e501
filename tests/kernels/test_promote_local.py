"""promote_local (a filled local block into its working set, one Triton launch) vs its reference:
same working sets, tables and scales on random residency, with rows done and not done, rows with
empty slots (the first empty wins) and full ones (least recently selected wins, ties to the lowest
slot), rows naming a subset of the sequence slots out of order, bf16 and FP8 (scales move with their
rows). CPU runs use the Triton interpreter; ``-m gpu`` repeats it at the Qwen3-8B shape inside a
CUDA graph."""
import pytest
import torch

from oasiskv.kernels.fp8 import FP8, as_bytes
from oasiskv.kernels.promote_local import promote_local
from oasiskv.kernels.reference import promote_local_ref
from tests.helpers import capture_graph


def _case(n=5, num_seqs=7, heads=3, k=5, block=16, dim=16, fp8=False, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_seqs, heads, k + 1, block, dim)
    ws_k, ws_v = (torch.randn(shape, generator=gen) for _ in range(2))
    scales = None
    if fp8:
        ws_k, ws_v = ws_k.to(FP8), ws_v.to(FP8)
        scales = tuple(torch.rand(shape[:-1], generator=gen) for _ in range(2))
    ws_map = torch.randint(-1, 40, (num_seqs, heads, k + 1), generator=gen, dtype=torch.int32)
    ws_map[0] = torch.arange(k + 1, dtype=torch.int32)  # a full row
    ws_last = torch.randint(0, 4, (num_seqs, heads, k), generator=gen)  # ties
    slots = torch.randperm(num_seqs, generator=gen)[:n].to(torch.int32)
    slots[0] = 0
    done = torch.rand(n, generator=gen) < 0.6
    done[0] = True
    block = torch.randint(40, 80, (n,), generator=gen)
    now = torch.tensor(100)
    tensors = [ws_k, ws_v, scales, ws_map, ws_last, slots, done, block, now]
    return [None if t is None else tuple(x.to(device) for x in t) if isinstance(t, tuple)
            else t.to(device) for t in tensors]


def _state(case):
    ws_k, ws_v, scales, ws_map, ws_last = case[:5]
    return [as_bytes(ws_k).clone(), as_bytes(ws_v).clone(), ws_map.clone(), ws_last.clone(),
            *(s.clone() for s in scales or ())]


def _clone(case):
    return [None if t is None else tuple(x.clone() for x in t) if isinstance(t, tuple)
            else t.clone() for t in case]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_promote_local_matches_reference(fp8, seed):
    case = _case(fp8=fp8, seed=seed)
    want = _clone(case)
    before = _state(case)
    promote_local(*case)
    promote_local_ref(*want)
    for got, exp in zip(_state(case), _state(want)):
        assert torch.equal(got, exp)
    changed = [not torch.equal(a, b) for a, b in zip(_state(case), before)]
    assert all(changed)  # something moved in every tensor


def test_promote_local_policy():
    """Row 0's head 0: slot 2 empty -> it gets the block; head 1 full, stamps [5, 3, 3, 9] -> slot 1
    (the lowest of the ties); a row not done keeps everything."""
    shape = (2, 2, 5, 16, 16)
    ws_k = torch.arange(torch.tensor(shape).prod().item(), dtype=torch.float32).view(shape)
    ws_v = -ws_k
    ws_map = torch.tensor([[[0, 1, -1, 3, -1], [4, 5, 6, 7, -1]]] * 2, dtype=torch.int32)
    ws_last = torch.tensor([[[1, 1, 1, 1], [5, 3, 3, 9]]] * 2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    done = torch.tensor([True, False])
    keep_k, keep_map = ws_k.clone(), ws_map.clone()
    promote_local(ws_k, ws_v, None, ws_map, ws_last, slots, done, torch.tensor([8, 9]),
                  torch.tensor(42))
    assert ws_map[0].tolist() == [[0, 1, 8, 3, -1], [4, 8, 6, 7, -1]]
    assert ws_last[0].tolist() == [[1, 1, 42, 1], [5, 42, 3, 9]]
    assert torch.equal(ws_k[0, 0, 2], keep_k[0, 0, 4])
    assert torch.equal(ws_k[0, 1, 1], keep_k[0, 1, 4])
    assert torch.equal(ws_v[0, 0, 2], -keep_k[0, 0, 4])
    assert torch.equal(ws_k[1], keep_k[1]) and torch.equal(ws_map[1], keep_map[1])


@pytest.mark.gpu
def test_promote_local_gpu_qwen3_8b_shape_in_a_graph(cuda_device):
    """8 kv heads, K = 128, B = 16, D = 128, FP8 and bf16, 64 rows: the capture's warm-up run and a
    graph replay equal the reference run twice on a CPU copy."""
    for fp8 in (False, True):
        case = _case(n=64, num_seqs=80, heads=8, k=128, dim=128, fp8=fp8, device=cuda_device)
        if not fp8:
            case[0], case[1] = case[0].bfloat16(), case[1].bfloat16()
        want = [None if t is None else tuple(x.cpu() for x in t) if isinstance(t, tuple)
                else t.cpu() for t in _clone(case)]
        graph = capture_graph(lambda: promote_local(*case))
        want_before = _state(want)
        graph.replay()
        torch.cuda.synchronize()
        promote_local_ref(*want)
        promote_local_ref(*want)
        assert any(not torch.equal(a, b) for a, b in zip(_state(want), want_before))
        for got, exp in zip(_state(case), _state(want)):
            assert torch.equal(got.cpu(), exp)
