"""Bad input raises exceptions that say what is wrong; the engine keeps serving other requests."""
import json
import os
import subprocess
import sys

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.models.loader import resolve_model_path
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(seed=-1), "seed"),
    (dict(logprobs=99), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
])
def test_invalid_sampling_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate(vocab_size=1000)


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="missing required field"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_corrupt_and_mismatched_weights(tmp_path, tiny):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(bad))
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["hidden_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match the weights"):
        LLM(str(bad))


def test_hub_id_offline_fails_fast_with_advice(tmp_path):
    code = ("from oasiskv.models.loader import resolve_model_path\n"
            "try:\n    resolve_model_path('someone/some-model')\n"
            "except FileNotFoundError as e:\n    print(e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert "someone/some-model" in out.stdout and "local folder" in out.stdout


def test_bad_requests_leave_the_engine_serving(tiny):
    llm = LLM(str(tiny), num_kv_blocks=64, max_model_len=128)
    engine = llm.engine
    good = engine.add_request([1, 2, 3],
                              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="context limit is 128"):
        engine.add_request(list(range(1, 200)), SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"in \[0, 320\)"):
        engine.add_request([1, 5000], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text prompt", SamplingParams())
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == [good]
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 5


def test_a_failing_step_fails_its_requests_only(tiny, monkeypatch):
    llm = LLM(str(tiny), num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params)
    engine.step()  # prefill of the first request
    real_launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = engine.step()
    assert [(o.request_id, o.finish_reason) for o in failed] == [(first, "error")]
    assert "boom" in failed[0].error
    monkeypatch.setattr(engine.runner, "launch", real_launch)
    second = engine.add_request([4, 5], params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_id == second and len(outs[-1].token_ids) == 4
    assert engine.allocator.num_free_blocks == 64


def test_engine_config_rejects_nonsense():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="summary_dtype"):
        EngineConfig.from_flat(summary_dtype="fp4")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=-16)


@pytest.mark.parametrize("kv_mode, kv_cache_dtype, asked, block_size", [
    ("dense", "auto", 0, 16), ("dense", "fp8", 0, 32), ("dense", "int8", 0, 32),
    ("oasis", "fp8", 0, 16), ("dense", "fp8", 16, 16), ("oasis", "auto", 64, 64)])
def test_block_size_auto_picks_32_tokens_for_a_dense_8_bit_pool(kv_mode, kv_cache_dtype, asked,
                                                               block_size):
    config = EngineConfig(kv_mode=kv_mode, kv_cache_dtype=kv_cache_dtype, block_size=asked)
    assert config.block_size == block_size


@pytest.mark.parametrize("kv_cache_dtype, summary_dtype, fp8", [
    ("auto", "auto", False), ("fp8", "auto", True), ("fp8", "model", False),
    ("auto", "fp8", True), ("fp8", "fp8", True), ("int8", "auto", True), ("int8", "model", False)])
def test_block_summaries_follow_the_kv_cache_unless_told(kv_cache_dtype, summary_dtype, fp8):
    config = EngineConfig.from_flat(kv_mode="oasis", kv_cache_dtype=kv_cache_dtype,
                                    summary_dtype=summary_dtype)
    assert config.fp8_summaries is fp8


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"), (dict(top_k=2**40), "top_k"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_values_that_would_fail_mid_step_are_rejected_up_front(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate(vocab_size=1000)


def test_loading_shows_progress_for_large_checkpoints(tmp_path, capsys):
    """Checkpoints of at least ``PROGRESS_MIN_BYTES`` show a progress bar of bytes read on stderr
    (here the threshold is lowered to the tiny model's size); smaller ones load silently."""
    from oasiskv.models.loader import iter_weights
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    capsys.readouterr()
    names = [name for name, _ in iter_weights(path)]
    assert names and "loading m" not in capsys.readouterr().err
    assert [name for name, _ in iter_weights(path, progress_min_bytes=size)] == names
    err = capsys.readouterr().err
    assert "loading m" in err and "100%" in err
