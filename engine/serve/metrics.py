"""Prometheus metrics of the server (GET /metrics): requests by endpoint and status, their latency, and the
batcher's own counts read at each scrape (queue depth, running batch, steps done, model calls computed) and the
per-request LoRAs' (per LoRA name: forwards, samples, loads, evictions, resident; the cache's bytes)."""
from __future__ import annotations

import time
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
CLIENT_GONE = 499  # nginx's status for "the client closed the connection first", in the metrics only


class _BatcherCollector:
    """The batcher's stats() and the server's images in flight, as metrics at scrape time; the per-request LoRA
    cache's counters per LoRA name (``loras``: RowLoRAs.metrics, None: no cache)."""

    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int], loras: Optional[Callable[[], dict]]):
        self.stats, self.in_flight, self.loras = stats, in_flight, loras

    def _lora_metrics(self):
        m = self.loras()
        yield GaugeMetricFamily("sgld_lora_cache_bytes", "bytes of the per-request LoRA cache (files and resident "
                                "terms)", value=m["bytes"])
        yield GaugeMetricFamily("sgld_lora_cache_budget_bytes", "its budget (--lora-cache-mb)", value=m["budget"])
        families = {what: CounterMetricFamily(f"sgld_lora_{what}", text, labels=["lora"]) for what, text in (
            ("forwards", "DiT forwards that carried this per-request LoRA"),
            ("samples", "samples (CFG branches count) this LoRA was applied to, summed over forwards"),
            ("loads", "times its terms were made resident"), ("evictions", "times it was evicted (least recently used)"))}
        resident = GaugeMetricFamily("sgld_lora_resident", "1 while the LoRA's terms are resident", labels=["lora"])
        for name, counts in m["loras"].items():
            for what, family in families.items():
                family.add_metric([name], counts[what])
            resident.add_metric([name], int(counts["resident"]))
        yield from families.values()
        yield resident

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("sgld_queue_depth", "images waiting for a place in the running batch", value=s["queued"])
        yield GaugeMetricFamily("sgld_running_batch_size", "images in the running batch", value=s["running"])
        yield GaugeMetricFamily("sgld_images_in_flight", "images admitted and not yet answered (running and waiting)",
                                value=self.in_flight())
        yield GaugeMetricFamily("sgld_samples_per_forward", "mean samples per DiT forward", value=s["samples_per_forward"])
        yield CounterMetricFamily("sgld_forwards", "DiT forwards run", value=s["forwards"])
        yield CounterMetricFamily("sgld_denoising_steps", "denoising steps done, all images together (rate: step "
                                  "throughput)", value=s["steps_done"])
        yield CounterMetricFamily("sgld_model_calls", "model calls of the schedules, computed or cached", value=s["calls_total"])
        yield CounterMetricFamily("sgld_model_calls_computed", "model calls computed (the rest cached by Cache-DiT)",
                                  value=s["calls_computed"])
        yield CounterMetricFamily("sgld_jobs_waited_for_memory", "jobs that waited for GPU memory beside the running "
                                  "batch (not for --max-batch)", value=s["waited_for_memory"])
        if self.loras is not None:
            yield from self._lora_metrics()


class Metrics:
    """One registry per app (two apps in one process do not collide)."""

    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int],
                 loras: Optional[Callable[[], dict]] = None):
        self.registry = CollectorRegistry()
        self.requests = Counter("sgld_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("sgld_request_latency_seconds", "time from request to answer, by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.images = Counter("sgld_images", "images generated", registry=self.registry)
        self.registry.register(_BatcherCollector(stats, in_flight, loras))

    def render(self) -> tuple:
        """(body, content type) of the exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def middleware(self, app, endpoints):
        """Pure ASGI (a BaseHTTPMiddleware would hide client disconnects from the handlers): every answer
        counted by endpoint (paths outside ``endpoints`` as "other") and status, and timed."""
        async def record(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            endpoint = scope["path"] if scope["path"] in endpoints else "other"
            status = [500]
            started = time.perf_counter()

            async def send_status(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)
            try:
                await app(scope, receive, send_status)
            finally:
                self.requests.labels(endpoint, str(status[0])).inc()
                self.latency.labels(endpoint).observe(time.perf_counter() - started)
        record.metrics = self  # a scrape from within the process (a --ray replica's report) counts no request
        return record
