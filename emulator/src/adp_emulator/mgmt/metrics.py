"""Prometheus ``/metrics`` of the emulator, built with ``prometheus_client``.

One :class:`TargetCollector` per app, registered in its own :class:`CollectorRegistry`, reads a
:class:`~adp_emulator.mgmt.backends.MgmtBackend` at scrape time. The latency histograms have fixed
bucket bounds (1 us * 2^i, the target's log2 histogram; see ``target/counters.py``) and a ``_sum``,
so every scrape exposes the same series. Counter families end in ``_total`` and carry their unit
(``adp_namespace_read_bytes_total``). The names are listed in docs/management-api.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..target.counters import HIST_BUCKETS
from .backends import MgmtBackend

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the latency buckets: bucket i of the target's histogram holds latencies
#: below 2^i us; the last one (capped) goes to +Inf only.
LATENCY_BOUNDS_S: tuple[float, ...] = tuple((1 << i) / 1e6 for i in range(HIST_BUCKETS - 1))

#: (counters key, metric name part, help) of each I/O counter family, per namespace and per queue.
_IO_COUNTERS = (
    ("commands", "commands", "commands completed"),
    ("reads", "reads", "read commands completed"),
    ("writes", "writes", "write commands completed"),
    ("bytes_read", "read_bytes", "bytes read by hosts"),
    ("bytes_written", "write_bytes", "bytes written by hosts"),
    ("errors", "errors", "commands completed with an error status"),
)

#: Target-level counters of the listener (``UserspaceTarget.counters()["listener"]``).
_LISTENER_COUNTERS = (
    ("accept_errors", "adp_accept_errors", "accept() failures the listener backed off from (EMFILE, ENFILE, ...)"),
    ("refused_connections", "adp_refused_connections", "connections closed at once: the connection cap was reached"),
    ("handshake_timeouts", "adp_handshake_timeouts",
     "connections closed because ICReq and Connect did not arrive within the deadline"),
)


def _latency_buckets(d: dict[str, Any]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs over the fixed bounds from a counters dict's ``latency_us_log2``."""
    hist = [0] * HIST_BUCKETS
    for lower_us, n in d["latency_us_log2"].items():
        hist[int(lower_us).bit_length()] += n
    out, cum = [], 0
    for i, bound in enumerate(LATENCY_BOUNDS_S):
        cum += hist[i]
        out.append((repr(bound), cum))
    out.append(("+Inf", cum + hist[-1]))
    return out


class TargetCollector(Collector):
    """Health, usage, faults and I/O counters of one backend, read at every scrape."""

    def __init__(self, backend: MgmtBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        b = self.backend
        h = b.health()
        yield _gauge("adp_up", "1 if the target answers an NVMe/TCP ICReq", int(h["icresp"]), backend=b.kind)
        for name, key, help_ in (("adp_uptime_seconds", "uptime_s", "seconds since the target started"),
                                 ("adp_connections", "connections", "open TCP connections (all queues)"),
                                 ("adp_controllers", "controllers", "live controllers")):
            if h[key] is not None:
                yield _gauge(name, help_, h[key])
        u = b.usage()
        cap = GaugeMetricFamily("adp_namespace_capacity_bytes", "namespace size", labels=["nsid"])
        alloc = GaugeMetricFamily("adp_namespace_allocated_bytes", "bytes backed by memory or disk", labels=["nsid"])
        for ns in u["namespaces"]:
            if ns["capacity_bytes"] is not None:
                cap.add_metric([str(ns["nsid"])], ns["capacity_bytes"])
            if ns["allocated_bytes"] is not None:
                alloc.add_metric([str(ns["nsid"])], ns["allocated_bytes"])
        yield cap
        if alloc.samples:
            yield alloc
        f = b.faults_state()
        if f and f.get("supported"):
            yield _gauge("adp_fault_delay_seconds", "injected delay per I/O command", f["delay_s"])
            yield _gauge("adp_fault_device_full", "1 while writes fail with Capacity Exceeded", int(f["device_full"]))
        c = b.counters()
        if c is None:
            return
        listener = c.get("listener") or {}
        for key, name, help_ in _LISTENER_COUNTERS:
            if key in listener:
                fam = CounterMetricFamily(name, help_)
                fam.add_metric([], listener[key])
                yield fam
        scopes = (("adp_namespace", ["nsid"], [([n], d) for n, d in sorted(c["namespaces"].items())]),
                  ("adp_queue", ["cntlid", "qid"],
                   [([str(q["cntlid"]), str(q["qid"])], q) for q in c["queues"]]))
        for prefix, labels, series in scopes:
            for key, part, help_ in _IO_COUNTERS:
                fam = CounterMetricFamily(f"{prefix}_{part}", help_, labels=labels)
                for values, d in series:
                    fam.add_metric(values, d[key])
                yield fam
            hist = HistogramMetricFamily(f"{prefix}_latency_seconds", "command latency, receipt to completion",
                                         labels=labels)
            for values, d in series:
                hist.add_metric(values, _latency_buckets(d), d.get("latency_seconds_sum", 0.0))
            yield hist


def _gauge(name: str, help_: str, value: float, **labels: str) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, help_, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def registry_for(backend: MgmtBackend) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding one :class:`TargetCollector`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(TargetCollector(backend))
    return reg


def prometheus_text(backend: MgmtBackend) -> str:
    """The exposition text (format 0.0.4) of ``backend`` (one scrape)."""
    return generate_latest(registry_for(backend)).decode()
