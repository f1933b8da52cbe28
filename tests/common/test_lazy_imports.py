"""Imports of project modules sit at the top of the module, not inside functions.

A function-level import hides a dependency from the reader (and from the import-cycle test's
first glance); it is allowed only at the entrypoints, whose ``--help`` must answer at once
(``*/app.py``, ``common/cli.py``; ``bin/*`` are not modules of these packages), and where it keeps a
heavy import (torch, vllm, ray, transformers, verl, matplotlib, or a module importing them) out of a
module that must stay light. Such an import carries a comment starting ``# lazy:`` on the line above
it (or above the run of imports it belongs to), saying which import it defers.

Read from the source (ast), as the import-cycle test reads it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "protocol", "rollout_service", "learner", "launcher", "tools", "bench")
ENTRYPOINTS = {"common/cli.py"}
"""Besides every ``*/app.py``."""
MARK = "# lazy:"


def _exempt(rel: str) -> bool:
    return rel.endswith("/app.py") or rel in ENTRYPOINTS


def _is_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom) and node.level:
        return True
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(name.split(".")[0] in PACKAGES for name in names)


def _import_runs(body: list[ast.stmt], in_function: bool) -> Iterator[list[ast.stmt]]:
    """Runs of consecutive import statements inside functions, found in every nested block."""
    i = 0
    while i < len(body):
        stmt = body[i]
        if in_function and isinstance(stmt, (ast.Import, ast.ImportFrom)):
            j = i
            while (
                j + 1 < len(body)
                and isinstance(body[j + 1], (ast.Import, ast.ImportFrom))
                and body[j + 1].lineno == body[j].end_lineno + 1  # type: ignore[operator]
            ):
                j += 1
            yield body[i : j + 1]
            i = j + 1
            continue
        inner = in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field in ("body", "orelse", "finalbody"):
            block = getattr(stmt, field, None)
            if isinstance(block, list):
                yield from _import_runs(block, inner)
        for handler in getattr(stmt, "handlers", None) or []:
            yield from _import_runs(handler.body, inner)
        if isinstance(stmt, ast.Match):
            for case in stmt.cases:
                yield from _import_runs(case.body, inner)
        i += 1


def _uncommented(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for run in _import_runs(ast.parse(text, str(path)).body, False):
        project = [s for s in run if _is_project(s)]  # type: ignore[arg-type]
        above = lines[run[0].lineno - 2].strip() if run[0].lineno >= 2 else ""
        if project and not above.startswith(MARK):
            found += [f"{path.relative_to(ROOT)}:{s.lineno}: {ast.unparse(s)}" for s in project]
    return found


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_check_sees_function_level_imports() -> None:
    assert _uncommented(ROOT / "common" / "cli.py"), "common/cli.py defers its imports"


def test_no_uncommented_project_import_inside_a_function() -> None:
    found = [
        line
        for path in _modules()
        if not _exempt(str(path.relative_to(ROOT)))
        for line in _uncommented(path)
    ]
    assert not found, (
        "imports of project modules inside functions: move them to the top of the module, or say "
        f"which heavy import each defers in a `{MARK} ...` comment above it:\n" + "\n".join(found)
    )
