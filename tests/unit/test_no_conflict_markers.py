"""No tracked text file carries a merge-conflict marker (one landed in README.md once, unnoticed by every test)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.MULTILINE)
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".jinja", "run", "Dockerfile")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines() if f.endswith(TEXT)]


def test_marker_pattern_finds_a_conflict():
    sample = b"a\n<<<<<<< HEAD\nx\n=======\ny\n>>>>>>> main\nb\n"
    assert len(MARKER.findall(sample)) == 3
    assert not MARKER.search(b"a = '<<<<<<<'\n# ======= heading\n")


def test_no_tracked_file_has_conflict_markers():
    files = tracked_text_files()
    assert any(f.name == "README.md" for f in files)
    bad = [str(f.relative_to(ROOT)) for f in files if f.is_file() and MARKER.search(f.read_bytes())]
    assert not bad, f"merge-conflict markers in {bad}"
