"""benchmarks/gguf_kernel_rows.py on a tiny GGUF file: a layer's fused products read from the file with their
types, each timed for the kernel and the peers at every row count."""
import os
import sys

import pytest
from gguf_files import make_tiny_gguf

from pagedserve.model_executor.kernels import cpu_kernels

gguf = pytest.importorskip("gguf")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_products_and_rows(tmp_path, monkeypatch, capsys):
    if cpu_kernels() is None:
        pytest.skip("no native kernels")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    sys.modules.pop("gguf_kernel_rows", None)
    import gguf_kernel_rows

    # Q4_K_M's mix: Q4_K layers with a Q6_K v_proj, fused into one q/k/v product of two types
    path = make_tiny_gguf("llama", "Q4_K", tmp_path, layer_types={"attn_v": "Q6_K"}, quantize_head=True)
    products = gguf_kernel_rows.file_products(str(path), 0, with_head=True)
    assert list(products) == ["qkv", "o", "gate_up", "down", "head"]
    assert [t for _, t, _ in products["qkv"]] == [12, 12, 14]  # Q4_K, Q4_K, Q6_K
    assert gguf_kernel_rows.main(["--gguf", str(path), "--rows", "1,5", "--rounds", "1", "--min-seconds", "0.003"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert len(lines) == 2 * 5  # row counts x products
    assert all(" tree " in line and " int8 " in line and " fp32 " in line for line in lines)
    assert "Q4_K+Q6_K" in lines[0]
    # streaming from memory: each product cycles through copies of its weight, the weight GB/s printed, no peers
    assert gguf_kernel_rows.main(["--gguf", str(path), "--rows", "1", "--rounds", "1", "--min-seconds", "0.003",
                                  "--cold-mb", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert len(lines) == 5 and all(" GB/s}" in line and " int8 " not in line for line in lines)


def test_refuses_two_builds_of_one_module_name(tmp_path, monkeypatch):
    """Python imports a module name once: a second build of _cpu_avx2 would silently time the first one again."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    sys.modules.pop("gguf_kernel_rows", None)
    import gguf_kernel_rows

    path = make_tiny_gguf("llama", "Q4_0", tmp_path)
    with pytest.raises(SystemExit):
        gguf_kernel_rows.main(["--gguf", str(path), "--build", f"a={tmp_path}/x/_cpu_avx2.so",
                               "--build", f"b={tmp_path}/y/_cpu_avx2.so"])


def test_cpu_time(tmp_path, monkeypatch, capsys):
    """--cpu-time: the calling thread's CPU time (minimum over rounds); refused with more than one thread, whose
    other threads' time it would not count."""
    if cpu_kernels() is None:
        pytest.skip("no native kernels")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    sys.modules.pop("gguf_kernel_rows", None)
    import gguf_kernel_rows

    path = make_tiny_gguf("llama", "Q4_0", tmp_path)
    assert gguf_kernel_rows.main(["--gguf", str(path), "--rows", "1", "--rounds", "2", "--min-seconds", "0.003",
                                  "--no-peers", "--no-head", "--cpu-time"]) == 0
    out = capsys.readouterr().out
    assert "CPU time, min" in out and len([line for line in out.splitlines() if line.startswith("rows")]) == 4
    with pytest.raises(SystemExit):
        gguf_kernel_rows.main(["--gguf", str(path), "--threads", "2", "--cpu-time"])
