"""Structure and style: ruff passes on the tree (config in pyproject.toml), and the dense core
(``engine/``, ``models/``) imports nothing of the tier (``kv/``, ``spec/``, the sparse backend) or
of the harness (``bench/``): the tier enters only through the backend lifecycle and the
allocator."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("oasiskv/engine", "oasiskv/models")
FORBIDDEN = ("oasiskv.kv", "oasiskv.spec", "oasiskv.attention.sparse", "oasiskv.bench")


def test_ruff_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def forbidden_imports(source: str) -> list[str]:
    """Modules named by ``import`` / ``from ... import`` in ``source`` (any depth: lazy imports
    inside functions count) that lie in a forbidden package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    return found


def test_the_boundary_check_sees_imports_at_any_depth():
    src = ("import torch\ndef f():\n    from oasiskv.kv.tiered import TieredKV\n"
           "    import oasiskv.spec.base\n")
    assert forbidden_imports(src) == ["oasiskv.kv.tiered", "oasiskv.kv.tiered.TieredKV",
                                      "oasiskv.spec.base"]
    assert forbidden_imports("from oasiskv import kv\nfrom oasiskv.attention import sparse\n") == [
        "oasiskv.kv", "oasiskv.attention.sparse"]
    allowed = "from oasiskv.attention import make_backend\nimport oasiskv.kvx\n"
    assert forbidden_imports(allowed) == []


def test_the_dense_core_imports_nothing_of_the_tier():
    files = [p for folder in CORE for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) >= 10
    bad = {str(p.relative_to(ROOT)): forbidden_imports(p.read_text()) for p in files}
    assert not {k: v for k, v in bad.items() if v}
