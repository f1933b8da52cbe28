"""The README stays a front door: short, the two set-up commands, the architecture picture early, and
every local link pointing at a file that exists (runs and figures live in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 120
PICTURE_BEFORE = 60


def test_readme_is_short_with_the_picture_early() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    picture = next((i for i, line in enumerate(lines, 1) if "ADMIT" in line), None)
    assert picture is not None and picture < PICTURE_BEFORE, (
        f"the architecture picture (with ADMIT) starts at line {picture}, not before {PICTURE_BEFORE}"
    )


def test_readme_keeps_exactly_the_two_set_up_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.count("bin/setup && bin/demo") == 1 and re.search(r"^bin/test$", text, re.M)


def test_readme_links_point_at_files_that_exist() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
    assert targets and not missing, f"README.md links to missing files: {missing}"
