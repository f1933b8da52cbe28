"""bin/doctor (tools/doctor.py): every check on good and bad inputs, the command's exit codes and
its --json shape. Fast: heavy parts are stand-ins (a fake `ray` module, torch's GPU probe, vLLM's
registry); the config, the tokenizer, the preflight and the CURVE certificates are the real ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools import doctor
from tools.doctor import CHECKS, ORDER, Context

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    """A TCP port on loopback that accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield "127.0.0.1", s.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ctx(tmp_path: Path, *overrides: str, config: str | None = None, **kw: Any) -> Context:
    """A context of configs/default.yaml, its model and data pointing into tmp_path."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    data = tmp_path / "train.jsonl"
    if not data.exists():
        row = {"question": "What is 1 + 2?", "answer": "3", "data_source": "arithmetic"}
        data.write_text(json.dumps(row) + "\n")
    base = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        "data.val_files=[]",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    return Context(config or str(REPO / "configs" / "default.yaml"), [*base, *overrides], **kw)


def test_order_names_every_registered_check() -> None:
    assert sorted(ORDER) == CHECKS.names()


# ------------------------------------------------------------------------------- packages / gpus


def test_packages_found_and_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "PACKAGES", (("json", "json"), ("zmq", "pyzmq")))
    ok = doctor.check_packages(Context())
    assert ok.status == "OK" and any(d.startswith("zmq ") and "pyzmq" in d for d in ok.details)
    monkeypatch.setattr(doctor, "PACKAGES", (("json", "json"), ("no_such_module_x", "nosuch")))
    bad = doctor.check_packages(Context())
    assert bad.status == "FAIL" and "nosuch" in bad.summary and bad.fix and "bin/setup" in bad.fix
    monkeypatch.setattr(doctor, "PACKAGES", (("verl", "verl"),))
    monkeypatch.setattr(doctor, "VERL_CORE", Path("no", "such.py"))
    verl = doctor.check_packages(Context())
    assert verl.status == "FAIL" and "core_algos" in verl.summary


def test_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_torch_gpus", lambda: (True, ["cuda:0 H100 79.1 GiB"], "torch x"))
    assert doctor.check_gpus(Context()).status == "OK"
    monkeypatch.setattr(doctor, "_torch_gpus", lambda: (False, [], "torch x+cpu"))
    monkeypatch.setattr(doctor, "_nvidia_smi", lambda: ["GPU 0: NVIDIA H100 (UUID: x)"])
    driver_only = doctor.check_gpus(Context())
    assert driver_only.status == "FAIL" and driver_only.fix and "CUDA build" in driver_only.fix
    monkeypatch.setattr(doctor, "_nvidia_smi", lambda: [])
    assert doctor.check_gpus(Context()).status == "WARN"  # a CPU host


def test_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_free_gib", lambda path: 500.0)
    assert doctor.check_disk(Context()).status == "OK"
    monkeypatch.setattr(doctor, "_free_gib", lambda path: 1.0)
    low = doctor.check_disk(Context())
    assert low.status == "WARN" and "1.0 GiB free" in low.summary


# ------------------------------------------------------------------------------------------ ray


class FakeRay:
    """The three calls the check makes, over a node table that grows as a cluster forms."""

    def __init__(self, tables: list[list[dict[str, Any]]]) -> None:
        self.tables, self.inited = tables, False

    def is_initialized(self) -> bool:
        return self.inited

    def init(self, **kwargs: Any) -> None:
        self.inited = True

    def shutdown(self) -> None:
        self.inited = False

    def nodes(self) -> list[dict[str, Any]]:
        return self.tables.pop(0) if len(self.tables) > 1 else self.tables[0]


def _node(ip: str, gpus: float, alive: bool = True) -> dict[str, Any]:
    return {"NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 8.0, "GPU": gpus}}


def test_ray_skipped_without_address() -> None:
    assert doctor.check_ray(Context()).status == "SKIP"


def test_ray_unreachable_fails_fast() -> None:
    start = time.monotonic()
    result = doctor.check_ray(Context(ray_address=f"127.0.0.1:{_closed_port()}"))
    assert result.status == "FAIL" and "refused" in result.summary and result.fix
    assert "ray start --head" in result.fix and time.monotonic() - start < 5
    assert doctor.check_ray(Context(ray_address="127.0.0.1:notaport")).status == "FAIL"


def test_ray_lists_nodes_and_waits_for_them(
    monkeypatch: pytest.MonkeyPatch, listener: tuple[str, int]
) -> None:
    address = f"{listener[0]}:{listener[1]}"
    fake = FakeRay([[_node("10.0.0.1", 8), _node("10.0.0.2", 8), _node("10.0.0.3", 8, False)]])
    monkeypatch.setitem(sys.modules, "ray", fake)
    ok = doctor.check_ray(Context(ray_address=address, ray_nodes=2))
    assert ok.status == "OK" and ok.summary.startswith("2 node(s) alive, 16 GPU, 16 CPU")
    assert ok.details == ["10.0.0.1: 8 GPU, 8 CPU", "10.0.0.2: 8 GPU, 8 CPU"]
    assert not fake.inited  # the driver let go of the cluster
    short = doctor.check_ray(Context(ray_address=address, ray_nodes=3))
    assert short.status == "FAIL" and "expected 3" in short.summary
    # The second node joins while the check waits.
    monkeypatch.setattr(doctor.time, "sleep", lambda s: None)
    late = FakeRay([[_node("10.0.0.1", 8)], [_node("10.0.0.1", 8), _node("10.0.0.2", 8)]])
    monkeypatch.setitem(sys.modules, "ray", late)
    assert doctor.check_ray(Context(ray_address=address, ray_nodes=2, ray_wait_s=30)).status == "OK"


# ---------------------------------------------------------------------------------------- ports


def test_ports_local_bind(listener: tuple[str, int]) -> None:
    free = doctor.check_ports(Context(addresses=[f"tcp://127.0.0.1:{_closed_port()}"]))
    assert free.status == "OK" and "can bind" in free.details[0]
    used = doctor.check_ports(Context(addresses=[f"tcp://127.0.0.1:{listener[1]}"]))
    assert used.status == "WARN" and "in use" in used.details[0]


def test_ports_remote_connect(monkeypatch: pytest.MonkeyPatch, listener: tuple[str, int]) -> None:
    # as if 127.0.0.1 were another host
    monkeypatch.setattr(doctor, "_is_local", lambda host: False)
    up = doctor.check_ports(Context(addresses=[f"tcp://127.0.0.1:{listener[1]}"]))
    assert up.status == "OK" and "connected" in up.details[0]
    down = doctor.check_ports(Context(addresses=[f"127.0.0.1:{_closed_port()}"]))
    assert down.status == "WARN" and "refused" in down.details[0] and down.fix
    unknown = doctor.check_ports(Context(addresses=["tcp://no-such-host.invalid:5555"]))
    assert unknown.status == "FAIL" and "unknown host" in unknown.details[0]


def test_ports_bad_address_and_skip() -> None:
    assert doctor.check_ports(Context(addresses=["tcp://host-without-port"])).status == "FAIL"
    assert doctor.check_ports(Context()).status == "SKIP"


# ------------------------------------------------------------------------- config / model / data


def test_config_good_bad_and_absent(tmp_path: Path) -> None:
    assert doctor.check_config(_ctx(tmp_path)).status == "OK"
    bad = doctor.check_config(_ctx(tmp_path, "trainer.no_such_key=1"))
    assert bad.status == "FAIL" and any("no_such_key" in d for d in bad.details)
    assert doctor.check_config(Context()).status == "SKIP"
    # Checks that need the config say why they did not run.
    for check in (doctor.check_model, doctor.check_data, doctor.check_keys):
        assert check(_ctx(tmp_path, "trainer.no_such_key=1")).status == "SKIP"
        assert check(Context()).status == "SKIP"


def test_model(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_vllm_supports", lambda archs: "Qwen2ForCausalLM" in archs)
    ok = doctor.check_model(_ctx(tmp_path, f"actor_rollout_ref.model.path={tiny_model}"))
    assert ok.status in ("OK", "WARN"), ok  # WARN: a tokenizer without a chat template
    assert "qwen2" in ok.details[0] and "vLLM knows the architecture" in ok.details
    monkeypatch.setattr(doctor, "_vllm_supports", lambda archs: False)
    unsupported = doctor.check_model(_ctx(tmp_path, f"actor_rollout_ref.model.path={tiny_model}"))
    assert unsupported.status == "FAIL" and "vLLM supports none" in unsupported.summary
    empty = doctor.check_model(_ctx(tmp_path))  # a directory without a model
    assert empty.status == "FAIL" and "transformers cannot read it" in empty.summary


def test_data(tmp_path: Path) -> None:
    assert doctor.check_data(_ctx(tmp_path)).status == "OK"
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    bad = doctor.check_data(_ctx(tmp_path, f"data.train_files={broken}"))
    assert bad.status == "FAIL" and any("broken.jsonl" in d for d in bad.details)
    missing_val = doctor.check_data(_ctx(tmp_path, f"data.val_files={tmp_path / 'nope.jsonl'}"))
    assert missing_val.status == "WARN"


# ----------------------------------------------------------------------------------------- keys


def test_token_file(tmp_path: Path) -> None:
    token = tmp_path / "learner.token"
    ctx = _ctx(tmp_path, f"transport.auth_token_file={token}")
    assert doctor.check_keys(ctx).status == "OK"  # the learner makes it at start
    token.write_text("ab" * 32 + "\n")
    token.chmod(0o644)
    loose = doctor.check_keys(_ctx(tmp_path, f"transport.auth_token_file={token}"))
    assert loose.status == "FAIL" and "readable by others" in loose.summary
    assert loose.fix and "chmod 600" in loose.fix
    token.chmod(0o600)
    assert doctor.check_keys(_ctx(tmp_path, f"transport.auth_token_file={token}")).status == "OK"
    token.write_text("\n")
    assert doctor.check_keys(_ctx(tmp_path, f"transport.auth_token_file={token}")).status == "FAIL"
    assert doctor.check_keys(_ctx(tmp_path, "transport.auth=none")).status == "WARN"


def test_curve_keys(tmp_path: Path) -> None:
    from tools.curve_keys import make_keys

    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    learner_pub, learner_secret = make_keys(keys, "learner")
    make_keys(allowed, "rs0")
    (allowed / "rs0.key_secret").unlink()

    def ctx(secret: Path = learner_secret, allowed_dir: Path = allowed) -> Context:
        return _ctx(
            tmp_path,
            "transport.curve.enabled=true",
            f"transport.curve.secret_key_file={secret}",
            f"transport.curve.server_public_key_file={learner_pub}",
            f"transport.curve.allowed_keys_dir={allowed_dir}",
        )

    ok = doctor.check_keys(ctx())
    assert ok.status == "OK" and "transport.curve.allowed_keys_dir: 1 public key(s)" in ok.details
    learner_secret.chmod(0o644)
    loose = doctor.check_keys(ctx())
    assert loose.status == "FAIL" and any("readable by others" in d for d in loose.details)
    learner_secret.chmod(0o600)
    public_as_secret = doctor.check_keys(ctx(secret=learner_pub))
    assert any("holds no secret key" in d for d in public_as_secret.details)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_allowed = doctor.check_keys(ctx(allowed_dir=empty))
    assert no_allowed.status == "FAIL" and any("no public keys" in d for d in no_allowed.details)
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    garbage.chmod(0o600)
    assert doctor.check_keys(ctx(secret=garbage)).status == "FAIL"


# ------------------------------------------------------------------------------------------- cli


def test_exit_codes_and_json(capsys: pytest.CaptureFixture[str], listener: tuple[str, int]) -> None:
    assert (
        doctor.main(["--only", "ports", "--learner-address", f"tcp://127.0.0.1:{listener[1]}"]) == 0
    )
    assert "WARN  ports" in capsys.readouterr().out
    assert doctor.main(["--only", "ports", "--learner-address", "tcp://nohost"]) == 1
    assert "FAIL  ports" in capsys.readouterr().out
    for bad in (["--only", "nope"], ["--ray-nodes", "0"], ["--timeout", "x"], ["notakeyvalue"]):
        with pytest.raises(SystemExit) as exc:
            doctor.main(bad)
        assert exc.value.code == 2, bad
    assert "known: config, data" in capsys.readouterr().err
    assert doctor.main(["--json", "--only", "ray,ports,config"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["counts"]["SKIP"] == 3
    assert [r["name"] for r in doc["results"]] == ["ray", "ports", "config"]
    assert set(doc["results"][0]) == {"name", "status", "summary", "details", "fix"}


def test_a_check_that_raises_is_a_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(ctx: Context) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setitem(CHECKS._entries, "disk", boom)  # pyright: ignore[reportPrivateUsage]
    [result] = doctor.run_checks(Context(), ["disk"])
    assert result.status == "FAIL" and "RuntimeError: boom" in result.summary


@pytest.mark.integration
def test_bin_doctor_help_is_instant_and_json_runs() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    start = time.monotonic()
    out = subprocess.run(
        [str(REPO / "bin" / "doctor"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and "usage: doctor" in out.stdout
    assert time.monotonic() - start < 10  # the re-exec into .venv included, on a loaded machine
    out = subprocess.run(
        [str(REPO / "bin" / "doctor"), "--json", "--only", "disk,ray"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert [r["status"] for r in json.loads(out.stdout)["results"]][1] == "SKIP"


def test_ray_join_failure_names_ray_token_auth(
    monkeypatch: pytest.MonkeyPatch, listener: tuple[str, int], tmp_path: Path
) -> None:
    """A head started with ~/.ray/auth_token present wants the token, which a driver given an
    explicit address sends only under RAY_AUTH_MODE=token (Ray 2.60): the fix says so."""

    class Refusing(FakeRay):
        def init(self, **kwargs: Any) -> None:
            raise ConnectionError("Failed to connect to Ray cluster")

    monkeypatch.setitem(sys.modules, "ray", Refusing([[]]))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    result = doctor.check_ray(Context(ray_address=f"{listener[0]}:{listener[1]}"))
    assert result.status == "FAIL" and result.fix and "RAY_AUTH_MODE=token" in result.fix
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    result = doctor.check_ray(Context(ray_address=f"{listener[0]}:{listener[1]}"))
    assert result.fix == doctor.RAY_FIX


def test_keys_fail_without_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq

    real_has = zmq.has
    monkeypatch.setattr(zmq, "has", lambda feature: feature != "curve" and real_has(feature))
    result = doctor.check_keys(_ctx(tmp_path))
    assert result.status == "FAIL" and "CURVE" in result.summary
    assert doctor.check_keys(_ctx(tmp_path, "transport.auth=none")).status == "WARN"
