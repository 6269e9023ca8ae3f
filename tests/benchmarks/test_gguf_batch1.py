"""benchmarks/gguf_batch1.py's weight-bandwidth bound: the bytes a decode step streams per format, counted from the
GGUF file (no engine, no server)."""
import os
import sys

import pytest
from gguf_files import make_tiny_gguf

gguf = pytest.importorskip("gguf")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_streamed_bytes_per_format(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    sys.modules.pop("gguf_batch1", None)
    import gguf_batch1

    path = make_tiny_gguf("llama", "Q4_0", tmp_path)  # untied: `output` is the head, token_embd only looked up
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    linears = [t for name, t in tensors.items() if len(t.shape) == 2 and name != "token_embd.weight"]
    assert any(t.name == "output.weight" for t in linears)
    weights = sum(int(t.n_elements) for t in linears)
    assert gguf_batch1.streamed_bytes(str(path), one_byte_weights=True) == weights
    # Q4_0: 18 bytes per block of 32 for the layers' weights; the head as the file stores it
    q4 = sum(int(t.n_elements) for t in linears if t.tensor_type == gguf.GGMLQuantizationType.Q4_0)
    assert q4 > 0
    other = sum(int(t.n_bytes) for t in linears if t.tensor_type != gguf.GGMLQuantizationType.Q4_0)
    assert gguf_batch1.streamed_bytes(str(path)) == q4 // 32 * 18 + other
