"""Where the learner's ranks meet: the store ``torch.distributed.init_process_group`` starts from.

Design: torch's TCP store listens on every interface of rank 0's host (it takes no bind address)
and answers whoever reaches it, without authentication. So ranks that all run on one machine (every
single-host job, and any learner of one rank) meet through a file store instead, and nothing of the
rendezvous listens on a socket. Only ranks spread over machines use the TCP store, on a free port of
rank 0's host (docs/training.md lists it with the job's other ports).

A file store lives in a fresh directory ``agentrl-pg-<pid>-*`` under the temp dir of rank 0's
process; Ray kills the workers without a chance to clean up, so rank 0 removes the directories of
processes that are gone whenever it makes a new one (its own stays for the run).
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

from protocol.slot_files import remove_stale

PREFIX = "agentrl-pg-"
_NAME = re.compile(rf"{PREFIX}(\d+)-.+")
"""A store directory's name; group 1 is the pid of the process that made it."""
_FILE = "store"


def machine_id() -> str:
    """This machine's identity: ranks that report the same one run on one host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def init_method(one_machine: bool) -> str:
    """Rank 0: the ``init_method`` for every rank; a file store when all ranks share this machine."""
    if one_machine:
        root = Path(tempfile.gettempdir())
        remove_stale(root, _NAME)
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        return f"file://{folder}/{_FILE}"
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as sock:
        sock.bind(("", 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"
