"""A device clock mark (``clock_add``): ``acc += sign * now``, ``now`` the GPU's global timer in ns,
ordered on the launching stream like any kernel.

A pair of marks, sign -1 before some stream work and +1 after it, adds that work's duration on the
device to ``acc``. Unlike CUDA event timing this works inside a CUDA graph (a replay's marks add up
like an eager step's), which is what the foreground stall clock of the prefetch pipeline needs.

Contract: ``acc`` is one int64 on the device; between the two marks of a pair it holds a meaningless
value (minus a timestamp), so read it only once every pair launched so far has been closed. The
timer (``%globaltimer``) ticks about every microsecond on current GPUs: a region shorter than that
reads as 0 or one tick. The kernel reads a PTX register, so it cannot run in the Triton interpreter;
on CPU tensors the dispatch uses ``clock_add_ref`` (the host clock: CPU work is done when issued).
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["sign"])  # one compiled kernel for both signs
def _clock_kernel(acc_ptr, sign):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(acc_ptr, tl.load(acc_ptr) + sign * now)


def clock_add(acc: torch.Tensor, sign: int) -> None:
    """``acc[0] += sign * now_ns`` on the current stream (one program; CUDA-graph capturable)."""
    assert acc.dtype == torch.int64 and acc.numel() == 1 and sign in (-1, 1)
    _clock_kernel[(1,)](acc, sign, num_warps=1)
