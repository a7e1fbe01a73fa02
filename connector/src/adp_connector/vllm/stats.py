"""Connector statistics: vLLM ``KVConnectorStats`` (logged) and Prometheus counters (``build_prom_metrics``).

Imported lazily by the connector's classmethods: it needs vLLM (and prometheus_client) at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..pipeline.restore import FAILURE_COUNTER_PREFIX, Cause

# Counter names (summed across workers and intervals). *_s are seconds, bytes_* bytes. Besides these, one
# ``load_failed_<cause>`` per failure cause (:class:`adp_connector.pipeline.restore.Cause`), exported as
# ``vllm:adp_kv_load_failures{cause=...}``.
COUNTERS = (
    "lookups", "lookup_hit_tokens", "loads", "loads_ok", "load_fallbacks", "verify_failures", "pages_loaded",
    "bytes_loaded", "load_s", "saves", "pages_saved", "bytes_saved", "save_s", "saves_dropped", "save_errors",
    "store_unavailable", "saves_deduped", "async_loads_skipped",
)


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
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS}
        out.update({k: v for k, v in d.items() if k.startswith(FAILURE_COUNTER_PREFIX) and v})
        out["load_gbps"] = round(d["bytes_loaded"] / d["load_s"] / 1e9, 3) if d.get("load_s") else 0.0
        out["save_gbps"] = round(d["bytes_saved"] / d["save_s"] / 1e9, 3) if d.get("save_s") else 0.0
        out["mean_load_ms"] = round(1e3 * d["load_s"] / d["loads"], 2) if d.get("loads") else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k in COUNTERS or k.startswith(FAILURE_COUNTER_PREFIX))


class ADPPromMetrics(KVConnectorPromMetrics):
    """``vllm:adp_kv_*`` counters, one series per engine."""

    _EXPORTED = ("loads_ok", "load_fallbacks", "verify_failures", "pages_loaded", "bytes_loaded", "load_s",
                 "pages_saved", "bytes_saved", "save_s", "saves_dropped", "save_errors", "lookup_hit_tokens")

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
        failures = self._counter_cls(
            name="vllm:adp_kv_load_failures",
            documentation="ADP KV connector: failed restores (the request recomputed), by cause",
            labelnames=[*labelnames, "cause"],
        )
        self._failures = {idx: {c.value: failures.labels(*vals, c.value) for c in Cause}
                          for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._series.items():
            v = transfer_stats_data.get(name, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
        by_cause = self._failures.get(engine_idx, {})
        for name, v in transfer_stats_data.items():
            cause = name[len(FAILURE_COUNTER_PREFIX):] if name.startswith(FAILURE_COUNTER_PREFIX) else None
            if v and cause in by_cause:
                by_cause[cause].inc(v)
