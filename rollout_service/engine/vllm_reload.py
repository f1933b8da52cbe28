"""Full weights into vLLM's workers: the prefetch before a swap's pause and the reload inside it.

Design: `VllmEngine`'s swap pauses generation, calls `WorkerReload.reload` and resumes; before it
pauses, `WorkerReload.prefetch` has every worker copy the new weights onto its device in a thread
of its own (``vllm_worker.stage_weights``) while generation goes on, and polls until they are
there, so the pause holds only device-to-device copies. A worker that cannot stage (no device
memory to spare, a failed copy) or that the bound on the wait left behind reloads from the file.
The engine core runs each RPC between two of its steps, so a poll costs generation one short RPC.
A reload records what it took for the engine's update breakdown. It also keeps the rollback
source: the folder of the weights now served (our staged copy, which it deletes when a newer one
takes, or the learner's file), reloaded when a reload fails halfway.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_service.engine import vllm_worker

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

POLL_S = 0.005
TIMEOUT_S = 120.0


class WorkerReload:
    """Owns the prefetch and reload RPCs of one engine (``prefetch``: the setting, which the
    bench may turn off; ``direct``: the prefetched copy through the model's ``load_weights``
    alone, off unless a bench turns it on)."""

    def __init__(self, llm: AsyncLLM, model: Path, *, prefetch: bool) -> None:
        self._llm, self._model = llm, model
        self.prefetch_weights = prefetch
        self.direct = False
        self.reload_s = 0.0  # the last reload RPC
        self.staged = False  # ... and whether every worker loaded a prefetched copy
        self._good_weights: Path | None = None  # our staged dir of the weights served
        self._good_file_dir: Path | None = None  # or the learner's file of them (file hand-over)

    async def prefetch(self, folder: Path) -> None:
        """Has every worker copy ``folder``'s weights onto its device, and waits for them."""
        if not self.prefetch_weights:
            return
        path = {"weights_path": str(folder)}
        started = await self._llm.collective_rpc(vllm_worker.STAGE, kwargs=path)
        if not all(s == "started" for s in started):
            log.info("weights of %s not prefetched: %s", folder, started)
            return
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            states = await self._llm.collective_rpc(vllm_worker.STAGED, kwargs=path)
            if all(states):
                if any(s != "ok" for s in states):
                    log.warning("prefetching the weights of %s failed: %s", folder, states)
                return
            await asyncio.sleep(POLL_S)
        log.warning("prefetching the weights of %s took over %.0f s", folder, TIMEOUT_S)

    def timings(self) -> dict[str, float]:
        """The last reload's seconds, and 1.0 when every worker loaded a prefetched copy."""
        return {"reload_s": self.reload_s, "prefetched": float(self.staged)}

    async def reload(self, folder: Path) -> None:
        """``reload_weights`` in every worker from ``folder`` (its prefetched copy where there is
        one), plus the refresh of a tied output layer (``vllm_worker``)."""
        start = time.perf_counter()
        done = await self._llm.collective_rpc(
            vllm_worker.RELOAD, kwargs={"weights_path": str(folder), "direct": self.direct}
        )
        self.reload_s = time.perf_counter() - start
        self.staged = all(d["staged"] for d in done)

    def adopt(
        self, took: bool, *, staged: Path | None = None, file_dir: Path | None = None
    ) -> None:
        """After a swap: if it ``took``, its weights (our ``staged`` copy, or the learner's
        ``file_dir``) become the rollback source and the previous copy is deleted; if not, our
        staged copy is."""
        if not took:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            return
        self.close()
        self._good_weights, self._good_file_dir = staged, file_dir

    async def rollback(self) -> None:
        """Puts the last good weights back after a failed reload (it may have loaded some)."""
        file_dir = (
            self._good_file_dir if self._good_file_dir and self._good_file_dir.exists() else None
        )
        good = self._good_weights or file_dir or self._model
        try:
            await self.reload(good)
        except Exception:
            log.exception("rollback to %s failed: the engine's weights are undefined", good)
            raise

    def close(self) -> None:
        """Deletes our staged copy of the weights served, if there is one."""
        if self._good_weights is not None:
            shutil.rmtree(self._good_weights, ignore_errors=True)
            self._good_weights = None
