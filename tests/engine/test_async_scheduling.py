"""Async scheduling (``LLMEngine``: a decode step launched before the previous step's tokens are
read) changes no output: the same requests, stepped the same way, with it on and off, on the demo
model (eager steps on a CPU take the same path as graph replays on a GPU: inputs from the
device)."""
import pytest

from oasiskv import SamplingParams
from oasiskv.engine.llm_engine import LLMEngine

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "for i in range(10):\n",
           "x = [", "while True:\n    "]


def engine(async_scheduling: bool, **kw) -> LLMEngine:
    return LLMEngine(**{"device": "cpu", "num_kv_blocks": 256, "max_model_len": 512,
                        "block_size": 16, "async_scheduling": async_scheduling, **kw})


def drive(eng: LLMEngine, requests, events=None, forced=None):
    """Step ``eng`` until it is done -> per request: tokens, text, reason, logprobs. ``events``:
    step number -> callable(engine) run before that step (arrivals, aborts); ``forced``: step
    number -> forced tokens."""
    events, forced = events or {}, forced or {}
    for rid, (prompt, params) in requests.items():
        eng.add_request(prompt, params, request_id=rid)
    got, step = {}, 0
    while eng.has_unfinished() or step in events:
        if step in events:
            events[step](eng)
        for out in eng.step(forced.get(step)):
            got[out.request_id] = (out.token_ids, out.text, out.finish_reason,
                                   [(lp.token_id, round(lp.logprob, 4)) for lp in
                                    out.logprobs or []])
        step += 1
    assert not eng.idle()
    assert eng.allocator.num_free_blocks == eng.allocator.num_total_blocks
    return got


def mixed_requests(stop_token: int):
    greedy = dict(temperature=0, ignore_eos=True)
    return {
        "short": (PROMPTS[0], SamplingParams(max_tokens=1, **greedy)),
        "two": (PROMPTS[1], SamplingParams(max_tokens=2, **greedy)),
        "long": (PROMPTS[2], SamplingParams(max_tokens=37, logprobs=2, **greedy)),
        "stop-token": (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0,
                                                  stop_token_ids=[stop_token])),
        "stop-text": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0, stop=["(", ":"])),
        "seeded": (PROMPTS[4], SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9,
                                              seed=7)),
        "aborted": (PROMPTS[5], SamplingParams(max_tokens=40, **greedy)),
    }


@pytest.fixture(scope="module")
def engines():
    return engine(False), engine(True)


def test_outputs_equal_with_and_without_it(engines):
    sync, ahead = engines
    # a token the first prompt's free run samples mid-way: a stop no step can foresee
    sync.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                     request_id="probe")
    probe = None
    while sync.has_unfinished():
        for out in sync.step():
            probe = out.token_ids
    events = {4: lambda e: e.add_request(PROMPTS[1], SamplingParams(max_tokens=9, temperature=0,
                                                                    ignore_eos=True),
                                         request_id="late"),
              7: lambda e: e.abort("aborted")}
    before = ahead.stats.num_steps_ahead
    want = drive(sync, mixed_requests(probe[4]), events)
    got = drive(ahead, mixed_requests(probe[4]), events)
    assert got == want
    assert want["stop-token"][2] == "stop" and want["short"][2] == "length"
    assert ahead.stats.num_steps_ahead - before > 20 and sync.stats.num_steps_ahead == 0


def test_teacher_forcing_and_replaced_tokens_drop_the_step_launched_ahead(engines):
    """A forced step, or a token replaced after a step, wants a step that was launched with the
    sampled token: it is dropped and runs again."""
    sync, ahead = engines
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    requests = {"a": (PROMPTS[2], params), "b": (PROMPTS[3], params), "c": (PROMPTS[4], seeded)}
    forced = {6: {"a": 5}, 7: {"a": 9, "b": 11}}
    # (the dropped step drew from the seeded generator: its draws are undone)
    assert drive(ahead, requests, forced=forced) == drive(sync, requests, forced=forced)

    def replaced(eng):
        eng.add_request(PROMPTS[4], seeded, request_id="s")
        eng.add_request(PROMPTS[2], params, request_id="r")
        outs, step = [], 0
        while eng.has_unfinished():
            outs += eng.step()
            step += 1
            if step == 5:
                assert (eng._ahead is not None) == eng.steps_ahead
                assert eng.replace_last_token("r", 17) is None
        return [(o.token_ids, o.logprobs) for o in outs if o.finished]
    assert replaced(ahead) == replaced(sync)


def test_a_step_launched_ahead_that_fails_fails_its_requests_only(monkeypatch):
    """The step before it still delivers its tokens; the engine serves the next request."""
    eng = engine(True)
    real = eng.runner.launch

    def launch(batch, forced=None, after=None, rows=None):
        if after is not None:
            raise RuntimeError("boom")
        return real(batch, forced, after, rows)
    monkeypatch.setattr(eng.runner, "launch", launch)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng.add_request(PROMPTS[0], params, request_id="a")
    outs = eng.step() + eng.step()  # the prefill; the first decode step, whose successor fails
    assert [(o.request_id, len(o.token_ids), o.finish_reason) for o in outs] == [
        ("a", 1, None), ("a", 2, None), ("a", 2, "error")]
    assert "boom" in outs[-1].error and not eng.has_unfinished()
    monkeypatch.setattr(eng.runner, "launch", real)
    got = drive(eng, {"b": (PROMPTS[1], params)})
    assert got == drive(engine(False), {"b": (PROMPTS[1], params)})


def test_requests_queued_for_kv_wait_while_steps_run_ahead():
    """A pool that holds two of the requests at a time: the others wait, steps still run ahead,
    and each waiting request is admitted at the step it would be one step at a time."""
    params = [SamplingParams(max_tokens=20 + 7 * i, temperature=0, ignore_eos=True)
              for i in range(5)]
    requests = {f"r{i}": (PROMPTS[i] * 4, p) for i, p in enumerate(params)}
    waited = []

    def drive_small(eng):
        for rid, (prompt, p) in requests.items():
            eng.add_request(prompt, p, request_id=rid)
        admitted, step = {}, 0
        while eng.has_unfinished():
            eng.step()
            step += 1
            for seq in eng.scheduler.running:
                admitted.setdefault(seq.request_id, step)
            if eng.scheduler.waiting and eng._ahead is not None:
                waited.append(step)
        return admitted
    sync = engine(False, num_kv_blocks=10)
    ahead = engine(True, num_kv_blocks=10)
    assert drive_small(ahead) == drive_small(sync)
    assert len(waited) > 10
    # two sequence slots: each request that ends by length lets the next one in at once
    waited.clear()
    assert (drive_small(engine(True, max_num_seqs=2))
            == drive_small(engine(False, max_num_seqs=2)))
    assert len(waited) > 10
