"""The type checker runs over the non-test packages as part of the suite, and finds no errors.

basedpyright (the dev extra) is pyright packaged with its own node, so it needs no download at run
time; its settings (standard mode, the packages, Python 3.11, .venv) live in pyproject.toml under
[tool.basedpyright]. One run takes ~30-40 s on two cores.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> list[str]:
    exe = Path(sys.executable).parent / "basedpyright"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("basedpyright")
    if found:
        return [found]
    pytest.fail("basedpyright is not installed: run bin/setup (it is in the dev extra)")


@pytest.mark.timeout(600)
def test_pyright_finds_no_errors() -> None:
    result = subprocess.run(
        [*_checker(), "--outputjson", "--project", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=590,
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"basedpyright did not run (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    lines = [
        f"{Path(d['file']).relative_to(ROOT)}:{d['range']['start']['line'] + 1}: "
        f"{d['message'].splitlines()[0]} ({d.get('rule', '')})"
        for d in errors
    ]
    assert not lines, f"basedpyright: {len(lines)} errors\n" + "\n".join(lines)
