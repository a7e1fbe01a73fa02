"""Tests for the nvmetcli-JSON config model (adp_emulator.config)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from adp_emulator.config import (
    DEFAULT_NQN,
    AdpSettings,
    GiB,
    Namespace,
    NvmetConfig,
    Port,
    Subsystem,
    default_config,
    load_config,
    save_config,
)

HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"

# The shape of nvmetcli's examples/tcp.json (values are ours).
NVMETCLI_JSON: dict[str, Any] = {
    "hosts": [{"nqn": HOST}],
    "ports": [{
        "addr": {"adrfam": "ipv4", "traddr": "10.0.0.1", "treq": "not specified", "trsvcid": "4420",
                 "trtype": "tcp"},
        "ana_groups": [{"ana": {"state": "optimized"}, "grpid": 1}],
        "param": {"inline_data_size": "16384", "pi_enable": "0"},
        "portid": 1,
        "referrals": [],
        "subsystems": ["nqn.2026-11.io.awide:a", "nqn.2026-11.io.awide:b"],
    }],
    "subsystems": [
        {"allowed_hosts": [], "attr": {"allow_any_host": "1", "model": "Linux", "serial": "123456789abcdef",
                                       "version": "1.3"},
         "namespaces": [{"ana_grpid": 1, "device": {"nguid": "00000000-0000-0000-0000-000000000000",
                                                    "path": "/dev/nvme0n1",
                                                    "uuid": "d592cdf3-5d1c-44e0-8412-3fcf7d99df27"},
                         "enable": 1, "nsid": 1}],
         "nqn": "nqn.2026-11.io.awide:a"},
        {"allowed_hosts": [HOST], "attr": {"allow_any_host": "0"},
         "namespaces": [{"device": {"path": "/var/tmp/b.img"}, "enable": 0, "nsid": 7}],
         "nqn": "nqn.2026-11.io.awide:b"},
    ],
}


def test_parse_nvmetcli_example() -> None:
    cfg = NvmetConfig.from_json(NVMETCLI_JSON)
    assert cfg.hosts == [HOST]
    p = cfg.ports[0]
    assert (p.portid, p.trtype, p.traddr, p.trsvcid, p.params["inline_data_size"]) == (1, "tcp", "10.0.0.1", "4420",
                                                                                      "16384")
    a, b = cfg.subsystems
    assert a.allow_any_host and a.attrs == {"model": "Linux", "serial": "123456789abcdef", "version": "1.3"}
    assert a.namespaces[0] == Namespace(1, "/dev/nvme0n1", True, "d592cdf3-5d1c-44e0-8412-3fcf7d99df27",
                                        "00000000-0000-0000-0000-000000000000", 1)
    assert not b.allow_any_host and b.allowed_hosts == [HOST] and not b.namespaces[0].enable
    assert cfg.adp == AdpSettings()


def test_nvmetcli_part_round_trips_exactly() -> None:
    cfg = NvmetConfig.from_json(NVMETCLI_JSON)
    assert cfg.nvmetcli_json() == NVMETCLI_JSON
    assert "adp" not in cfg.nvmetcli_json()
    full = cfg.to_json()
    assert NvmetConfig.from_json(full) == cfg
    assert full["adp"]["capacity_bytes"] == GiB


def test_default_config() -> None:
    cfg = default_config()
    j = cfg.to_json(include_adp=False)
    assert j["ports"][0]["addr"] == {"adrfam": "ipv4", "traddr": "127.0.0.1", "treq": "not specified",
                                     "trsvcid": "4420", "trtype": "tcp"}
    assert j["ports"][0]["subsystems"] == [DEFAULT_NQN]
    sub = j["subsystems"][0]
    assert sub["nqn"] == DEFAULT_NQN and sub["attr"]["allow_any_host"] == "1"
    assert sub["namespaces"][0]["nsid"] == 1 and sub["namespaces"][0]["enable"] == 1
    assert len(sub["attr"]["serial"]) <= 20  # NVMET_SN_MAX_SIZE
    assert cfg.adp.backing == "ram"
    assert default_config() == cfg  # deterministic UUIDs
    f = default_config(port=5000, nqn="nqn.2026-11.io.awide:x", traddr="0.0.0.0", backing_path="/tmp/x.img")
    assert f.ports[0].trsvcid == "5000" and f.subsystems[0].namespaces[0].path == "/tmp/x.img"
    assert f.adp.backing == "file"


def test_load_and_save(tmp_path: Path) -> None:
    cfg = default_config()
    cfg.adp.lba_size = 512
    p = tmp_path / "c.json"
    save_config(cfg, p)
    assert load_config(p) == cfg
    save_config(cfg, tmp_path / "n.json", include_adp=False)
    assert "adp" not in json.loads((tmp_path / "n.json").read_text())


def test_load_errors(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text('{"hosts": [}')
    with pytest.raises(ValueError, match=r"invalid JSON at line 1"):
        load_config(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.json")


def _mutate(path: list[Any], value: Any) -> dict[str, Any]:
    d = copy.deepcopy(NVMETCLI_JSON)
    cur: Any = d
    for k in path[:-1]:
        cur = cur[k]
    if value is KeyError:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return d


@pytest.mark.parametrize(("path", "value", "match"), [
    (["ports", 0, "addr", "trtype"], "tcpx", r"ports\[0\]\.addr\.trtype"),
    (["ports", 0, "addr", "trsvcid"], "70000", r"ports\[0\]\.addr\.trsvcid.*out of range"),
    (["ports", 0, "addr", "trsvcid"], "http", r"ports\[0\]\.addr\.trsvcid"),
    (["ports", 0, "addr", "traddr"], "localhost", r"ports\[0\]\.addr\.traddr"),
    (["ports", 0, "addr", "treq"], "maybe", r"ports\[0\]\.addr\.treq"),
    (["ports", 0, "portid"], "one", r"ports\[0\]\.portid"),
    (["ports", 0, "portid"], KeyError, r"ports\[0\].*missing required key.*portid"),
    (["ports", 0, "subsystems", 0], "nqn.x:nope", r"ports\[0\]\.subsystems\[0\].*not defined"),
    (["ports", 0, "colour"], "red", r"ports\[0\].*unknown key.*colour"),
    (["subsystems", 0, "namespaces", 0, "nsid"], 0, r"subsystems\[0\]\.namespaces\[0\]\.nsid"),
    (["subsystems", 0, "namespaces", 0, "enable"], "perhaps", r"namespaces\[0\]\.enable"),
    (["subsystems", 0, "namespaces", 0, "device", "uuid"], "xyz", r"device\.uuid"),
    (["subsystems", 0, "attr", "allow_any_host"], "yes please", r"allow_any_host"),
    (["subsystems", 1, "allowed_hosts", 0], "nqn.unknown:h", r"allowed_hosts\[0\].*not declared"),
    (["subsystems", 1, "nqn"], "nqn.2026-11.io.awide:a", r"subsystems\[1\]\.nqn.*duplicate"),
    (["subsystems", 0, "nqn"], "x" * 224, r"at most 223"),
    (["subsystems", 0, "nqn"], "a/b", r"contains '/'"),
    (["hosts", 0], {"name": "h"}, r"hosts\[0\].*unknown key"),
    (["hosts"], {}, r"hosts.*expected a list"),
    (["adp"], {"lba_size": 1024}, r"adp\.lba_size.*512 or 4096"),
    (["adp"], {"capacity_bytes": 1000}, r"adp\.capacity_bytes"),
    (["adp"], {"mdts_bytes": 3000}, r"adp\.mdts_bytes"),
    (["adp"], {"queue_depth": 1}, r"adp\.queue_depth"),
    (["adp"], {"max_io_queues": 0}, r"adp\.max_io_queues"),
    (["adp"], {"backing": "disk"}, r"adp\.backing"),
    (["adp"], {"keep_alive_ms_default": -1}, r"adp\.keep_alive_ms_default"),
    (["adp"], {"capacity": 5}, r"adp.*unknown key.*capacity"),
    (["adp"], {"capacity_bytes": "1G"}, r"adp\.capacity_bytes.*integer"),
    (["extra"], 1, r"top level.*unknown key.*extra"),
])
def test_bad_input_names_the_key(path: list[Any], value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NvmetConfig.from_json(_mutate(path, value))


def test_dataclass_validation() -> None:
    cfg = NvmetConfig(ports=[Port(1, subsystems=["nqn.x:a"])], subsystems=[Subsystem("nqn.x:a")])
    cfg.validate()
    cfg.subsystems[0].namespaces = [Namespace(1, "/a"), Namespace(1, "/b")]
    with pytest.raises(ValueError, match=r"namespaces\[1\]\.nsid.*duplicate nsid 1"):
        cfg.validate()
    cfg.subsystems[0].namespaces = []
    cfg.ports.append(Port(1))
    with pytest.raises(ValueError, match=r"ports\[1\]\.portid.*duplicate"):
        cfg.validate()
