"""clock_add: a pair of marks adds the duration of the work between them, the reference on the host
clock and (GPU) the kernel on the device clock, checked against CUDA event timing, eagerly and
inside a CUDA graph replay. The kernel reads a PTX register, so the interpreter cannot run it."""
import time

import pytest
import torch

from oasiskv.kernels.reference import clock_add_ref


def test_clock_add_ref_times_the_work_between_two_marks():
    acc = torch.zeros(1, dtype=torch.long)
    for _ in range(2):  # pairs add up
        clock_add_ref(acc, -1)
        time.sleep(0.02)
        clock_add_ref(acc, 1)
    assert 0.04 <= acc.item() / 1e9 < 0.5
    with pytest.raises(AssertionError):
        clock_add_ref(acc, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_clock_add_matches_cuda_event_timing(cuda_device, graph):
    from oasiskv.kernels.device_clock import clock_add
    acc = torch.zeros(1, dtype=torch.long, device=cuda_device)
    stream = torch.cuda.Stream()

    def work():
        for cycles in (20_000_000, 2_000_000):  # two pairs, ~10 ms and ~1 ms
            clock_add(acc, -1)
            torch.cuda._sleep(cycles)
            clock_add(acc, 1)

    run = work
    clock_add(acc, -1)  # compile outside the timed region
    clock_add(acc, 1)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            work()
        run = g.replay
    for _ in range(3):
        torch.cuda.synchronize()
        acc.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            run()
            end.record()
        torch.cuda.synchronize()
        events_ms, clock_ms = begin.elapsed_time(end), acc.item() / 1e6
        assert 0.8 * events_ms <= clock_ms <= events_ms + 0.05, (clock_ms, events_ms)
