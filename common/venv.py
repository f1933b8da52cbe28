"""bin/* from any shell: re-execute an entrypoint with the project's ``.venv`` Python.

Design: every Python entrypoint in bin/ calls `use_project_venv(__file__)` first, before anything
outside the standard library is imported (this module imports nothing else). When the running
interpreter is not the checkout's ``.venv`` (a plain ``python3``, no venv activated, ``env -i``), it
replaces the process with ``.venv/bin/python`` and the same arguments (``os.execv``: same pid,
signals and exit status, so a supervisor sees no difference). A missing ``.venv`` is an error
that says to run bin/setup, unless this interpreter already has the dependencies (someone installed
the project into their own environment). ``AGENTRL_NO_VENV=1`` turns the re-exec off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

NO_VENV_ENV = "AGENTRL_NO_VENV"


def venv_of(script: str | os.PathLike[str]) -> Path:
    """The checkout's .venv for an entrypoint in its bin/ directory."""
    return Path(script).resolve().parent.parent / ".venv"


def _inside(venv: Path) -> bool:
    try:
        return Path(sys.prefix).resolve() == venv.resolve()
    except OSError:
        return False


def use_project_venv(script: str | os.PathLike[str]) -> None:
    """Return when already running in the project's .venv (or told not to re-exec); otherwise
    re-execute `script` there, or exit 1 with what to run when there is no .venv."""
    venv = venv_of(script)
    if os.environ.get(NO_VENV_ENV) == "1" or _inside(venv):
        return
    python = venv / "bin" / "python"
    if not python.exists():
        if importlib.util.find_spec("structlog") is not None:  # the project's deps are here already
            return
        name = Path(script).name
        sys.stderr.write(
            f"bin/{name}: no virtualenv at {venv} and this Python ({sys.executable}) lacks the "
            f"project's packages: run bin/setup first (it creates .venv), then bin/{name} again\n"
        )
        sys.exit(1)
    os.execv(python, [str(python), str(script), *sys.argv[1:]])
