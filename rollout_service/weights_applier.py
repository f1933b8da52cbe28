"""The rollout server's weight part: what it accepts from the learner, and loading each complete
version into the running engine.

Design: the learner streams weights (announce + chunks, or the name of a file on this machine)
through the protocol. ``weight_assembler`` is the connection's receiving side: what the learner
announces is checked against the engine's model before anything is received (names, shapes,
dtypes, size; protocol SPEC §8), slot files are taken only from the learner's directories, and
every transfer runs under a deadline. ``WeightApplier`` is handed the connection's weight events by
the server, which reads them in order, so a load holds back the events after it.

A complete set is loaded according to ``on_weight_update``: ``keep`` (generation continues, tokens
carry the version that produced them), ``abort`` (in-flight generation is interrupted and
continued on the new weights by the engine), ``drain`` (admission stops, running groups finish,
then the weights load). WEIGHTS_APPLIED goes back only after the engine generates with them; a
failed load is answered ok=false and the old weights stay. A transfer that fails or times out no
longer holds admission back for its version (``GrantBook.transfer_failed``).

The applier decides nothing about admission: it tells the server's ``GrantBook`` which version is
the newest and when a drain waits, and wakes the server's waiters (admission, validation requests
waiting for a version) after every change.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np
import structlog

from common.timeline import APPLY_SPAN, TimelineWriter, Track
from protocol.driver import RolloutClient
from protocol.events import WeightsFailed
from protocol.weights import ReceivedWeights, WeightAssembler
from rollout_service.engine.base import Engine
from rollout_service.granting import GrantBook
from rollout_service.metrics import RolloutStats

if TYPE_CHECKING:
    from common.config import Config


def weight_assembler(
    config: Config, engine: Engine, log: structlog.stdlib.BoundLogger
) -> WeightAssembler:
    """Receives weights checked against ``engine``'s model before anything is allocated, slot files
    only from the learner's directories, and every transfer under a deadline. An engine that names
    no manifest (test fakes) gets the size bound only."""
    server = config.rollout_server
    manifest = engine.weight_manifest
    if manifest is None:
        log.warning(
            "weight announces are not checked against the model: the engine names no manifest",
            engine=type(engine).__name__,
        )
    roots = list(dict.fromkeys(r for r in ("/dev/shm", config.learner.weights_file_dir) if r))
    return WeightAssembler(
        manifest=manifest,
        file_roots=roots,
        timeout_s=server.weights_timeout_s,
        min_bytes_per_s=server.weights_min_mb_per_s * 1e6,
    )


class WeightApplier:
    def __init__(
        self,
        engine: Engine,
        client: RolloutClient,
        book: GrantBook,
        *,
        on_weight_update: str,
        stats: RolloutStats,
        timeline: TimelineWriter,
        log: structlog.stdlib.BoundLogger,
        wake: Callable[[], None],
        changed: Callable[[], Awaitable[None]],
    ) -> None:
        """``client``: the connection WEIGHTS_APPLIED goes back on; ``wake()``: tell the server's
        waiters that admission or the engine's version changed; ``changed()``: returns at the next
        wake (a drain waits on it for the running groups)."""
        self._engine, self._client, self._book = engine, client, book
        self._policy = on_weight_update
        self._stats, self._timeline, self._log = stats, timeline, log
        self._wake, self._changed = wake, changed

    def announce(self, version: int) -> None:
        """The learner announced ``version`` (or named it in its WELCOME)."""
        if self._book.announced(version):
            self._wake()

    def transfer_failed(self, ev: WeightsFailed) -> None:
        self._log.warning("weight transfer failed", version=ev.version, reason=ev.reason)
        if self._book.transfer_failed(ev.version, self._engine.policy_version):
            self._wake()

    async def apply(self, w: ReceivedWeights) -> None:
        """Load ``w`` into the engine and answer WEIGHTS_APPLIED; a failed load is answered
        ok=false and logged, never raised."""
        policy = self._policy
        mode = "abort" if policy == "abort" else "keep"
        via = "file" if w.file else "chunks"
        started = time.time()  # the span includes a drain's wait: admission is stopped during it
        outcome = "cancelled"  # unless it ends either way below
        try:
            if policy == "drain":
                self._book.draining = True
                while self._book.running:
                    await self._changed()
            if w.file:  # the learner's file on this machine (protocol 1.2 file hand-over)
                seconds = await self._engine.load_weights_file(w.version, w.file, mode=mode)
            else:
                tensors = [
                    (s.name, np.frombuffer(buf, dtype=_numpy_dtype(s.dtype)).reshape(s.shape))
                    for s, buf in w.tensors
                ]
                seconds = await self._engine.load_weights(w.version, tensors, mode=mode)
        except Exception as e:
            outcome = "failed"
            self._log.error(
                "weights not applied; generation continues on the old ones",
                version=w.version,
                error=f"{type(e).__name__}: {e}",
            )
            self._client.weights_applied(w.version, w.transfer_id, ok=False, error=str(e)[:500])
            return
        else:
            outcome = "ok"
        finally:
            self._book.draining = False
            self._wake()
            self._timeline.span(
                Track.WEIGHTS,
                APPLY_SPAN,
                started,
                time.time(),
                version=w.version,
                outcome=outcome,
                via=via,
            )
        self.announce(w.version)
        self._stats.set_weight_version(w.version)
        self._client.weights_applied(w.version, w.transfer_id, ok=True, apply_time_s=seconds)
        timings = self._engine.last_update_timings
        self._log.info(
            "weights applied",
            version=w.version,
            policy=policy,
            seconds=round(seconds, 4),
            via=via,
            **{k: round(v, 4) for k, v in timings.items() if k.endswith("_s")},
        )


def _numpy_dtype(name: str) -> np.dtype:
    """A wire dtype as numpy's; bfloat16 and fp8 come from ml_dtypes (installed with jax/vLLM)."""
    try:
        return np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes  # pyright: ignore[reportMissingImports]  (optional: comes with jax / vLLM's GPU builds)
        except ImportError as e:
            raise RuntimeError(f"weights of dtype {name} need the ml_dtypes package") from e
        return np.dtype(getattr(ml_dtypes, name))
