"""The `launch` section: how bin/train runs a whole job (learner + rollout servers) on one machine.

Design: only bin/train reads it; the learner and the rollout servers it starts get the same file and
ignore it, so one config describes the job and every process in it.
"""

from __future__ import annotations

from pydantic import Field

from common.config.base import Section


class LaunchConfig(Section):
    """bin/train: the processes of one training job on this machine and how they are supervised."""

    rollout_servers: int = Field(2, gt=0)
    """Rollout servers to start (each gets shard i of N of the data and server id rs<i>)."""
    tool_server: bool = False
    """Also start bin/tool-server with the same config; tools.remote.url is pointed at it when it
    is null or names this machine."""
    connect_timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for every rollout server to connect to the learner before the run fails."""
    max_restarts: int = Field(2, ge=0)
    """Restarts of each rollout server that dies (it resumes its shard); 0: any death stops the run."""
    stop_timeout_s: float = Field(60.0, gt=0)
    """Grace between SIGTERM and SIGKILL when the processes are stopped."""
    auto_port: bool = True
    """Pick free ports for the learner (and the tool server) when they bind a loopback address, so
    two runs on one machine do not collide; other addresses are used as configured."""
