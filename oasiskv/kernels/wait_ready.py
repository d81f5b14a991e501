"""A device-side wait (``wait_ready``): the stream that launches it stalls until a counter in device
memory, advanced by work on another stream, reaches a target.

Why a kernel: a CUDA graph replay that must wait, at one point inside it, for work launched outside
it (the lookahead copies a previous replay left on the copy stream) has no stream order to use. An
external event-wait node can express it, but which record of a re-recorded event such a node binds
to is not spelled out, and an event wait cannot time out. A counter that the waiting side compares
with a target makes the ordering explicit, and a copy that never comes becomes an error, not a hang.
A one-program kernel holds up only the nodes behind it.

Contract: ``done`` and ``target`` are int64 device scalars; the kernel returns once
``done >= target`` (both read with volatile loads), or after ``max_polls`` polls, in which case it
sets ``timed_out[0]`` to 1 and returns anyway (a guard against a hang: the caller turns the flag
into an error). ``timed_out`` may be pinned host memory (written through UVA, read by the host
without a sync). Whoever advances ``done`` must do it after the work it stands for, in that work's
stream order.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["max_polls"])  # one compiled kernel for every poll budget
def _wait_kernel(done_ptr, target_ptr, timed_out_ptr, max_polls):
    target = tl.load(target_ptr, volatile=True)
    done = tl.load(done_ptr, volatile=True)
    polls = 0
    while (done < target) & (polls < max_polls):
        done = tl.load(done_ptr, volatile=True)
        polls += 1
    if done < target:
        tl.store(timed_out_ptr, 1)


def wait_ready(done: torch.Tensor, target: torch.Tensor, timed_out: torch.Tensor,
               max_polls: int) -> None:
    """Hold the current stream until ``done >= target`` (int64 scalars); after ``max_polls`` polls
    set ``timed_out[0] = 1`` (int32, one element) and go on. Launches one program; no host sync;
    CUDA-graph capturable (the scalars are read at run time)."""
    assert done.dtype == target.dtype == torch.int64 and done.numel() == target.numel() == 1
    assert timed_out.dtype == torch.int32 and timed_out.numel() == 1 and max_polls >= 1
    _wait_kernel[(1,)](done, target, timed_out, max_polls, num_warps=1)
