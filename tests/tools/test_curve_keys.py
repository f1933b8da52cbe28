"""bin/make-curve-keys: instant --help, ZeroMQ certificate files, private secret file, no clobbering."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.curve_keys import make_keys

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, str(ROOT / "bin" / "make-curve-keys")]


@pytest.mark.integration
def test_help_is_instant_and_imports_no_zmq() -> None:
    t0 = time.monotonic()
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True)
    assert time.monotonic() - t0 < 5 and "--out" in out.stdout and "--name" in out.stdout
    probe = "import sys; import tools.curve_keys; print('zmq' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert loaded.stdout.strip() == "False"


@pytest.mark.integration
def test_cli_writes_a_loadable_key_pair(tmp_path: Path) -> None:
    import zmq.auth

    out = subprocess.run(
        [*CLI, "--out", str(tmp_path / "k"), "--name", "learner"],
        capture_output=True,
        text=True,
        check=True,
    )
    public, secret = tmp_path / "k" / "learner.key", tmp_path / "k" / "learner.key_secret"
    assert str(public) in out.stdout and str(secret) in out.stdout
    pub_from_public, none = zmq.auth.load_certificate(public)
    pub_from_secret, sec = zmq.auth.load_certificate(secret)
    assert none is None and sec and pub_from_public == pub_from_secret
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "learner.key",
        "learner.key_secret",
    ]


@pytest.mark.integration
def test_existing_keys_are_kept_unless_forced(tmp_path: Path) -> None:
    _, secret = make_keys(tmp_path, "rollout-0")
    before = secret.read_text()
    refused = subprocess.run(
        [*CLI, "--out", str(tmp_path), "--name", "rollout-0"], capture_output=True, text=True
    )
    assert refused.returncode == 1 and "--force" in refused.stderr and secret.read_text() == before
    make_keys(tmp_path, "rollout-0", force=True)
    assert secret.read_text() != before


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="key name"):
        make_keys(tmp_path, name)
