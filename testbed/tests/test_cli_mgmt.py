"""`testbed up` records the management API's URL and token file; `status` shows them; `down` cleans up."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from adp_testbed import state as S
from adp_testbed.cli import main


def _http(url: str, method: str = "GET", token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_up_status_down_with_mgmt_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = str(tmp_path / "state")
    assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "16M"]) == 0
    try:
        out = capsys.readouterr().out
        assert "management API: http://127.0.0.1:" in out
        assert main(["--state-dir", sd, "status", "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        url = st["mgmt_url"]
        assert st["running"] and url.startswith("http://127.0.0.1:")
        token_file = Path(st["extra"]["mgmt_token_file"])
        assert token_file.parent == Path(sd) and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert main(["--state-dir", sd, "status"]) == 0
        assert f"mgmt     {url}" in capsys.readouterr().out

        code, ident = _http(url + "/api/v1/identity")
        assert code == 200 and ident["trsvcid"] == st["trsvcid"] and ident["capacity_bytes"] == 16 << 20
        assert _http(url + "/api/v1/faults/delay", "POST", None, {"seconds": 0})[0] == 401
        code, faults = _http(url + "/api/v1/faults/delay", "POST", token_file.read_text().strip(), {"seconds": 0.01})
        assert code == 200 and faults["delay_s"] == 0.01
    finally:
        assert main(["--state-dir", sd, "down"]) == 0
    assert not token_file.exists() and S.load(Path(sd)) is None
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/api/v1/health", timeout=2)
