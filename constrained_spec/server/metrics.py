"""Prometheus metrics of the server (``--enable-metrics``, ``GET /metrics``).

Nothing is counted twice: a collector reads the engine loop's own counters
(:class:`~constrained_spec.generation.serving.EngineLoop` ``.metrics``), its queue and the HTTP response
counter of the app's middleware at scrape time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from constrained_spec.server.state import Server


def metrics_registry(server: Server) -> Any:
    """A registry whose collector reads the engine loop's counters at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class EngineCollector:
        def collect(self) -> Any:
            s = server.loop.metrics.snapshot()
            p = "constrained_spec_"
            c = CounterMetricFamily(p + "requests", "Finished requests, by finish reason",
                                    labels=["finish_reason"])
            for reason, n in sorted(s["finished"].items()):
                c.add_metric([reason], n)
            yield c
            yield CounterMetricFamily(p + "requests_submitted", "Requests accepted into the queue",
                                      value=s["submitted"])
            yield CounterMetricFamily(p + "requests_rejected", "Requests refused because the queue "
                                      "was full (429)", value=s["rejected"])
            h = CounterMetricFamily(p + "http_responses", "HTTP responses, by route and status",
                                    labels=["route", "status"])
            for (route, status), n in sorted(server.config.http_responses.items()):
                h.add_metric([route, str(status)], n)
            yield h
            yield CounterMetricFamily(p + "retries", "Retry attempts run after a failed attempt "
                                      "(max_retries; each is one more engine request)",
                                      value=server.retries)
            yield CounterMetricFamily(p + "prompt_tokens", "Prompt tokens of finished requests",
                                      value=s["prompt_tokens"])
            yield CounterMetricFamily(p + "generation_tokens", "Generated (accepted) tokens",
                                      value=s["generated_tokens"])
            yield GaugeMetricFamily(p + "generation_tokens_per_second",
                                    "Generated tokens per second over the last 10 s",
                                    value=s["tokens_per_s"])
            yield CounterMetricFamily(p + "engine_steps", "Batched engine steps", value=s["steps"])
            yield CounterMetricFamily(p + "engine_failed_steps", "Engine steps whose shared target "
                                      "forward or verification failed", value=s["failed_steps"])
            yield CounterMetricFamily(p + "engine_step_seconds", "Time spent in engine steps",
                                      value=s["step_s"])
            yield CounterMetricFamily(p + "target_forwards", "Target forwards, counted per request "
                                      "(finished requests)", value=s["target_forwards"])
            yield CounterMetricFamily(p + "drafted_tokens", "Drafted tokens (finished requests)",
                                      value=s["drafted_tokens"])
            yield CounterMetricFamily(p + "accepted_tokens", "Accepted drafts (finished requests)",
                                      value=s["accepted_tokens"])
            yield GaugeMetricFamily(p + "acceptance_length", "Tokens emitted per target forward "
                                    "(finished requests; 1.0 without speculation)",
                                    value=s["acceptance_length"])
            yield GaugeMetricFamily(p + "acceptance_rate", "Accepted / drafted tokens (finished "
                                    "requests)", value=s["acceptance_rate"])
            g = GaugeMetricFamily(p + "acceptance_rate_by_position", "Of the steps that drafted "
                                  "position i, the share that accepted it", labels=["position"])
            for i, rate in enumerate(s["acceptance_rate_by_position"], start=1):
                g.add_metric([str(i)], rate)
            yield g
            yield GaugeMetricFamily(p + "queue_depth", "Requests waiting for a slot",
                                    value=server.loop.waiting)
            yield GaugeMetricFamily(p + "running_requests", "Requests in the running batch",
                                    value=server.loop.running)
            slots = server.loop.slots_in_use
            if slots is not None:
                yield GaugeMetricFamily(p + "kv_slots_in_use", "KV-cache slots held by the model "
                                        "runner (running requests; more would be a leak)",
                                        value=slots)
            yield from _cache_gauges(server, p)
            lat = HistogramMetricFamily(p + "request_latency_seconds", "Time from queueing to the "
                                        "end of generation")
            lat.add_metric([], [(str(b), n) for b, n in s["latency_buckets"]], s["latency_sum"])
            yield lat

    registry = CollectorRegistry()
    registry.register(EngineCollector())
    return registry


def _cache_gauges(server: Server, prefix: str) -> Any:
    """The bytes the server's bounded caches hold: compiled grammars, prompt prefixes."""
    from prometheus_client.core import GaugeMetricFamily

    from constrained_spec.grammar import compile_cache_info

    yield GaugeMetricFamily(prefix + "compile_cache_bytes", "Bytes of compiled grammars kept "
                            "(bounded: CONSTRAINED_SPEC_COMPILE_CACHE_MB)",
                            value=compile_cache_info()["bytes"])
    prefiller = getattr(getattr(server.model, "runner", None), "prefiller", None)
    if prefiller is not None:
        yield GaugeMetricFamily(prefix + "prefix_cache_bytes", "Bytes of prompt prefixes kept "
                                "(bounded: CONSTRAINED_SPEC_PREFIX_CACHE_MB)",
                                value=prefiller.cache.bytes)
