"""The command line as a new user meets it: defaults that fit the machine or a refusal with the
reason, one-line errors instead of tracebacks, --log-level after the command, help with defaults."""
import pytest
import torch

from oasiskv.cli import build_parser, main


def test_bench_refuses_at_once_a_preset_this_cpu_cannot_hold(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    assert main(["bench", "qwen3-32b", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: qwen3-32b has") and "qwen3-tiny" in err
    assert len(err.splitlines()) == 1


def test_storage_that_does_not_fit_is_a_one_line_error(capsys):
    code = main(["--log-level", "WARNING", "generate", "--device", "cpu", "--kv-mode", "oasis",
                 "--host-kv-gib", "100000", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot allocate the host store" in err and "Traceback" not in err


def test_log_level_goes_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["generate"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "ERROR", "generate"]).log_level == "ERROR"
    assert parser.parse_args(["generate", "--log-level", "DEBUG"]).log_level == "DEBUG"
    args = parser.parse_args(["eval", "m", "--text", "t", "--log-level", "DEBUG"])
    assert args.log_level == "DEBUG"


def test_help_shows_defaults_and_no_markup(capsys):
    for argv in (["--help"], ["generate", "--help"], ["bench", "--help"], ["eval", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        text = capsys.readouterr().out
        assert "``" not in text
        if argv != ["--help"]:
            assert "(default:" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens to generate (default: 64)" in text and "0 = greedy (default: 0)" in text


def test_cpu_threads_one_for_small_steps_every_core_for_large_ones():
    import os

    import torch

    from oasiskv import LLM, SamplingParams
    from oasiskv.engine.model_runner import SMALL_STEP_TOKENS, cpu_threads
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(0, 1) == cpu_threads(0, SMALL_STEP_TOKENS - 1) == 1
    assert cpu_threads(0, SMALL_STEP_TOKENS) == cores and cpu_threads(3, 1) == 3
    def threads_per_step(llm, prompt):
        """(tokens, intra-op threads) of each forward of a generation."""
        seen, forward = [], llm.engine.runner.model.forward

        def spy(*args, **kw):
            seen.append((args[0].shape[0], torch.get_num_threads()))
            return forward(*args, **kw)

        llm.engine.runner.model.forward = spy
        llm.generate([prompt], SamplingParams(max_tokens=3))
        return seen

    before = torch.get_num_threads()
    try:
        seen = threads_per_step(LLM(), "def f(x):\n    return x\n" * 4)  # the demo model, CPU
        assert seen[0][0] >= SMALL_STEP_TOKENS and seen[0][1] == cores  # the prefill
        assert seen[1:] and all(t == 1 for n, t in seen[1:])  # one-token decode steps
        assert all(t == 2 for _, t in threads_per_step(LLM(cpu_threads=2), "x"))
    finally:
        torch.set_num_threads(before)


def test_an_emulated_read_latency_is_for_decode_workers_and_below_the_read_deadline(capsys):
    pytest.importorskip("fastapi", reason="serve needs the server extras")
    decode = ["serve", "--role", "decode", "--prefill-url", "http://127.0.0.1:1"]
    for argv, why in ((["serve", "--role", "prefill", "--emulated-read-latency-ms", "5"],
                       "is for --role decode"),
                      (decode + ["--emulated-read-latency-ms", "-1"], "must be >= 0"),
                      (decode + ["--remote-timeout", "1", "--emulated-read-latency-ms", "1000"],
                       "below --remote-timeout, got 1000 ms")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --emulated-read-latency-ms") and why in err, err
