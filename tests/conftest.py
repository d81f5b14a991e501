"""Shared test setup.

Without a CUDA GPU, Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must be set before
any module that defines a kernel is imported, so it is set here, at collection start. GPU-only tests
carry the ``gpu`` marker and are deselected by default (``pytest -m gpu`` runs them).
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_FIXTURE_CANDIDATES = [
    os.environ.get("OASISKV_FIXTURES", ""),
    str(Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "pycode-19m"),
    # a partial copy for the GPU machine
    str(Path(__file__).resolve().parents[1] / ".fixtures" / "pycode-19m"),
]


def fixture_dir() -> Path | None:
    """The pycode-19m fixture folder: $OASISKV_FIXTURES, ../shared/fixtures or
    ./.fixtures/pycode-19m."""
    for cand in _FIXTURE_CANDIDATES:
        if cand and (Path(cand) / "target" / "config.json").exists():
            return Path(cand)
    return None


@pytest.fixture(scope="session")
def fixtures_path() -> Path:
    path = fixture_dir()
    if path is None:
        pytest.skip("pycode-19m fixtures not found: set OASISKV_FIXTURES or place them in "
                    "../shared/fixtures")
    return path


@pytest.fixture(scope="session")
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def fixture_part(fixtures_path: Path, name: str) -> Path:
    """A sub-folder of the fixtures (``draft``, ``eagle3``); skips the test when this copy lacks
    it."""
    part = fixtures_path / name
    if not part.exists():
        pytest.skip(f"fixture part {name}/ not present in {fixtures_path}")
    return part
