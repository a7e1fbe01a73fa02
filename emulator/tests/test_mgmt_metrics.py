"""``/metrics`` of the emulator read with prometheus_client's own parser, idle and after traffic."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from adp_connector.nvmeof.host.controller import Controller, HostConfig
from adp_emulator.mgmt import UserspaceBackend, create_app
from adp_emulator.mgmt.metrics import LATENCY_BOUNDS_S
from adp_emulator.target import TargetSettings, UserspaceTarget


@pytest.fixture
def tgt() -> Iterator[UserspaceTarget]:
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=16 << 20)) as t:
        yield t


def _scrape(c: TestClient) -> dict:
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _buckets(fam, **labels: str) -> list[tuple[str, float]]:
    return [(s.labels["le"], s.value) for s in fam.samples
            if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in labels.items())]


def test_metrics_fixed_buckets_sum_count_and_unit_names(tgt: UserspaceTarget) -> None:
    c = TestClient(create_app(UserspaceBackend(tgt), "t" * 32))
    idle = _scrape(c)
    h, p = tgt.address
    with Controller.connect(HostConfig(traddr=h, trsvcid=p, subnqn=tgt.settings.subnqn, io_queues=1)) as host:
        for i in range(20):
            host.write(i * 8192, bytes(8192))
            host.read(i * 8192, 8192)
        busy = _scrape(c)
    for name in ("adp_namespace_read_bytes", "adp_namespace_write_bytes", "adp_namespace_commands",
                 "adp_namespace_errors", "adp_queue_read_bytes", "adp_accept_errors", "adp_refused_connections",
                 "adp_handshake_timeouts"):
        assert busy[name].type == "counter", name
        assert all(s.name == name + "_total" for s in busy[name].samples), name
    ns = busy["adp_namespace_read_bytes"].samples[0]
    assert ns.labels == {"nsid": "1"} and ns.value == 20 * 8192
    assert busy["adp_namespace_write_bytes"].samples[0].value == 20 * 8192
    lat_idle, lat = idle["adp_namespace_latency_seconds"], busy["adp_namespace_latency_seconds"]
    assert lat.type == "histogram"
    want_le = [repr(b) for b in LATENCY_BOUNDS_S] + ["+Inf"]
    assert [le for le, _ in _buckets(lat_idle, nsid="1")] == want_le  # the same series idle ...
    got = _buckets(lat, nsid="1")
    assert [le for le, _ in got] == want_le  # ... and after traffic
    counts = [v for _, v in got]
    assert counts == sorted(counts) and counts[-1] >= 40
    by_name = {s.name: s.value for s in lat.samples if s.labels == {"nsid": "1"}}
    assert by_name["adp_namespace_latency_seconds_count"] == counts[-1]
    assert 0 < by_name["adp_namespace_latency_seconds_sum"] < 60
    assert {s.name for s in lat_idle.samples if s.labels == {"nsid": "1"}} >= {
        "adp_namespace_latency_seconds_sum", "adp_namespace_latency_seconds_count"}
    qlat = busy["adp_queue_latency_seconds"]
    assert {s.labels["qid"] for s in qlat.samples} >= {"0", "1"}


def test_old_import_path_still_works() -> None:
    from adp_emulator import api, mgmt

    assert api.create_app is mgmt.create_app and api.UserspaceBackend is mgmt.UserspaceBackend
