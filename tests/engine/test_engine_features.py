"""Engine features on the built-in demo model: stops, streaming, seeds, logprobs, abort, CLI,
bench."""
import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.engine.sequence import Sequence
from oasiskv.models.loader import DEMO_MODEL


@pytest.fixture(scope="module")
def llm():
    return LLM("", num_kv_blocks=256, max_model_len=1024)


def test_stop_string_is_cut_and_stop_token_kept(llm):
    free = llm.generate("def add(a, b):",
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length"
    stop = free.text[5:9]
    out = llm.generate("def add(a, b):",
                       SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    tok = free.token_ids[3]
    out = llm.generate("def add(a, b):",
                       SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok]))[0]
    assert (out.finish_reason == "stop"
            and out.token_ids == free.token_ids[: free.token_ids.index(tok) + 1])


def test_streaming_deltas_add_up(llm):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=["zzzz"])
    whole = llm.generate("class Stack:", params)[0]
    chunks = list(llm.stream("class Stack:", params))
    assert "".join(c.new_text for c in chunks) == whole.text
    assert sum(len(c.new_token_ids) for c in chunks) == 30 and chunks[-1].finished


def test_seeded_sampling_repeats_and_differs_by_seed(llm):
    a = llm.generate(["import os\n"] * 3,
                     [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in (1, 2, 1)])
    assert a[0].token_ids == a[2].token_ids != a[1].token_ids
    b = llm.generate("import os\n", SamplingParams(max_tokens=20, temperature=1.0, seed=1))[0]
    assert b.token_ids == a[0].token_ids


def test_logprobs_match_transformers(llm):
    from transformers import AutoModelForCausalLM
    prompt = llm.engine.encode("for i in range(10):\n    print(")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                prompt_logprobs=2))[0]
    ref = AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    logp = ref(ids).logits[0].log_softmax(-1)
    full = prompt + out.token_ids
    assert len(out.prompt_logprobs) == len(prompt) - 1
    for j, entry in enumerate(out.prompt_logprobs, start=1):
        assert entry.token_id == full[j]
        assert entry.logprob == pytest.approx(logp[j - 1, full[j]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == logp[j - 1].topk(2).indices.tolist()
    for i, entry in enumerate(out.logprobs):
        pos = len(prompt) + i - 1
        assert entry.logprob == pytest.approx(logp[pos, full[pos + 1]].item(), abs=1e-4)
        assert len(entry.top) == 3


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    free = engine.allocator.num_free_blocks
    rid = engine.add_request("x = 1\n" * 20, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.allocator.num_free_blocks < free
    assert engine.abort(rid) and not engine.abort(rid)
    assert engine.allocator.num_free_blocks == free and not engine.has_unfinished()


def test_ended_requests_are_let_go_of_while_a_later_step_runs(llm, monkeypatch):
    """A request that ends stays held until the next step's kernels are launched (its token lists'
    release then overlaps them), or the engine has nothing to run; only while the device has
    time. (The device is taken to be busy throughout: a tiny model's step on a GPU may be done
    before the engine asks.)"""
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "_running", lambda: lambda: True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    short = engine.add_request("a = 1\n", params)
    engine.add_request("b = 2\n", SamplingParams(max_tokens=6, ignore_eos=True))
    while short in engine.requests:
        engine.step()
    ended = weakref.ref(engine._ended[-1])
    gc.collect()
    assert ended() is not None
    engine.step()  # the other request still decodes: this step lets go of the first
    gc.collect()
    assert ended() is None and engine.has_unfinished()
    while engine.has_unfinished():
        engine.step()
    assert engine._ended
    assert not engine.idle()  # (lets go of them; a dense pool has no background work)
    assert not engine._ended

    engine._ended.extend(Sequence([1, 2], params) for _ in range(3))
    time_left = iter([True, False])
    engine._release_ended(lambda: lambda: next(time_left))
    assert len(engine._ended) == 2  # one let go of, then the device was done
    engine.release_ended()


def test_chat_uses_plain_fallback_without_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert out.prompt_token_ids == llm.engine.encode("user: hi\nassistant:")
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}])


def test_cli_generate_streams_demo_model():
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "generate", "--prompt",
                          "def main():", "--max-tokens", "12", "--num-kv-blocks", "64"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def main():") and "12 tokens" in out.stderr


def test_cli_bench_prints_table_and_json():
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "bench",
                          "qwen3-tiny", "--context-lens", "48", "--concurrency", "1,max",
                          "--output-lens", "6", "--num-kv-blocks", "32", "--engine", "oasiskv,hf",
                          "--hf-max-batch", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    points = result["points"]
    assert [p["engine"] for p in points] == ["oasiskv", "oasiskv", "hf", "hf"]  # hf: batch 1 and 2
    assert points[1]["concurrency"] == 32 * 16 // 64 and all(p["tok_s"] > 0 for p in points)
    assert "roofline" in out.stdout


def test_cli_bench_names_the_bound_a_point_does_not_fit():
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "bench",
                          "qwen3-tiny", "--context-lens", "48", "--concurrency", "9",
                          "--output-lens", "6", "--num-kv-blocks", "32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    point = json.loads(out.stdout.strip().splitlines()[-1])["points"][0]
    assert point["tok_s"] == 0  # 32 blocks of 16 tokens hold 8 requests of 54 tokens
    assert point["note"] == "does not fit: KV blocks allow 8 requests"


def test_chat_template_is_used_when_the_tokenizer_has_one(llm, monkeypatch):
    from oasiskv.llm import render_chat
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    monkeypatch.setattr(llm.tokenizer, "chat_template", template, raising=False)
    assert render_chat(llm.tokenizer, [{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{{ raise_exception('bad order') }}",
                        raising=False)
    with pytest.raises(ValueError, match="chat template"):
        render_chat(llm.tokenizer, [{"role": "user", "content": "hi"}])
