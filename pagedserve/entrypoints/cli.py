"""`pagedserve serve | generate | proxy | router | bench ... | replay TRACE | diagnose`"""
from __future__ import annotations

import argparse
import sys

from pagedserve import envs


def _add_generate_parser(subparsers) -> None:
    from pagedserve.config import EngineArgs

    p = subparsers.add_parser("generate", help="complete one prompt offline and print the text")
    p.add_argument("model", nargs="?", default=None, help="local checkpoint dir or hub id (default: embedded demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineArgs
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        print(out.outputs[0].text)
    else:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
        print(args.prompt + out.outputs[0].text)
    return 0


def _add_serve_parser(subparsers) -> None:
    from pagedserve.entrypoints.data_parallel import add_data_parallel_arg
    from pagedserve.entrypoints.openai.api_server import add_serve_parser

    add_data_parallel_arg(add_serve_parser(subparsers))


# Each command's parser builder (a function here, or "module:function" imported when that command runs): a command
# loads only its own module, so `router`, `proxy`, `diagnose` and `replay` start without torch (about 2 s of CPU each,
# before they bind their port).
COMMANDS = {"generate": _add_generate_parser, "serve": _add_serve_parser,
            "proxy": "pagedserve.entrypoints.disagg_proxy:add_proxy_parser",
            "router": "pagedserve.entrypoints.router:add_router_parser",
            "bench": "pagedserve.benchmarks.cli:add_bench_parser",
            "replay": "pagedserve.entrypoints.dashboard.replay:add_replay_parser",
            "diagnose": "pagedserve.entrypoints.diagnose:add_diagnose_parser"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: with every command's parser, or with `command`'s alone (its module alone imported)."""
    import importlib

    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if command in (None, name):
            if isinstance(add, str):
                module, function = add.split(":")
                add = getattr(importlib.import_module(module), function)
            add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    envs.set_openmp_defaults()  # before any command imports torch
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        if getattr(args, "data_parallel_size", 1) != 1:  # serve -dp N: N replicas of this command behind a router
            from pagedserve.entrypoints.data_parallel import run_data_parallel

            return run_data_parallel(args, argv)
        return args.func(args) or 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
