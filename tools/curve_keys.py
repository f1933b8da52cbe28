"""Make ZeroMQ CURVE key pairs for the learner and the rollout servers.

``bin/make-curve-keys --out DIR --name NAME`` writes ``DIR/NAME.key`` (public certificate, safe to
share) and ``DIR/NAME.key_secret`` (public + secret key, mode 0600). Wiring (see
``protocol.zmq_transport``):
- learner: ``CurveServerKeys(secret_key_file=learner.key_secret, allowed_keys_dir=DIR)`` where DIR
  holds the ``.key`` files of the rollout servers allowed in (and nothing else that ends in .key);
- rollout server: ``CurveClientKeys(secret_key_file=NAME.key_secret,
  server_public_key_file=learner.key)``.

The files are ZeroMQ's certificate format (``zmq.auth.create_certificates``). The secret file never
exists with wider permissions: both files are made in a private (0700) temporary directory inside
``DIR`` and moved into place. Existing files are kept unless ``--force``. zmq is imported only when
keys are made, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def make_keys(out: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Create ``out/name.key`` and ``out/name.key_secret``; returns (public, secret) paths."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: use letters, digits, '.', '_' and '-' (no slashes)")
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist(s); pass --force to replace")
    tmp = Path(tempfile.mkdtemp(prefix=".curve-", dir=out))  # mode 0700
    try:
        tmp_public, tmp_secret = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
        tmp_secret.chmod(0o600)
        tmp_public.chmod(0o644)
        os.replace(tmp_secret, secret)
        os.replace(tmp_public, public)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public, secret


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="make-curve-keys",
        description="Make a ZeroMQ CURVE key pair: OUT/NAME.key (public) and OUT/NAME.key_secret (secret).",
        epilog="Learner: secret = learner.key_secret, allow-list = a directory of rollout servers' .key "
        "files. Rollout server: its own .key_secret plus the learner's .key.",
    )
    ap.add_argument("--out", required=True, type=Path, help="directory to write the key files to")
    ap.add_argument(
        "--name", required=True, help="base name of the files, e.g. learner or rollout-0"
    )
    ap.add_argument("--force", action="store_true", help="replace existing files of that name")
    args = ap.parse_args(argv)
    try:
        public, secret = make_keys(args.out, args.name, force=args.force)
    except (ValueError, FileExistsError, RuntimeError) as e:
        print(f"make-curve-keys: {e}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
