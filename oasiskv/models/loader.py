"""Find a checkpoint (local folder, hub id, bench preset or the built-in demo model) and load it.

Owns: path resolution with clear errors, reading single or sharded safetensors, building the shared
decoder on the target device and dtype. Knows nothing about the engine.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from oasiskv.config import ModelConfig
from oasiskv.models.decoder import CausalLM

logger = logging.getLogger(__name__)

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"
PRESETS = Path(__file__).resolve().parents[1] / "bench" / "configs"


def preset_names() -> list[str]:
    return sorted(p.parent.name for p in PRESETS.glob("*/config.json"))


def resolve_model_path(model: str) -> Path:
    """Return a local folder holding ``config.json`` for ``model``.

    ``""`` -> the built-in demo model; an existing folder -> itself; a bench preset name (e.g.
    ``qwen3-8b``) -> a folder with only a config (use ``load_format="dummy"``); otherwise a hub id
    fetched through huggingface_hub. Raises ``FileNotFoundError`` with what to do instead.
    """
    if not model:
        return DEMO_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: "
                                    "pass a folder holding an HF checkpoint")
        return path
    if model in preset_names():
        return PRESETS / model
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder with config.json, a bench preset "
            f"({', '.join(preset_names())}), nor a hub id of the form owner/name")
    return _download(model)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:  # offline, unknown repo, auth: all end the same way for the user
        raise FileNotFoundError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). If this machine is offline, download it elsewhere "
            f"and pass the local folder path instead, "
            f"e.g. `oasiskv generate /path/to/{repo_id.split('/')[-1]}`") from None


def safetensors_files(path: Path) -> list[Path]:
    """Checkpoint shards in ``path``: from ``model.safetensors.index.json`` when present."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is corrupt ({exc}); re-download the checkpoint") from None
        files = [path / s for s in shards]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{path} lacks shards named in its index: {missing[:3]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights "
                                "(only safetensors checkpoints load)")
    return files


#: checkpoints at least this large show a progress bar (bytes read) on stderr while they load
PROGRESS_MIN_BYTES = 256 << 20


def iter_weights(path: Path, progress_min_bytes: int = PROGRESS_MIN_BYTES):
    """(HF name, tensor) of every tensor of the checkpoint's shards, with a progress bar over the
    shards' bytes when they add up to ``progress_min_bytes`` or more."""
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    total = sum(f.stat().st_size for f in files)
    logger.info("loading %s: %d shard(s), %.2f GB", path.name, len(files), total / 1e9)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
              disable=total < progress_min_bytes, mininterval=1.0) as progress:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        tensor = f.get_tensor(name)
                        progress.update(tensor.numel() * tensor.element_size())
                        yield name, tensor
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"cannot read {file}: {exc}; "
                                 "the file is corrupt or truncated") from None


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, load_format: str = "auto") -> CausalLM:
    """Build the decoder on ``device`` in ``dtype`` and fill it (checkpoint or random weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        if load_format == "dummy":
            model.init_random()
        else:
            model.load_weights(iter_weights(path))
    logger.info("loaded %s (%s, %.1fM params) on %s", path.name, cfg.architecture,
                sum(p.numel() for p in model.parameters()) / 1e6, device)
    return model.eval()
