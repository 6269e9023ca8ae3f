"""No tracked text file keeps a merge's conflict markers.

A conflicted hunk resolved in a hurry can leave `<<<<<<< ` / `>>>>>>> ` lines behind; in Python they are a syntax
error the suite finds anyway, but in BENCHMARKS.md, the docs or a script nothing else would notice them.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(rb"^(<<<<<<< |>>>>>>> |\|\|\|\|\|\|\| )", re.M)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    return [ROOT / name for name in out.decode().split("\0") if name]


def files_with_markers(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:  # a tracked file deleted in the work tree
            continue
        if b"\0" not in data[:8192] and MARKER.search(data):
            found.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    return found


def test_no_tracked_file_has_conflict_markers():
    paths = tracked_files()
    assert len(paths) > 100  # the listing really listed the repository
    assert files_with_markers(paths) == []


def test_the_check_finds_a_marker(tmp_path):
    (tmp_path / "merged.md").write_text("## 30\ntext\n<<<<<<< HEAD\n## 31\n=======\n## 33\n>>>>>>> branch\n")
    (tmp_path / "clean.md").write_text("a line\n=======\nunderlined heading, not a marker\n")
    assert files_with_markers([tmp_path / "merged.md", tmp_path / "clean.md"]) == [str(tmp_path / "merged.md")]
