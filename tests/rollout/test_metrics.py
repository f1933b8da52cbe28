"""RolloutStats: the log line, the stats logger task and the Prometheus endpoint over real HTTP."""

from __future__ import annotations

import urllib.request

import anyio
import pytest

from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.metrics import CountingEngine, RolloutStats, run_stats_logger


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _busy_stats(clock: FakeClock) -> RolloutStats:
    stats = RolloutStats(server_id="rs-7", clock=clock)
    for _ in range(5):
        stats.episode_started()
    for _ in range(4):
        stats.episode_finished(generated_tokens=250, turns=3, tool_calls=2, tool_errors=1)
    stats.staleness_dropped(2)
    stats.batch_shipped(8)
    stats.set_queue_depths(spool=2, unacked=3)
    stats.set_weight_version(6)
    return stats


def test_stats_line_shows_rates_over_the_interval_and_levels() -> None:
    clock = FakeClock()
    stats = _busy_stats(clock)
    clock.now += 2.0
    line = stats.stats_line()
    for part in [
        "episodes 2.00/s",
        "gen 500.0 tok/s",
        "turns 3.00/episode",
        "tools 8 calls 4 errors",
        "in flight 1",
        "unacked 3 (spool 2)",
        "version 6",
        "staleness drops 2",
        "shipped 8 trajectories",
    ]:
        assert part in line, (part, line)
    clock.now += 10.0
    stats.episode_finished(generated_tokens=100, turns=1)
    line = stats.stats_line()  # rates are over the last interval only; totals and levels persist
    assert "episodes 0.10/s" in line and "gen 10.0 tok/s" in line and "turns 1.00/episode" in line
    assert (
        "tools 0 calls 0 errors" in line and "in flight 0" in line and "staleness drops 0" in line
    )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_stats_logger_logs_a_line_per_interval(anyio_backend: str) -> None:
    lines: list[str] = []

    class Log:
        def info(self, msg: str) -> None:
            lines.append(msg)

    stats = RolloutStats()
    with anyio.move_on_after(0.35):
        await run_stats_logger(stats, 0.1, Log())
    assert 2 <= len(lines) <= 4 and all(line.startswith("episodes ") for line in lines)
    with pytest.raises(ValueError, match="must be > 0"):
        await run_stats_logger(stats, 0, Log())


def test_prometheus_endpoint_serves_the_values_from_its_own_registry() -> None:
    stats = _busy_stats(FakeClock())
    other = RolloutStats(server_id="rs-8")  # a second server in the same process must not clash
    port = stats.start_metrics_server(0, addr="127.0.0.1")
    port2 = other.start_metrics_server(0)  # the default interface is loopback
    try:
        assert other._http is not None and other._http[0].server_address[0] == "127.0.0.1"
        assert port > 0 and port2 != port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        expected = {
            "rollout_episodes_finished_total": 4.0,
            "rollout_generated_tokens_total": 1000.0,
            "rollout_turns_total": 12.0,
            "rollout_tool_calls_total": 8.0,
            "rollout_tool_errors_total": 4.0,
            "rollout_staleness_drops_total": 2.0,
            "rollout_trajectories_shipped_total": 8.0,
            "rollout_episodes_in_flight": 1.0,
            "rollout_spool_batches": 2.0,
            "rollout_unacked_batches": 3.0,
            "rollout_weight_version": 6.0,
        }
        for name, value in expected.items():
            assert f'{name}{{server_id="rs-7"}} {value}' in body, name
        stats.episode_started()  # read at scrape time: the next scrape sees it
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert 'rollout_episodes_in_flight{server_id="rs-7"} 2.0' in r.read().decode()
        with pytest.raises(RuntimeError, match="already running"):
            stats.start_metrics_server(0)
    finally:
        stats.stop_metrics_server()
        other.stop_metrics_server()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_kv_reused_across_updates_is_counted_and_shown_per_interval(
    anyio_backend: str,
) -> None:
    """What an engine's generations say they sent on older KV, and found cached, is summed by the
    counting engine and shown as a share of the interval's tokens; no part without any."""

    class Engine:
        policy_version = 3

        async def generate(self, request_id: str, prompt_ids: list[int], s: object) -> Generation:
            return Generation(
                [1, 2], [-0.1, -0.2], [3, 3], "stop", reuse_sent=400, reuse_cached=384
            )

    clock = FakeClock()
    stats = RolloutStats(clock=clock)
    assert "kv reused" not in stats.stats_line()
    engine = CountingEngine(Engine(), stats)  # type: ignore[arg-type]
    for i in range(2):
        await engine.generate(f"r{i}", [5], SamplingSettings(max_tokens=2))
    clock.now += 1.0
    assert "kv reused 96% of 800 tokens" in stats.stats_line()
    assert (stats.counters.kv_reuse_sent, stats.counters.kv_reuse_cached) == (800, 768)
    assert "kv reused" not in stats.stats_line()  # nothing new in this interval
