"""The per-call cgroup's pure parts: which hierarchy a host offers, and how an OOM kill shows.

Unit tests on fake sysfs trees in tmp_path (no process is started, nothing is mounted).
"""

from __future__ import annotations

from pathlib import Path

from rollout_service.sandbox_cgroup import PARENT, Hierarchy, detect, oom_kills, parse_self_cgroup

HYBRID = "4:memory:/svc/a\n8:pids:/\n2:cpu,cpuacct:/\n0::/\n"
UNIFIED = "0::/system.slice/agentrl.service\n"


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_parse_self_cgroup_splits_comounted_controllers() -> None:
    paths = parse_self_cgroup(HYBRID)
    assert paths["memory"] == "/svc/a" and paths["pids"] == "/"
    assert paths["cpu"] == paths["cpuacct"] == "/"
    assert paths[""] == "/"


def test_v2_with_memory_and_pids_is_chosen(tmp_path: Path) -> None:
    own = tmp_path / "system.slice/agentrl.service"
    _files(own, {"cgroup.controllers": "cpuset cpu io memory pids\n"})
    assert detect(tmp_path, UNIFIED) == Hierarchy(2, own, own)


def test_v2_without_the_controllers_falls_back_to_v1(tmp_path: Path) -> None:
    # A hybrid host: the unified hierarchy holds no controller, v1 has memory and pids.
    _files(tmp_path / "unified", {"cgroup.controllers": ""})
    _files(tmp_path / "memory", {"memory.limit_in_bytes": "9223372036854771712\n"})
    _files(tmp_path / "memory/svc/a", {"cgroup.procs": ""})
    _files(tmp_path / "pids", {"cgroup.procs": ""})
    found = detect(tmp_path, HYBRID)
    assert found == Hierarchy(1, tmp_path / "memory/svc/a", tmp_path / "pids")
    assert found is not None
    assert found.parents() == [tmp_path / "memory/svc/a" / PARENT, tmp_path / "pids" / PARENT]


def test_no_usable_hierarchy(tmp_path: Path) -> None:
    assert detect(tmp_path, UNIFIED) is None  # nothing mounted
    _files(tmp_path / "system.slice/agentrl.service", {"cgroup.controllers": "cpu io\n"})
    assert detect(tmp_path, UNIFIED) is None  # v2 without memory and pids, and no v1
    _files(tmp_path / "memory", {"memory.limit_in_bytes": "1\n"})
    assert detect(tmp_path, HYBRID) is None  # v1 memory without pids


def test_oom_kills_v2(tmp_path: Path) -> None:
    _files(tmp_path, {"memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\n"})
    assert oom_kills(2, tmp_path) == 1
    _files(tmp_path, {"memory.events": "low 0\nhigh 0\nmax 3\noom 0\noom_kill 0\n"})
    assert oom_kills(2, tmp_path) == 0
    assert oom_kills(2, tmp_path / "gone") == 0  # removed already: nothing to report


def test_oom_kills_v1_and_the_failcnt_fallback(tmp_path: Path) -> None:
    _files(tmp_path, {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"})
    assert oom_kills(1, tmp_path) == 3
    # Kernels before 4.13 have no oom_kill line: hitting the limit at all counts.
    _files(tmp_path, {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n"})
    _files(tmp_path, {"memory.failcnt": "7\n"})
    assert oom_kills(1, tmp_path) == 7
