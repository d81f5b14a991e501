"""publish: copy a device array into pinned host memory, then raise a flag the host polls, so that a
value a CUDA graph makes in the middle of a replay reaches the host before the replay ends (a memcpy
node would do the copy, but not the ordering guarantee the flag needs, and a captured event cannot
tell one replay's record from the last one's).

Contract: ``src`` int64 ``[n]`` on the device; ``dst`` int64 ``[>= n]`` and ``flag`` int32
``[1]`` in pinned host memory (written through UVA). One program copies ``src`` into ``dst[:n]``,
then sets ``flag[0] = 1`` with a system-scope release after a barrier: a host that reads the flag
set reads the whole copy. The host clears the flag while no launch that publishes into it is in
flight. No host sync; CUDA-graph capturable (``n`` is read at launch).
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _publish_kernel(src_ptr, dst_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's stores, then the flag
    tl.atomic_xchg(flag_ptr, 1, sem="release", scope="sys")


def publish(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor) -> None:
    """``dst[:n] = src`` (``n = src.numel()``), then ``flag[0] = 1``, in that order as the host
    sees them; one program on the current stream."""
    assert src.dtype == dst.dtype == torch.int64 and src.dim() == dst.dim() == 1
    assert src.is_contiguous() and dst.is_contiguous() and dst.numel() >= src.numel()
    assert flag.dtype == torch.int32 and flag.numel() == 1
    _publish_kernel[(1,)](src, dst, flag, src.numel(), BLOCK=BLOCK, num_warps=4)
