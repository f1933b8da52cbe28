"""Which machine, and which /dev/shm, this process sees: the key behind the weights file hand-over.

Design: the learner hands weights to a rollout server as a file on /dev/shm only when both report
the same key. Hostname alone is not enough (containers on one host may share it, or not share
/dev/shm), so the key also holds the kernel's boot id and the device and inode of /dev/shm, which
differ between mount namespaces. A wrong match is still safe: the rollout server then cannot open
the file, answers WEIGHTS_APPLIED ok=false, and the learner sends that server chunks from then on.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path


@functools.cache
def host_key() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "-"
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "-"
    return f"{socket.gethostname()}/{boot}/{shm}"
