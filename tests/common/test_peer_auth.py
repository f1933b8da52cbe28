"""transport.auth turned into credentials (common/peer_auth.py): the mode, the token file the learner
creates and every client reads, and the config checks of combinations that cannot work."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import anyio
import pytest

from common.config import Config, ConfigError, load_config
from common.peer_auth import (
    auth_mode,
    client_token,
    ensure_token,
    learner_token,
    read_token,
    token_path,
    tool_server_token,
    wait_for_token,
)


def _config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            "actor_rollout_ref.model.path=unused",
            "data.train_files=unused.jsonl",
            f"trainer.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
        check_paths=False,
    )


def test_the_default_is_a_token_in_the_run_directory(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.transport.auth == "auto" and auth_mode(config) == "token"
    path = token_path(config)
    assert path == tmp_path / "run" / "learner.token"
    with pytest.raises(FileNotFoundError):
        client_token(config)  # no learner yet
    token = learner_token(config)
    assert token is not None and len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert learner_token(config) == client_token(config) == token  # kept, and shared
    assert [p.name for p in path.parent.iterdir()] == ["learner.token"]  # no temporary left


def test_an_explicit_token_file_and_the_other_modes(tmp_path: Path) -> None:
    config = _config(tmp_path, f"transport.auth_token_file={tmp_path / 'shared' / 'tok'}")
    assert token_path(config, tmp_path / "elsewhere") == tmp_path / "shared" / "tok"
    none = _config(tmp_path, "transport.auth=none")
    assert auth_mode(none) == "none" and learner_token(none) is None and client_token(none) is None
    assert not (tmp_path / "run").exists()


def test_the_tool_servers_secret_inline_from_a_file_or_none(tmp_path: Path) -> None:
    assert tool_server_token(_config(tmp_path).tool_server) is None  # no check unless asked
    inline = _config(tmp_path, "tool_server.token=sixteen-chars-at-least")
    assert tool_server_token(inline.tool_server, create=True) == "sixteen-chars-at-least"
    path = tmp_path / "run" / "tool-server.token"
    settings = _config(tmp_path, f"tool_server.token_file={path}").tool_server
    with pytest.raises(FileNotFoundError, match=r"tool_server.token_file: .*tool-server.token"):
        tool_server_token(settings)  # a client before the tool server made it
    made = tool_server_token(settings, create=True)
    assert made is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert tool_server_token(settings) == made == tool_server_token(settings, create=True)
    with pytest.raises(
        ConfigError, match=r"tool_server\.token or tool_server\.token_file, not both"
    ):
        _config(
            tmp_path, "tool_server.token=sixteen-chars-at-least", f"tool_server.token_file={path}"
        )


def test_racing_learners_agree_on_one_token(tmp_path: Path) -> None:
    path = tmp_path / "learner.token"
    first = ensure_token(path)
    os.link(path, tmp_path / "copy")  # a second creator finds the file and keeps it
    assert ensure_token(path) == first == read_token(tmp_path / "copy")


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(tmp_path / "t")


@pytest.mark.anyio
async def test_a_client_waits_for_the_learner_to_make_the_token(tmp_path: Path) -> None:
    path = tmp_path / "learner.token"
    warned: list[str] = []

    async def learner_starts_late() -> None:
        await anyio.sleep(0.3)
        ensure_token(path)

    async with anyio.create_task_group() as tg:
        tg.start_soon(learner_starts_late)
        with anyio.fail_after(5):
            token = await wait_for_token(
                path, poll_s=0.02, warn_after_s=0.1, warn=lambda m, **kw: warned.append(m)
            )
    assert token == read_token(path) and warned == ["waiting for the learner's token file"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["transport.auth=curve"], "transport.auth: curve needs transport.curve.enabled: true"),
        (
            ["transport.auth=token", "transport.curve.enabled=true"],
            "transport.auth: token cannot be combined with transport.curve.enabled",
        ),
    ],
)
def test_impossible_combinations_are_refused(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    keys = [
        f"transport.curve.{k}={tmp_path}"
        for k in ("secret_key_file", "server_public_key_file", "allowed_keys_dir")
    ]
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, *overrides, *keys)
    assert expected in str(e.value)
