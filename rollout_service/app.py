"""bin/rollout-server's run target: build the engine from config, serve until stopped.

Design: the engine is started before the server connects to the learner (a server that cannot
load its model should fail before announcing itself) and shut down in ``finally``, so vLLM's
worker processes go away on success, on error and on Ctrl-C / SIGTERM alike. For the ends that
run no ``finally`` (SIGKILL, the OOM killer), `common.reaper` watches the server from outside and
kills what vLLM started.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config


async def serve(config: Config, run_dir: Path) -> int:
    from common import reaper
    from common.logging import get_logger
    from rollout_service.engine.base import Engine, EngineOutputError
    from rollout_service.errors import StartupError
    from rollout_service.server import RolloutServer
    from rollout_service.shipping import ShippingError

    log = get_logger("rollout_service")
    try:
        # names, data and state checked before the engine starts
        server = RolloutServer(config, run_dir)
    except (StartupError, ValueError) as e:
        log.error(f"cannot start: {e}")
        return 2
    engine: Engine
    if config.rollout_server.engine == "scripted":
        from rollout_service.engine.scripted import ScriptedEngine

        engine = ScriptedEngine.from_config(
            config.actor_rollout_ref, config.rollout_server.scripted_turns
        )
    else:
        # vLLM's import alone takes seconds: only a server that uses it pays for it.
        from rollout_service.engine.vllm_engine import VllmEngine

        reaper.watch()  # before the engine: its processes must not outlive a server killed -9
        engine = await VllmEngine.from_config(config.actor_rollout_ref)
    try:
        server.attach_engine(engine)
        await server.run(max_groups=config.rollout_server.max_groups)
    except (ShippingError, EngineOutputError) as e:
        # Refused for good (another protocol major version, another tokenizer) or a corrupt
        # engine: the same settings would meet the same, so 2, which the launcher does not restart.
        log.error(str(e))
        return 2
    finally:
        await engine.shutdown()
    return 0


def run(config: Config, run_dir: Path) -> int:
    import anyio

    return anyio.run(serve, config, run_dir)
