"""Helpers shared by the page-store tests (a distinct module name: safe next to other test dirs)."""

from __future__ import annotations

from adp_connector.store import StoreConfig

PROCESS_NQN = "nqn.2026-11.io.awide:store-process-tests"  # the subsystem of conftest.py's target fixture


def fast_config(**kw: object) -> StoreConfig:
    """A StoreConfig for tests: tiny claim settle, no background threads, few partitions."""
    base: dict[str, object] = {"claim_settle_s": 0.01, "heartbeat_interval_s": 0, "partitions": 4,
                               "avg_page_bytes": 16 << 10}
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]
