"""One home for a policy version's weights: gather -> slot file -> chunks -> announce -> bookkeeping.

Design: the trainer calls ``WeightPublisher.publish`` once per version; everything a version's
weights go through on the learner side happens here, in this order:

1. **Ledger.** The version is recorded durably (`learner.versions.VersionLedger`) before anything
   can announce it, so no restart ever reuses it.
2. **Slot.** With the file hand-over (``learner.weights_file_dir`` usable), `WeightFiles` picks the
   slot file to overwrite: one no rollout server that loads files will read again.
3. **Gather.** Into the slot file: every rank takes part, rank 0 writes straight into the file's
   mapped pages (`learner.weights_file_writer`). Without a slot (none configured, or all still in
   use): the full policy gathered to rank 0 and brought back through Ray.
4. **Announce.** `WeightAnnouncer.announce` (the learner link's weight part): servers on this
   machine get the file's name, the others chunks cut lazily from the same bytes. It reports whether chunks were cut from the version this
   one replaces, so that file is retired rather than overwritten while ZeroMQ may still send it.
5. **Bookkeeping.** The slot becomes the current one (`WeightFiles.published`); a write that
   failed midway drops its slot, so a half-written file is never announced. The metrics
   ``weights/*`` of the publish are returned (``weights/bytes``: what the update moved;
   ``weights/applied_s`` comes later, from the link's weight part once every server applied the
   version: `learner.announcer`).

With LoRA (``actor_rollout_ref.model.lora_rank`` > 0, ``lora.merge`` false) a version is the
adapter alone (``adapter_dtype``: the checkpoint's floating dtype), written into the slot file by
rank 0 as full weights are (`learner.weights_file_writer`), announced the same way. Rollout
servers tell it from full weights by its names (`protocol.adapters`).

The first version of a run (the model, or the resumed checkpoint's export: its adapter alone with
adapter-only updates) is announced from disk by ``publish_initial``, before the workers exist. ``close`` removes the slot files (/dev/shm)
and is called first on every way out of the trainer; stale ones of dead learners are removed when
the next one opens them (`protocol.slot_files.remove_stale`).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.config.root import Config
from common.logging import get_logger
from common.safetensors_buffers import load_file
from learner.announcer import WeightAnnouncer
from learner.versions import VersionLedger
from learner.weights_files import WeightFiles
from learner.worker_api import (
    AdapterFileRequest,
    AdapterRequest,
    WeightsFileRequest,
    WeightsRequest,
)
from protocol.slot_files import remove_stale
from protocol.weights import FLOAT_DTYPES, NamedBuffer

if TYPE_CHECKING:
    from learner.workers import WorkerGroup


@dataclass
class WeightPublisher:
    announcer: WeightAnnouncer
    ledger: VersionLedger
    weights: WeightsRequest  # the checkpoint's tensor names and dtypes: what servers load
    files: WeightFiles | None = None  # None: chunks only
    model_bytes: int = 0  # the full policy as servers load it: what one full update moves
    model_params: int = 0
    adapter_dtype: str | None = None  # set: each version is the LoRA adapter alone, in this dtype

    def adapter_bytes(self, params: int) -> int:
        """What ``params`` adapter parameters take in the served weights' dtype (the checkpoint's
        bytes per parameter): what an adapter-only update moves."""
        return round(params * self.model_bytes / max(self.model_params, 1))

    @classmethod
    def open(
        cls,
        config: Config,
        announcer: WeightAnnouncer,
        ledger: VersionLedger,
        model: list[NamedBuffer],
    ) -> WeightPublisher:
        """A publisher of weights named and typed as ``model`` (the checkpoint the run starts from),
        with slot files when ``learner.weights_file_dir`` is set and has room for every slot (else
        weights go as chunks only, with a warning)."""
        request = WeightsRequest([t.name for t in model], {t.name: t.dtype for t in model})
        nbytes = sum(t.data.nbytes for t in model)
        params = sum(math.prod(t.shape) for t in model)
        m = config.actor_rollout_ref.model
        adapter_dtype = None
        if m.lora_rank > 0 and not m.lora.merge:
            adapter_dtype = next((t.dtype for t in model if t.dtype in FLOAT_DTYPES), "float32")
        files = _open_files(config, nbytes)
        return cls(announcer, ledger, request, files, nbytes, params, adapter_dtype)

    def publish_initial(self, version: int, tensors: list[NamedBuffer]) -> None:
        """The policy the run starts from, straight from disk: rollout servers that join get it at
        once, before the workers are even up."""
        self.ledger.record(version)
        self.announcer.announce(version, tensors)

    async def publish(self, version: int, workers: WorkerGroup) -> dict[str, float]:
        """Gather the workers' policy (or its adapter) and announce it as ``version``; the
        ``weights/*`` metrics."""
        t0 = time.perf_counter()
        started = time.monotonic()
        self.ledger.record(version)
        take = None
        if self.files is not None:
            take = self.files.take(
                version, oldest_applied=self.announcer.file_peers_oldest_version()
            )
        if self.files is not None and take is not None:
            slot, path = take
            try:
                if self.adapter_dtype is not None:
                    req = AdapterFileRequest(self.adapter_dtype, slot, str(path))
                    info = await workers.write_adapter_file(req)
                else:
                    info = await workers.write_weights_file(
                        WeightsFileRequest(self.weights, slot, str(path))
                    )
            except BaseException:
                self.files.failed(slot)
                raise
            replaced_chunked = self.announcer.announce(
                version, load_file(path), file=str(path), started=started
            )
            self.files.published(version, replaced_chunked=replaced_chunked)
            return {
                "weights/gather_s": info.gather_s,
                "weights/copy_s": info.copy_s,
                "weights/pinned": float(info.pinned),
                "weights/via_file": 1.0,
                "weights/bytes": float(info.bytes),
                "weights/publish_s": time.perf_counter() - t0,
            }
        if self.adapter_dtype is not None:
            parts = await workers.adapter_weights(AdapterRequest(self.adapter_dtype))
        else:
            parts = await workers.full_weights(self.weights)
        gathered = time.perf_counter()
        tensors = [
            NamedBuffer(w.name, w.dtype, w.shape, np.ascontiguousarray(w.array).data.cast("B"))
            for w in parts
        ]
        replaced_chunked = self.announcer.announce(version, tensors, started=started)
        if self.files is not None:
            self.files.published(version, replaced_chunked=replaced_chunked)
        return {
            "weights/gather_s": gathered - t0,
            "weights/via_file": 0.0,
            "weights/bytes": float(sum(t.data.nbytes for t in tensors)),
            "weights/publish_s": time.perf_counter() - t0,
        }

    def close(self) -> None:
        """Remove the slot files (idempotent)."""
        if self.files is not None:
            self.files.close()


def _open_files(config: Config, model_bytes: int) -> WeightFiles | None:
    log = get_logger("learner")
    c = config.learner
    if not c.weights_file_dir:
        return None
    for stale in remove_stale(c.weights_file_dir):  # first: they may hold the room needed below
        log.info("removed the weights files of a learner that is gone", path=str(stale))
    try:
        free = shutil.disk_usage(c.weights_file_dir).free
        if free < 1.1 * c.weights_file_slots * model_bytes:
            raise OSError(
                f"{free / 1e9:.2f} GB free, {c.weights_file_slots} slots need "
                f"{1.1 * c.weights_file_slots * model_bytes / 1e9:.2f} GB"
            )
        return WeightFiles(c.weights_file_dir, c.weights_file_slots)
    except OSError as e:
        log.warning(
            "weights go to rollout servers as chunks only: learner.weights_file_dir is not usable",
            dir=c.weights_file_dir,
            error=str(e),
        )
        return None
