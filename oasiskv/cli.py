"""Command line: ``oasiskv generate | serve | bench | eval``. Engine flags come from
``EngineConfig``'s fields."""
from __future__ import annotations

import argparse
import logging
import sys

from oasiskv.config import EngineConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field (``max_num_seqs`` -> ``--max-num-seqs``), help from
    metadata."""
    parser.add_argument("model", nargs="?", default="",
                        help="local HF model folder or hub id (default: the built-in demo model)")
    for f in EngineConfig.cli_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, type=kind, default=f.default,
                                help=f"{f.metadata['help']} (default: {f.default})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_flat(model=args.model,
                                  **{f.name: getattr(args, f.name)
                                     for f in EngineConfig.cli_fields()})


def cmd_generate(args: argparse.Namespace) -> int:
    from oasiskv.llm import LLM, render_chat
    from oasiskv.sampling_params import SamplingParams

    llm = LLM(config=engine_config(args))
    prompt = (render_chat(llm.tokenizer, [{"role": "user", "content": args.prompt}])
              if args.chat else args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    if not args.quiet_prompt:
        sys.stdout.write(prompt)
    try:
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    finally:
        llm.close()
    sys.stdout.write("\n")
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from oasiskv.server.api import Disaggregation, serve
    except ImportError as exc:
        raise SystemExit(f"the server needs extra packages ({exc.name}): "
                         f"pip install 'oasiskv[server]'")
    pd = Disaggregation(args.role, tuple(args.prefill_url), args.remote_timeout,
                        args.prefill_timeout, args.local_prefill_blocks, tuple(args.memory_url),
                        args.offload_below_blocks, args.pd_transfer,
                        args.emulated_read_latency_ms / 1e3)
    if pd.transfer == "partial" and pd.role == "decode" and args.f_host >= 1.0:
        raise SystemExit("--pd-transfer partial needs a decode-host cache (--f-host < 1): the "
                         "prompt's blocks stay on the prefill worker until selected")
    return serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key,
                 max_waiting=args.max_waiting, served_model_name=args.served_model_name,
                 max_request_bytes=args.max_request_bytes, pd=pd,
                 emulated_host_gib=args.emulated_host_gib)


def cmd_bench(args: argparse.Namespace) -> int:
    from oasiskv.bench.decode_sweep import run_from_args
    return run_from_args(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from oasiskv.bench.fidelity import run_from_args
    return run_from_args(args)


DESCRIPTION = ("OasisKV: an LLM inference engine and OpenAI-compatible server with tiered KV "
               "(full KV in host memory, per-head working sets in HBM). Commands: generate, "
               "serve, bench, eval; 'oasiskv COMMAND --help' lists each one's flags.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oasiskv", description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    # the same flag after the command too (it then wins)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[common],
                         help="generate text for one prompt, streamed to the terminal")
    add_engine_flags(gen)
    gen.add_argument("--prompt", default="import numpy as np\n\n\ndef ",
                     help="prompt text (default: the start of a Python file)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user chat message")
    gen.add_argument("--max-tokens", type=int, default=64,
                     help="tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling mass; 1 = off (default: 1)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample among the k likeliest tokens; 0 = off (default: 0)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of this request's sampling (default: the engine's generator)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past the end-of-sequence token")
    gen.add_argument("--quiet-prompt", action="store_true", help="do not echo the prompt")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server")
    add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (or set OASISKV_API_KEY)")
    srv.add_argument("--max-waiting", type=int, default=1024,
                     help="most unfinished generations (queued or running) before new requests "
                          "get HTTP 503 (default: 1024)")
    srv.add_argument("--max-request-bytes", type=int, default=32 << 20,
                     help="largest request body accepted; larger ones get HTTP 413 "
                          "(default: 33554432, 32 MiB)")
    srv.add_argument("--served-model-name", default=None,
                     help="model name in the API (default: folder name)")
    srv.add_argument("--role", choices=("both", "prefill", "decode", "memory"), default="both",
                     help="disaggregated serving (tiered KV, NIXL: pip install 'oasiskv[pd]'): "
                          "'prefill' prefills prompts for decode workers and serves their KV; "
                          "'decode' is the OpenAI front end that sends each prompt to a prefill "
                          "worker and reads its KV; 'memory' holds prompt KV that prefill workers "
                          "offload and serves it to decode workers (no model: it reads only "
                          "MODEL's config.json); 'both' does all on one node "
                          "(default: both)")
    srv.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                     help="a prefill worker's base URL (--role decode; repeat for more: the one "
                          "with the fewest prompts in flight takes the next)")
    srv.add_argument("--memory-url", action="append", default=[], metavar="URL",
                     help="a memory worker's base URL (--role prefill; repeat for more): a "
                          "prompt's KV moves there when this worker's host store runs short "
                          "(--offload-below-blocks)")
    srv.add_argument("--offload-below-blocks", type=int, default=None, metavar="N",
                     help="--role prefill with --memory-url: offload a prompt's KV when fewer "
                          "than N host blocks would stay free here (default: the blocks of one "
                          "prompt of the longest length)")
    srv.add_argument("--pd-transfer", choices=("full", "partial"), default="full",
                     help="what a decode worker reads at admission: 'full' = every complete "
                          "prompt block it does not hold yet; 'partial' = the prompt's last "
                          "block, its blocks' summaries and the prefill's last hidden state and "
                          "queries: each head's first top-K blocks are read when seeded, the "
                          "rest when selected (needs --f-host < 1) (default: full)")
    srv.add_argument("--remote-timeout", type=float, default=10.0, metavar="S",
                     help="deadline of a remote KV read and of an HTTP connection or control "
                          "message to a prefill worker, seconds (default: 10)")
    srv.add_argument("--prefill-timeout", type=float, default=300.0, metavar="S",
                     help="deadline of a prefill worker's answer (it prefills the prompt first), "
                          "seconds; past it the worker is marked down and the prompt goes to "
                          "another (default: 300)")
    srv.add_argument("--local-prefill-blocks", type=int, default=0, metavar="N",
                     help="--role decode: prefill a prompt here, not on a prefill worker, when at "
                          "most N of its complete blocks are missing from this worker's prefix "
                          "cache (a repeated prompt, a chat's next turn); 0 = only when none is "
                          "(default: 0)")
    srv.add_argument("--emulated-read-latency-ms", type=float, default=0.0, metavar="MS",
                     help="TESTS AND BENCHMARKS: --role decode: no NIXL read is seen complete "
                          "sooner than MS milliseconds after its start, as over a slower link "
                          "(its bytes may land sooner); below --remote-timeout (default: 0, off)")
    srv.add_argument("--emulated-host-gib", type=float, default=0.0, metavar="GIB",
                     help="BENCHMARK ONLY (random weights): --role prefill or both, --kv-mode "
                          "oasis: admit as if the host store held GIB; requests share its "
                          "physical blocks (--host-kv-gib), so bytes moved are real, contents "
                          "not (default: 0, off)")
    srv.set_defaults(func=cmd_serve)

    from oasiskv.bench.decode_sweep import add_bench_flags
    bench = sub.add_parser("bench", parents=[common],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help="decode throughput sweep (context x concurrency x output length)")
    add_bench_flags(bench)
    bench.set_defaults(func=cmd_bench)

    from oasiskv.bench.fidelity import add_eval_flags
    ev = sub.add_parser("eval", parents=[common],
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        help="fidelity of tiered (oasis) decode vs dense: loss and top-1 agreement")
    add_eval_flags(ev)
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # the user's input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:  # e.g. storage that does not fit this machine
        logging.getLogger("oasiskv").debug("the failure in full", exc_info=True)
        print(f"error: {exc or type(exc).__name__} (--log-level DEBUG shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
