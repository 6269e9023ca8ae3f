"""benchmarks/sse_chunk_cost.py end to end on a tiny load: a fake-engine server from this checkout, a few streams,
an event-loop CPU per chunk read back from GET /metrics (no timing is asserted, only that the account moved;
a lagging client gets merged chunks, so up to one chunk per token)."""
import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_round_reports_the_cost_per_chunk(capsys):
    spec = importlib.util.spec_from_file_location("sse_chunk_cost", os.path.join(REPO, "benchmarks", "sse_chunk_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--tree", f"here={REPO}", "--rounds", "1", "--concurrency", "2", "--tokens", "4", "--waves", "1",
                     "--step-sleep", "0.002"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = json.loads(lines[0])
    assert row["tree"] == "here" and 0 < row["chunks"] <= 8 and row["loop_cpu_us"] > 0 and row["send_us"] > 0
    assert lines[-1].startswith("here: median over 1 rounds")
