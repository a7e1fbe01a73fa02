"""Helpers shared by the page-store tests (a distinct module name: safe next to other test dirs)."""

from __future__ import annotations

from adp_connector.store import StoreConfig

PROCESS_NQN = "nqn.2026-11.io.awide:store-process-tests"  # the subsystem of conftest.py's target fixture


def fast_config(**kw: object) -> StoreConfig:
    """A StoreConfig for tests: tiny claim settle, no background threads, few partitions, every new page admitted
    into a full card (the eviction tests fill a card with pages asked for once; admission has its own tests)."""
    base: dict[str, object] = {"claim_settle_s": 0.01, "heartbeat_interval_s": 0, "partitions": 4,
                               "avg_page_bytes": 16 << 10, "admission": "always"}
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]


def timed_connect(host: object, log_path: str, delay_s: float) -> object:
    """A helper's ``open_device`` for tests: waits ``delay_s`` (a slow store open), connects, and appends
    ``pid start end`` (wall-clock seconds) to ``log_path``."""
    import os
    import time

    from adp_connector.nvmeof.host import Controller

    t0 = time.time()
    time.sleep(delay_s)
    ctrl = Controller.connect(host)  # type: ignore[arg-type]
    with open(log_path, "a") as f:
        f.write(f"{os.getpid()} {t0} {time.time()}\n")
    return ctrl


def open_spans(log_path: str) -> list[tuple[int, float, float]]:
    """The (pid, start, end) lines :func:`timed_connect` wrote, in order of start."""
    with open(log_path) as f:
        rows = [line.split() for line in f if line.strip()]
    return sorted(((int(p), float(a), float(b)) for p, a, b in rows), key=lambda r: r[1])


def all_overlap(spans: list[tuple[int, float, float]]) -> bool:
    """Whether one instant lies inside every span (each started before any of them ended)."""
    return max(s for _, s, _ in spans) < min(e for _, _, e in spans)
