"""Connector statistics: vLLM ``KVConnectorStats`` (logged) and Prometheus counters (``build_prom_metrics``).

Imported lazily by the connector's classmethods: it needs vLLM (and prometheus_client) at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..pipeline.counters import SAMPLE_PREFIX
from ..pipeline.restore import FAILURE_COUNTER_PREFIX, PHASE_COUNTER_PREFIX, RESTORE_PHASES, Cause
from ..pipeline.save import DROP_CAUSES, DROP_COUNTER_PREFIX
from .hook_timing import HOOK_CALLS_PREFIX, HOOK_SECONDS_PREFIX, HOOKS, hook_seconds

# labelled counter families: data key prefix -> (metric name, help, label, its values)
LABELLED = {
    FAILURE_COUNTER_PREFIX: ("vllm:adp_kv_load_failures", "failed restores (the request recomputed), by cause",
                             "cause", tuple(c.value for c in Cause)),
    DROP_COUNTER_PREFIX: ("vllm:adp_kv_saves_dropped_by_cause", "pages of saves dropped (not attempted), by cause",
                          "cause", tuple(DROP_CAUSES)),
    HOOK_SECONDS_PREFIX: ("vllm:adp_kv_hook_seconds", "seconds spent inside each vLLM hook, on the calling thread",
                          "hook", HOOKS),
    HOOK_CALLS_PREFIX: ("vllm:adp_kv_hook_calls", "calls of each vLLM hook", "hook", HOOKS),
    PHASE_COUNTER_PREFIX: ("vllm:adp_kv_restore_phase_seconds", "seconds of successful restores in each phase "
                           "(queued, io, copy, step_wait add up to their time; slab_wait is part of io)", "phase",
                           tuple(RESTORE_PHASES)),
}

# Counter names (summed across workers and intervals). *_s are seconds, bytes_* bytes. Besides these, one
# ``load_failed_<cause>`` per failure cause (:class:`adp_connector.pipeline.restore.Cause`) and one
# ``save_dropped_<cause>`` per reason a save was dropped, exported with a ``cause`` label, and the seconds and calls
# of each vLLM hook (:mod:`.hook_timing`), exported with a ``hook`` label (:data:`LABELLED`).
COUNTERS = (
    "lookups", "lookup_hit_tokens", "loads", "loads_ok", "load_fallbacks", "verify_failures", "pages_loaded",
    "bytes_loaded", "load_s", "saves", "pages_saved", "bytes_saved", "save_s", "saves_dropped", "save_errors",
    "store_unavailable", "saves_deduped", "async_loads_skipped", "lookups_reused",
    "restores_declined", "saves_waited", "saves_not_admitted",
    "read_ahead_pages", "read_ahead_used_pages", "read_ahead_unused_pages", "read_ahead_expired_pages",
    "card_evictions", "card_evictions_outlived",
)


# Histograms (in the style of vLLM's NIXL connector metrics): sample name (pipeline.counters.observe) ->
# (metric name, help, buckets). Latency and size of every successful restore (all its pages) and save batch.
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB, x4 steps
HISTOGRAMS = {
    "restore_seconds": ("vllm:adp_kv_restore_time_seconds",
                        "time from a restore's submission to its pages landing in the KV cache (successful restores)",
                        _SECONDS_BUCKETS),
    "restore_bytes": ("vllm:adp_kv_restore_bytes", "bytes of one successful restore (all its pages)", _BYTES_BUCKETS),
    "save_seconds": ("vllm:adp_kv_save_time_seconds", "time of one save batch on the card (batches with a written "
                     "page)", _SECONDS_BUCKETS),
    "save_bytes": ("vllm:adp_kv_save_bytes", "bytes written by one save batch", _BYTES_BUCKETS),
}
# Link state reported by each connector role (scheduler, every worker) when it changes and while it is down.
LINK_KEYS = ("store_links", "store_links_up")


def _samples(data: dict[str, Any], name: str) -> list[float]:
    v = data.get(SAMPLE_PREFIX + name)
    return v if isinstance(v, list) else []


@dataclass
class ADPConnectorStats(KVConnectorStats):
    """Counters of one interval; ``reduce`` adds GB/s and mean load latency."""

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> ADPConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, list):  # histogram samples
                self.data[k] = [*self.data.get(k, []), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS}
        causes = tuple(p for p, (*_, label, _values) in LABELLED.items() if label == "cause")
        out.update({k: v for k, v in d.items() if k.startswith(causes) and v})
        hooks = hook_seconds(d)  # one figure in the log line; each hook on /metrics
        if hooks:
            out["hooks_ms"] = round(1e3 * sum(hooks.values()), 1)
        if d.get("loads_ok"):  # where a mean successful restore's time went, in the log line
            for p in RESTORE_PHASES:
                out[f"restore_{p}_ms"] = round(1e3 * d.get(PHASE_COUNTER_PREFIX + p, 0) / d["loads_ok"], 1)
        if d.get("store_links"):
            out["store_connected"] = int(d.get("store_links_up", 0) >= d["store_links"])
        out["load_gbps"] = round(d["bytes_loaded"] / d["load_s"] / 1e9, 3) if d.get("load_s") else 0.0
        out["save_gbps"] = round(d["bytes_saved"] / d["save_s"] / 1e9, 3) if d.get("save_s") else 0.0
        out["mean_load_ms"] = round(1e3 * d["load_s"] / d["loads"], 2) if d.get("loads") else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items()
                       if k in COUNTERS or k in LINK_KEYS or k.startswith((*LABELLED, SAMPLE_PREFIX)))


class ADPPromMetrics(KVConnectorPromMetrics):
    """``vllm:adp_kv_*`` counters (exposed with ``_total``), histograms and the ``store_connected`` gauge, one series
    per engine (docs/connector.md, "Metrics")."""

    _EXPORTED = ("loads_ok", "load_fallbacks", "verify_failures", "pages_loaded", "bytes_loaded", "load_s",
                 "pages_saved", "bytes_saved", "save_s", "saves_dropped", "save_errors", "lookup_hit_tokens",
                 "store_unavailable", "restores_declined", "saves_deduped", "async_loads_skipped", "saves_waited",
                 "saves_not_admitted", "read_ahead_pages", "read_ahead_used_pages", "read_ahead_unused_pages",
                 "read_ahead_expired_pages", "card_evictions", "card_evictions_outlived")

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for name in self._EXPORTED:
            unit = "seconds" if name.endswith("_s") else ""
            metric = self._counter_cls(
                name=f"vllm:adp_kv_{name.removesuffix('_s') + '_seconds' if unit else name}",
                documentation=f"ADP KV connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._series[name] = {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}
        self._by_label: dict[str, dict[int, dict[str, Any]]] = {}  # prefix -> engine -> label value -> series
        for prefix, (metric_name, doc, label, values) in LABELLED.items():
            metric = self._counter_cls(name=metric_name, documentation=f"ADP KV connector: {doc}",
                                       labelnames=[*labelnames, label])
            self._by_label[prefix] = {idx: {c: metric.labels(*vals, c) for c in values}
                                      for idx, vals in per_engine_labelvalues.items()}
        self._histograms: dict[str, dict[int, Any]] = {}
        for sample, (metric_name, doc, buckets) in HISTOGRAMS.items():
            metric = self._histogram_cls(name=metric_name, documentation=f"ADP KV connector: {doc}",
                                         buckets=list(buckets), labelnames=labelnames)
            self._histograms[sample] = {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}
        gauge = self._gauge_cls(name="vllm:adp_kv_store_connected",
                                documentation="ADP KV connector: 1 when every connector role (scheduler, workers) has "
                                "its page store open, 0 while one serves without it; NaN until the first engine step",
                                labelnames=labelnames, multiprocess_mode="mostrecent")
        self._connected = {idx: gauge.labels(*vals) for idx, vals in per_engine_labelvalues.items()}
        for g in self._connected.values():
            g.set(float("nan"))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for sample, per_engine in self._histograms.items():
            if engine_idx in per_engine:
                for v in _samples(transfer_stats_data, sample):
                    per_engine[engine_idx].observe(v)
        links = transfer_stats_data.get("store_links", 0)
        if links and engine_idx in self._connected:
            self._connected[engine_idx].set(1.0 if transfer_stats_data.get("store_links_up", 0) >= links else 0.0)
        for name, per_engine in self._series.items():
            v = transfer_stats_data.get(name, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
        for prefix, per_engine_values in self._by_label.items():
            series = per_engine_values.get(engine_idx, {})
            for name, v in transfer_stats_data.items():
                if v and name.startswith(prefix) and name[len(prefix):] in series:
                    series[name[len(prefix):]].inc(v)
