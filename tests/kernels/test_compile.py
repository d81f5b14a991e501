"""The decode path's Triton kernels compile for sm_90 (``scripts/compile_kernels.py``, Triton's
compiler and bundled ptxas, no GPU): CPU tests run them in the interpreter, which never lowers
them. The split kernels must not spill inside their loops at the engine's launch configs (the
one-warp 8-bit paged decode keeps a few values in local memory before and after its loop), and
their merge counts finished splits with a GPU-scope acquire-release atomic
(``paged_decode._store_split``)."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_kernels.py"


def test_decode_kernels_compile_for_sm90_without_spills_in_their_loops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--ptx-grep", "atom.global"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    results = [line for line in lines if line.startswith(("ok", "FAILED"))]
    assert len(results) == 8 and all(line.startswith("ok") for line in results), run.stdout
    for line in results:
        if "decode" in line:
            assert "(0 local accesses in loops)" in line, line
    merging = [i for i, line in enumerate(lines) if "decode" in line and "direct=False" in line]
    assert len(merging) == 3
    for i in merging:
        assert "atom.global.gpu.acq_rel.add" in lines[i + 1], run.stdout
