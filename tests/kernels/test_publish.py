"""publish: the copy lands in ``dst[:n]`` (nothing past it), the flag rises; and (GPU) a host
polling the pinned flag reads the whole copy while the CUDA graph that published it still runs."""
import time

import pytest
import torch

from oasiskv.kernels.publish import publish
from oasiskv.kernels.reference import publish_ref


@pytest.mark.parametrize("fn", [publish, publish_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("n", [1, 7, 1024, 2500])
def test_publish_copies_the_ids_then_raises_the_flag(fn, n):
    gen = torch.Generator().manual_seed(n)
    src = torch.randint(-1, 1 << 40, (n,), generator=gen, dtype=torch.long)
    dst = torch.full((n + 37,), -5, dtype=torch.long)
    flag = torch.zeros(1, dtype=torch.int32)
    fn(src, dst, flag)
    assert torch.equal(dst[:n], src) and (dst[n:] == -5).all() and flag.item() == 1


def test_publish_rejects_wrong_shapes_and_dtypes():
    src, dst, flag = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), \
        torch.zeros(1, dtype=torch.int32)
    for args in ((src.int(), dst, flag), (src, dst[:3], flag), (src, dst, flag.long())):
        with pytest.raises(AssertionError):
            publish(*args)


@pytest.mark.gpu
def test_the_host_reads_a_published_copy_before_the_graph_ends(cuda_device):
    n = 7168  # 128 rows x 8 kv heads x a cap of 7: a copy list at the Qwen3-8B point
    src = torch.arange(n, dtype=torch.long, device=cuda_device) * 3 + 1
    dst = torch.zeros(n, dtype=torch.long).pin_memory()
    flag = torch.zeros(1, dtype=torch.int32).pin_memory()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        publish(src, dst, flag)
        torch.cuda._sleep(1 << 30)  # a long tail of work behind the publish (about half a second)
    done = torch.cuda.Event()
    for step in range(3):
        flag.zero_()
        dst.zero_()
        src.add_(1)
        torch.cuda.synchronize()
        graph.replay()
        done.record()
        deadline = time.monotonic() + 10
        while not flag.item() and time.monotonic() < deadline:
            pass
        assert flag.item() == 1 and not done.query(), "the flag must rise mid-replay"
        assert torch.equal(dst, src.cpu()), f"replay {step}: the host saw a partial copy"
        torch.cuda.synchronize()
