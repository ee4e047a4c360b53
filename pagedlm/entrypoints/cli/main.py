"""The `pagedlm` command: generate, chat, run-batch (more subcommands register themselves here).

A user error (an unknown model, a missing file, a bad option value, an option pagedlm does not
support) prints one line saying what to do and exits 2; `--debug` (or VLLM_LOGGING_LEVEL=DEBUG)
shows the traceback. VLLM_LOGGING_LEVEL also sets the level of pagedlm's log (default: warnings).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedlm import envs
from pagedlm.engine.arg_utils import EngineArgs, FlexibleArgumentParser

# What a user can fix: values, files, options pagedlm refuses. Anything else is a bug and keeps
# its traceback.
USER_ERRORS = (ValueError, OSError, NotImplementedError)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--sampling-seed", type=int, default=None, help="Per-request seed.")


def _sampling_params(args: argparse.Namespace):
    from pagedlm import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )


def _make_llm(args: argparse.Namespace):
    from pagedlm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    return LLM(**vars(engine_args))


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    progress = len(args.prompts) > 1 and sys.stderr.isatty()  # quiet in a pipe
    for out in llm.generate(args.prompts, params, use_tqdm=progress):
        if len(args.prompts) > 1:
            print(f"### {out.prompt}")
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat with the model; an empty line or Ctrl-D ends the conversation.")
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            break
        conversation.append({"role": "user", "content": line})
        reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
        conversation.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def build_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="pagedlm", description="Offline LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Complete one or more prompts.")
    gen.add_argument("prompts", nargs="+", help="Prompt texts.")
    _sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="Chat interactively (keeps the conversation).")
    chat.add_argument("--system", default=None, help="System prompt.")
    _sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    for register in _extra_commands():
        register(sub)
    for name, command in sub.choices.items():
        if name != "bench":  # bench passes its arguments on to the script
            command.add_argument(
                "--debug", action="store_true", help="Show the traceback of an error."
            )
    return parser


def _extra_commands():
    from pagedlm.entrypoints.openai.run_batch import register_subcommand

    return [register_subcommand, _register_bench]


def _register_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="Run benchmarks/throughput.py or latency.py of a source checkout.",
        add_help=False,
    )
    bench.add_argument("which", choices=["throughput", "latency"])
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / f"{args.which}.py"
    if not script.is_file():
        print(
            f"{script} not found: `pagedlm bench` needs a source checkout of pagedlm.",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def configure_logging() -> bool:
    """pagedlm's log level from VLLM_LOGGING_LEVEL (unset: Python's default, warnings only);
    True when it asks for debugging."""
    level = envs.VLLM_LOGGING_LEVEL
    if not level:
        return False
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedlm").setLevel(level.upper())
    return level.upper() == "DEBUG"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = configure_logging() or getattr(args, "debug", False)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"pagedlm {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
