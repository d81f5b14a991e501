"""``to_device_many`` (engine/forward_batch.py): a step's host arrays to the device, one copy."""
import numpy as np
import pytest
import torch

from oasiskv.engine.forward_batch import _RING, to_device_many


def _arrays(step: int) -> list:
    """Lists and numpy arrays of every supported dtype, odd sizes (packing must keep alignment),
    an empty one and a 2-D table, with values that differ per step."""
    return [(list(range(step, step + 7)), torch.long),
            (np.arange(15, dtype=np.int32).reshape(3, 5) + step, torch.int32),
            ([], torch.int32),
            ([0.5 * step, -1.25, 3.0], torch.float32),
            ([step] * 3, torch.int32)]


def _check(got: list[torch.Tensor], arrays: list, device) -> None:
    for tensor, (data, dtype) in zip(got, arrays):
        want = torch.as_tensor(np.asarray(data, dtype=np.float32 if dtype == torch.float32
                                          else np.int64)).to(dtype)
        assert tensor.device.type == torch.device(device).type and tensor.dtype == dtype
        assert tensor.shape == want.shape
        assert torch.equal(tensor.cpu(), want)


def test_to_device_many_on_cpu_keeps_values_dtypes_and_shapes():
    arrays = _arrays(3)
    _check(to_device_many(arrays, torch.device("cpu")), arrays, "cpu")


@pytest.mark.gpu
def test_to_device_many_reuses_its_pinned_buffers_without_corrupting_earlier_copies(cuda_device):
    """More calls than the ring has buffers, the copies queued behind a long kernel (so a buffer is
    refilled while an earlier copy out of it could still be pending): every result keeps its own
    values."""
    results = []
    big = torch.randn(4096, 4096, device=cuda_device)
    for step in range(3 * _RING):
        if step % _RING == 0:
            big = big @ big  # keeps the stream busy while the ring goes round
        arrays = _arrays(step)
        results.append((to_device_many(arrays, cuda_device), arrays))
    torch.cuda.synchronize()
    for got, arrays in results:
        _check(got, arrays, cuda_device)
