"""Compile the decode path's Triton kernels for a GPU without one: Triton's own compiler and the
ptxas it bundles, target sm_90 (H100 / H200). Per kernel and config: registers, stack bytes (local
memory: spills and local arrays), the local loads and stores inside loops (spills that cost every
iteration) and shared memory; exits 1 when one fails to compile. CPU tests run the kernels in
Triton's interpreter, which never lowers them: this is what catches a kernel that interprets but
does not compile (``tests/kernels/test_compile.py`` runs it).

python scripts/compile_kernels.py [--ptx-grep TEXT]

(Needs TRITON_INTERPRET unset: with it set, ``@triton.jit`` makes interpreter functions. Uses the
launch configs the engine uses: ``paged_decode.launch_config``.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = ("cuda", 90, 32)


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton signature of ``fn``: ``pointers`` names the element type of each pointer argument
    (``*_ptr``, default float32), floats are the softmax / norm scales, other scalars int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, "fp32")
        else:
            sig[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
    return sig


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, num_warps: int,
                   num_stages: int):
    """The compiled kernel (``triton.compile``) for sm_90, specialized as a launch at real shapes
    specializes it: pointers and strides divisible by 16 (which vectorizes loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = _signature(fn, pointers, constexprs)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name].startswith("*") or name.startswith("stride")}
    source = ASTSource(fn, signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget(*TARGET),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_usage(ptx: str) -> dict[str, int]:
    """registers and stack bytes of ``ptx`` from the bundled ptxas (``-v``), and ``loop_local``:
    the local-memory loads and stores (``LDL`` / ``STL``, spills) inside a loop of the SASS (between
    a backward branch and its target), which cost a memory access per iteration; a few spills
    outside the loops cost nothing that matters."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / "k.ptx", Path(tmp) / "k.o"
        src.write_text(ptx)
        run = subprocess.run([str(bin_dir / "ptxas"), f"-arch=sm_{TARGET[1]}a", "-v", str(src),
                              "-o", str(obj)], capture_output=True, text=True, check=True)
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(obj)],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", run.stderr)
    stack = re.search(r"(\d+) bytes (?:cumulative )?stack", run.stderr)
    return {"registers": int(regs.group(1)) if regs else -1,
            "stack": int(stack.group(1)) if stack else 0,
            "loop_local": _local_accesses_in_loops(sass)}


def _local_accesses_in_loops(sass: str) -> int:
    """``LDL`` / ``STL`` instructions of ``sass`` (cuobjdump's listing) at addresses some backward
    branch jumps over."""
    loops, local = [], []
    for line in sass.splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not found:
            continue
        addr, instr = int(found.group(1), 16), found.group(2)
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", instr)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
        if re.search(r"\b(LDL|STL)\b", instr):
            local.append(addr)
    return sum(any(start <= addr <= end for start, end in loops) for addr in local)


def configs():
    """(name, kernel, pointer dtypes, constexprs, (tokens per iteration, warps, stages)) of the
    kernels a decode step launches, as the engine launches them (Qwen3-8B heads: G = 4, D = 128)."""
    from oasiskv.kernels import paged_decode, sparse_decode, store_kv
    from oasiskv.kernels.fp8 import FP8, MIN_AMAX, QUANT_MAX, SCALE_STEPS
    fp8 = {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv"}
    idx = {"block_tables_ptr": "i32", "context_lens_ptr": "i32", "open_slots_ptr": "i32",
           "count_ptr": "i32"}
    paged16 = dict(idx, q_ptr="bf16", k_cache_ptr="bf16", v_cache_ptr="bf16", open_k_ptr="bf16",
                   open_v_ptr="bf16", out_ptr="bf16")
    heads = dict(G=4, BLOCK_G=16, HEAD_DIM=128, DOT_PRECISION="tf32", INTERPRETED=False)
    min_tokens = paged_decode._MIN_TOKENS_PER_SPLIT
    for direct in (False, True):
        tokens, warps, stages, _ = paged_decode.launch_config(quantized=True)
        yield (f"paged decode, e4m3, 32-token blocks, open blocks, direct={direct}",
               paged_decode._decode_split_kernel, dict(paged16, **fp8),
               dict(heads, BLOCK_SIZE=32, BLOCKS_PER_ITER=tokens // 32,
                    MIN_BLOCKS=min_tokens // 32, DIRECT=direct, QUANT=True, FP16_DOT=True,
                    INDEX_AHEAD=True, OPEN=True),
               (warps, stages))
        tokens, warps, stages, _ = paged_decode.launch_config()
        yield (f"paged decode, bf16, 16-token blocks, direct={direct}",
               paged_decode._decode_split_kernel, paged16,
               dict(heads, BLOCK_SIZE=16, BLOCKS_PER_ITER=tokens // 16,
                    MIN_BLOCKS=min_tokens // 16, DIRECT=direct, QUANT=False, FP16_DOT=False,
                    INDEX_AHEAD=False, OPEN=False),
               (warps, stages))
        tokens, warps, stages, _ = paged_decode.launch_config(quantized=True)
        yield (f"sparse decode, e4m3, drafts, open blocks, direct={direct}",
               sparse_decode._sparse_split_kernel,
               dict(q_ptr="bf16", ws_k_ptr="fp8e4nv", ws_v_ptr="fp8e4nv", ws_map_ptr="i32",
                    seq_slots_ptr="i32", local_lens_ptr="i32", draft_rows_ptr="i32",
                    extra_k_ptr="bf16", extra_v_ptr="bf16", open_k_ptr="bf16", open_v_ptr="bf16",
                    open_slots_ptr="i32", out_ptr="bf16", count_ptr="i32"),
               dict(heads, BLOCK_SIZE=16, SLOTS_PER_ITER=tokens // 16, DIRECT=direct,
                    HAS_DRAFT=True, QUANT=True, FP16_DOT=True, OPEN=True), (warps, stages))
    store = dict(k_ptr="bf16", v_ptr="bf16", k_cache_ptr="fp8e4nv", v_cache_ptr="fp8e4nv",
                 slot_ptr="i64", open_k_ptr="bf16", open_v_ptr="bf16", open_slot_ptr="i64",
                 mirror_k_ptr="fp8e4nv", mirror_v_ptr="fp8e4nv", mirror_slot_ptr="i64")
    e4m3 = dict(BLOCK_H=1, BLOCK_D=128, QMAX=QUANT_MAX[FP8], MIN_AMAX=MIN_AMAX, QUANT=True,
                INT=False, STEPS=SCALE_STEPS, OPEN=True)
    yield ("store, e4m3 with the scale search and open blocks (dense pool)",
           store_kv._store_kv_kernel, store,
           dict(e4m3, BLOCK_SIZE=32, V_LAYOUT=True, MIRROR=False), (4, 3))
    yield ("store, e4m3, tiered decode (host store, local and open blocks)",
           store_kv._store_kv_kernel, store,
           dict(e4m3, BLOCK_SIZE=16, V_LAYOUT=False, MIRROR=True), (4, 3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ptx-grep", help="also print the PTX lines that contain this text")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: kernels would not compile; unset it", file=sys.stderr)
        return 2
    failed = 0
    for name, fn, pointers, constexprs, (warps, stages) in configs():
        try:
            kernel = compile_kernel(fn, pointers, constexprs, warps, stages)
            usage = ptxas_usage(kernel.asm["ptx"])
        except Exception as exc:  # report every config, then fail
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        print(f"ok  {name}: {usage['registers']} registers, {usage['stack']} stack bytes "
              f"({usage['loop_local']} local accesses in loops), {kernel.metadata.shared} shared "
              f"bytes ({warps} warps, {stages} stages)")
        if args.ptx_grep:
            for line in kernel.asm["ptx"].splitlines():
                if args.ptx_grep in line:
                    print("    " + line.strip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
