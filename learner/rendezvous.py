"""Where the learner's ranks meet: the store ``torch.distributed.init_process_group`` starts from.

Design: torch's TCP store listens on every interface of rank 0's host (it takes no bind address)
and answers whoever reaches it, without authentication. So ranks that all run on one machine (every
single-host job, and any learner of one rank) meet through a file store instead, and nothing of the
rendezvous listens on a socket. Only ranks spread over machines use the TCP store, on a free port of
rank 0's host (docs/training.md lists it with the job's other ports).

The process group's own sockets follow: gloo and NCCL listen on the interface they pick, by default
the one the host's name resolves to, which on most machines is reachable from the network. Ranks
on one machine talk over loopback instead (`use_loopback`: ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME``, unless the user set them; NCCL's data moves over NVLink or shared memory
between GPUs of one host either way, the socket is its bootstrap).

A file store lives in a fresh directory ``agentrl-pg-<pid>-*`` under the temp dir of rank 0's
process; Ray kills the workers without a chance to clean up, so rank 0 removes the directories of
processes that are gone whenever it makes a new one (its own stays for the run).
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

import psutil

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


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def use_loopback(init_method: str, env: MutableMapping[str, str]) -> dict[str, str]:
    """Before ``init_process_group``: with a file store (every rank on this machine), gloo's and
    NCCL's sockets on the loopback interface, unless ``env`` names an interface already; what was
    set."""
    if not init_method.startswith("file://"):
        return {}
    lo = loopback_interface()
    chosen = {k: lo for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(k)}
    env.update(chosen)
    return chosen
