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
