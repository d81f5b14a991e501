"""wait_ready: returns at once when the counter is there, flags a timeout when it never comes, and
(GPU) holds its stream, inside a CUDA graph too, until another stream advances the counter."""
import pytest
import torch

from oasiskv.kernels.reference import wait_ready_ref
from oasiskv.kernels.wait_ready import wait_ready


def _scalars(done: int, target: int, device="cpu"):
    return (torch.tensor(done, dtype=torch.long, device=device),
            torch.tensor(target, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("fn", [wait_ready, wait_ready_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("done,target,timed_out", [(3, 3, 0), (5, 3, 0), (2, 3, 1), (0, 0, 0)])
def test_wait_ready_returns_or_flags_a_timeout(fn, done, target, timed_out):
    d, t, flag = _scalars(done, target)
    fn(d, t, flag, max_polls=4)
    assert flag.item() == timed_out and d.item() == done and t.item() == target


def test_wait_ready_rejects_wrong_dtypes():
    d, t, flag = _scalars(1, 1)
    with pytest.raises(AssertionError):
        wait_ready(d.int(), t, flag, max_polls=4)
    with pytest.raises(AssertionError):
        wait_ready(d, t, flag.long(), max_polls=4)


def _advance_later(done: torch.Tensor, value: int, stream: torch.cuda.Stream, cycles: int) -> None:
    """On ``stream``: sleep ``cycles`` GPU cycles, then set ``done``."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        done.fill_(value)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_wait_ready_holds_its_stream_until_another_stream_advances(cuda_device, graph):
    done, target, _ = _scalars(0, 1, cuda_device)
    timed_out = torch.zeros(1, dtype=torch.int32).pin_memory()
    seen = torch.full((1,), -1, dtype=torch.long, device=cuda_device)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()

    def consume():
        wait_ready(done, target, timed_out, max_polls=1 << 26)
        seen.copy_(done)  # what the stream sees right after the wait

    run = consume
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=consumer):
            consume()
        run = g.replay
    torch.cuda.synchronize()
    for step in range(1, 4):
        target.fill_(step)
        torch.cuda.synchronize()
        # ~25 ms: the consumer is launched well before
        _advance_later(done, step, producer, 50_000_000)
        with torch.cuda.stream(consumer):
            run()
        torch.cuda.synchronize()
        assert seen.item() == step and timed_out.item() == 0


@pytest.mark.gpu
def test_wait_ready_times_out_instead_of_hanging(cuda_device):
    done, target, _ = _scalars(0, 1, cuda_device)
    timed_out = torch.zeros(1, dtype=torch.int32).pin_memory()
    wait_ready(done, target, timed_out, max_polls=1000)
    torch.cuda.synchronize()
    assert timed_out.item() == 1
