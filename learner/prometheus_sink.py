"""The learner's Prometheus endpoint: every metric of the latest step as a gauge.

Design: a metric sink like the others (``trainer.logger: [..., prometheus]``; learner.sinks
registers it), serving
``/metrics`` on ``learner.metrics_port`` (0: any free port, logged) from prometheus_client's
daemon thread. Names are the step metrics with every character Prometheus does not allow turned
into ``_`` and the prefix ``agentrl_learner_``: ``rollout/waste_frac`` is
``agentrl_learner_rollout_waste_frac``. Only the latest value of each is kept (a scrape samples
the run; metrics.jsonl and TensorBoard keep the history). The collector reads a dict swapped in
whole per step, so a scrape never sees half a step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from common.logging import get_logger
from learner.sink_api import SinkContext

PREFIX = "agentrl_learner_"


def prometheus_name(metric: str) -> str:
    """``rollout/waste_frac`` -> ``agentrl_learner_rollout_waste_frac``."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class _Latest:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        for name, value in self.values.items():
            yield GaugeMetricFamily(name, "the learner's latest step metric", value=value)


class PrometheusSink:
    def __init__(self, ctx: SinkContext) -> None:
        learner: Mapping[str, Any] = ctx.config.get("learner", {}) if ctx.config else {}
        port = learner.get("metrics_port") or 0
        # loopback unless the config opens it
        host = str(learner.get("metrics_host") or "127.0.0.1")
        self._latest = _Latest()
        self.registry = CollectorRegistry()
        self.registry.register(self._latest)  # type: ignore[arg-type]
        self._server, self._thread = start_http_server(int(port), addr=host, registry=self.registry)
        self.port = self._server.server_port
        get_logger("learner").info("metrics endpoint", url=f"http://{host}:{self.port}/metrics")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        values = dict(self._latest.values)
        values[prometheus_name("step")] = float(step)
        for k, v in metrics.items():
            f = float(v)
            if math.isfinite(f):
                values[prometheus_name(k)] = f
        self._latest.values = values

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
