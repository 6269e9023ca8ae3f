"""What `pagedserve serve` imports before its port opens: nothing the server path does not use."""
from __future__ import annotations

import json
import subprocess
import sys

# Optional or heavy packages only other commands use: plotting (bench), Ray (its executor), Triton (CUDA attention),
# the Redis client (its KV store), the openai client (tests and benchmarks).
NOT_ON_THE_SERVER_PATH = ("matplotlib", "ray", "triton", "redis", "openai", "pandas")

SERVER_PATH = """
import json, sys
from pagedserve.entrypoints import cli
parser = cli.build_parser()
args = parser.parse_args(["serve", "--num-threads", "1"])
from pagedserve.config import EngineArgs
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import build_app
engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
engine.engine.structured_output.ll_tokenizer
build_app(engine, args)
engine.shutdown()
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_the_server_path_imports_no_optional_package():
    """The CLI's parsers, the engine on the demo model and the HTTP app, as `serve` builds them before binding."""
    out = subprocess.run([sys.executable, "-c", SERVER_PATH], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "torch" in imported and "fastapi" in imported  # the probe did build the server
    assert not imported & set(NOT_ON_THE_SERVER_PATH), sorted(imported & set(NOT_ON_THE_SERVER_PATH))


def test_the_commands_that_serve_no_model_start_without_torch():
    """`pagedserve router | proxy | diagnose | replay` load their own module alone before parsing (the CLI builds
    only the parser of the command given): no torch, about 2 s of CPU less before a router binds its port."""
    code = ("import sys\nfrom pagedserve.entrypoints.cli import build_parser\n"
            "for command in ('router', 'proxy', 'diagnose', 'replay'):\n"
            "    assert build_parser(command)._subparsers._group_actions[0].choices.keys() == {command}\n"
            "print('torch' in sys.modules, len(build_parser()._subparsers._group_actions[0].choices))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "7"]  # and the full parser (--help) still has every command
