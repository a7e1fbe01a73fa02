"""Tests for the kernel nvmet backend (adp_emulator.kernel).

Unit tests run everywhere.  ``@pytest.mark.kernel`` tests boot the real Linux nvmet target in a
QEMU guest (TCG here, ~8 s per boot); they skip only when qemu is absent and CI is unset.
"""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from adp_emulator.config import NvmetConfig, default_config
from adp_emulator.kernel import configfs
from adp_emulator.kernel.cpio import CpioWriter, gzip_cpio
from adp_emulator.kernel.initiator import make_pattern, run_guest_initiator
from adp_emulator.kernel.probe import build_icreq, icreq_exchange, parse_icresp
from adp_emulator.kernel.target import KernelTarget, guest_config, guest_target_script
from adp_emulator.kernel.tools import KernelBackendError, MissingDependencyError, require_tools

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002"
SUB_OPEN = "nqn.2026-11.io.awide:open"
SUB_LOCKED = "nqn.2026-11.io.awide:locked"


def rich_config() -> NvmetConfig:
    """Two hosts, an open and a host-restricted subsystem, two ports, ANA group, referral."""
    return NvmetConfig.from_json({
        "hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}],
        "subsystems": [
            {"nqn": SUB_OPEN, "attr": {"allow_any_host": "1", "serial": "adpkv-test-0001", "model": "ADP test",
                                       "version": "1.3"},
             "namespaces": [
                 {"nsid": 1, "enable": 1, "ana_grpid": 1,
                  "device": {"path": "/run/adp/a.img", "uuid": "d592cdf3-5d1c-44e0-8412-3fcf7d99df27",
                             "nguid": "11111111-2222-3333-4444-555555555555"}},
                 {"nsid": 3, "enable": 0, "device": {"path": "/run/adp/b.img"}}]},
            {"nqn": SUB_LOCKED, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOST_A],
             "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": "/run/adp/c.img"}}]},
        ],
        "ports": [
            {"portid": 1, "addr": {"trtype": "tcp", "adrfam": "ipv4", "traddr": "127.0.0.1", "trsvcid": "4420",
                                   "treq": "not specified"},
             "param": {"inline_data_size": "16384"}, "subsystems": [SUB_OPEN, SUB_LOCKED],
             "ana_groups": [{"grpid": 1, "ana": {"state": "optimized"}}],
             "referrals": [{"name": "ref1", "enable": 1,
                            "addr": {"trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.0.9", "trsvcid": "8009",
                                     "treq": "not specified", "portid": "2"}}]},
            {"portid": 2, "addr": {"trtype": "tcp", "adrfam": "ipv4", "traddr": "127.0.0.1", "trsvcid": "4421",
                                   "treq": "not specified"},
             "subsystems": [SUB_LOCKED]},
        ],
    })


# ---------------------------------------------------------------------------------------------
# A fake configfs: mkdir creates the default attribute files and groups the kernel would create
# (attribute names from drivers/nvme/target/configfs.c, Linux 6.1).
DEFAULT = "\x00default"
_AUTO: dict[str, tuple[list[str], list[str]]] = {
    # object kind: (attribute files, default child groups)
    "subsystem": (["attr_allow_any_host", "attr_version", "attr_serial", "attr_model", "attr_cntlid_min",
                   "attr_cntlid_max", "attr_pi_enable", "attr_qid_max"], ["namespaces", "allowed_hosts"]),
    "namespace": (["device_path", "device_nguid", "device_uuid", "ana_grpid", "enable", "buffered_io",
                   "revalidate_size"], []),
    "port": (["addr_adrfam", "addr_traddr", "addr_treq", "addr_trsvcid", "addr_trtype", "addr_tsas",
              "param_inline_data_size", "param_max_queue_size", "param_pi_enable"],
             ["subsystems", "referrals", "ana_groups", "ana_groups/1"]),
    "referral": (["addr_adrfam", "addr_traddr", "addr_treq", "addr_trsvcid", "addr_trtype", "addr_portid",
                  "enable"], []),
    "host": ([], []),
}


def _kind(rel: tuple[str, ...]) -> str | None:
    if len(rel) == 2:
        return {"hosts": "host", "subsystems": "subsystem", "ports": "port"}.get(rel[0])
    if len(rel) == 4 and rel[0] == "subsystems" and rel[2] == "namespaces":
        return "namespace"
    if len(rel) == 4 and rel[0] == "ports" and rel[2] == "referrals":
        return "referral"
    return None


@pytest.fixture
def fake_configfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "nvmet"
    for d in ("hosts", "subsystems", "ports"):
        (root / d).mkdir(parents=True)
    real_mkdir = os.mkdir

    def mkdir(path: Any, mode: int = 0o777, *a: Any, **kw: Any) -> None:
        real_mkdir(path, mode, *a, **kw)
        try:
            rel = Path(path).resolve().relative_to(root.resolve()).parts
        except ValueError:
            return
        kind = _kind(rel)
        if kind is None:
            return
        files, groups = _AUTO[kind]
        for g in groups:
            real_mkdir(Path(path, g))
        if "ana_groups/1" in groups:
            Path(path, "ana_groups/1/ana_state").write_text(DEFAULT)
        for f in files:
            Path(path, f).write_text("0" if f == "enable" else DEFAULT)

    real_rmdir = os.rmdir

    def rmdir(path: Any, *a: Any, **kw: Any) -> None:
        # configfs rmdir drops an item's attribute files and default groups with it; a non-empty
        # child group or a symlink inside still makes it fail (ENOTEMPTY), as on the kernel.
        p = Path(path)
        kind = _kind(p.resolve().relative_to(root.resolve()).parts) if p.resolve().is_relative_to(root.resolve()) \
            else None
        if kind is not None:
            files, groups = _AUTO[kind]
            for g in reversed(groups):
                gp = p / g
                for f in gp.glob("*") if gp.is_dir() else []:
                    if f.is_file() and not f.is_symlink():
                        f.unlink()
                if gp.is_dir():
                    real_rmdir(gp)
            for f in files:
                (p / f).unlink(missing_ok=True)
        real_rmdir(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rmdir", rmdir)
    return root


def snapshot(root: Path, objects_only_dirs: bool = False) -> dict[str, Any]:
    """{relative path: ('dir',) | ('file', content) | ('link', target relative to root)}."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", Path(os.readlink(p)).relative_to(root).as_posix())
                if name in dirnames:
                    dirnames.remove(name)
            elif p.is_dir():
                if not objects_only_dirs or _kind(tuple(rel.split("/"))) or rel.startswith("ports/1/ana_groups/"):
                    out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_text())
    return out


# ---------------------------------------------------------------------------------------------
def test_icreq_bytes_match_reference() -> None:
    req = build_icreq()
    assert len(req) == 128
    assert req[:8] == bytes([0x00, 0x00, 0x80, 0x00, 0x80, 0x00, 0x00, 0x00])
    assert req[8:] == bytes(120)
    resp = bytes([0x01, 0, 0x80, 0, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x40, 0]) + bytes(112)
    assert parse_icresp(resp) == {"pfv": 0, "cpda": 0, "hdgst": 0, "ddgst": 0, "maxh2cdata": 4 << 20, "flags": 0,
                                  "pdo": 0}
    with pytest.raises(ValueError, match="not an ICResp"):
        parse_icresp(req)


def test_icreq_exchange_against_fake_server() -> None:
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        got.append(c.recv(128))
        c.sendall(bytes([1, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0]) + bytes(112))
        c.close()

    th = threading.Thread(target=serve)
    th.start()
    r = icreq_exchange("127.0.0.1", srv.getsockname()[1])
    th.join()
    srv.close()
    assert got == [build_icreq()] and r["maxh2cdata"] == 4096


def test_cpio_newc_is_readable_by_cpio(tmp_path: Path) -> None:
    w = CpioWriter()
    w.add_file("adp/run.sh", b"echo hi\n", 0o755)
    w.add_symlink("bin/sh", "busybox")
    data = gzip.decompress(gzip_cpio(w))
    assert data.startswith(b"070701") and b"TRAILER!!!" in data
    try:
        tools = require_tools("cpio")
    except MissingDependencyError:
        pytest.skip("cpio not installed (only needed for this cross-check)")
    subprocess.run([tools["cpio"], "-idm", "--quiet"], input=data, cwd=tmp_path, check=True)
    assert (tmp_path / "adp/run.sh").read_bytes() == b"echo hi\n"
    assert os.access(tmp_path / "adp/run.sh", os.X_OK)
    assert os.readlink(tmp_path / "bin/sh") == "busybox"


def test_missing_tool_error_names_apt_command() -> None:
    with pytest.raises(MissingDependencyError, match=r"apt-get install -y --no-install-recommends"):
        require_tools("definitely-not-a-tool-adp")
    with pytest.raises(MissingDependencyError, match="qemu-system-x86"):
        import shutil as sh
        orig = sh.which
        try:
            sh.which = lambda _t: None  # type: ignore[assignment]
            require_tools("qemu-system-x86_64")
        finally:
            sh.which = orig  # type: ignore[assignment]


def test_writer_matches_nvmetcli_restore(tmp_path: Path, fake_configfs: Path) -> None:
    """Our writer and nvmetcli 0.9's Root.restore produce the same tree on a fake configfs."""
    from adp_emulator.kernel.nvmetcli import fetch_nvmetcli, import_nvmet

    try:
        nvme = import_nvmet(fetch_nvmetcli())
    except (KernelBackendError, MissingDependencyError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot fetch nvmetcli from Debian sid: {e}")
    cfg = rich_config()
    ours = tmp_path / "ours"
    ours_root = fake_configfs.parent / "ours-nvmet"
    # nvmetcli into the fixture's root
    orig_dir = nvme.CFSNode.configfs_dir
    nvme.CFSNode.configfs_dir = str(fake_configfs)
    try:
        errors = nvme.Root().restore(cfg.nvmetcli_json(), clear_existing=False, abort_on_error=True)
    finally:
        nvme.CFSNode.configfs_dir = orig_dir
    assert errors == []
    theirs = snapshot(fake_configfs)
    # ours into a second fake root (same mkdir emulation: rename trick keeps the fixture's root)
    fake_configfs.rename(ours)
    for d in ("hosts", "subsystems", "ports"):
        (fake_configfs / d).mkdir(parents=True)
    configfs.apply(configfs.plan(cfg), fake_configfs)
    mine = snapshot(fake_configfs)
    assert mine == theirs
    assert theirs["subsystems/" + SUB_LOCKED + "/allowed_hosts/" + HOST_A] == ("link", f"hosts/{HOST_A}")
    assert theirs[f"ports/1/subsystems/{SUB_OPEN}"] == ("link", f"subsystems/{SUB_OPEN}")
    assert theirs[f"subsystems/{SUB_OPEN}/namespaces/1/enable"] == ("file", "1")
    assert theirs["ports/1/referrals/ref1/addr_traddr"] == ("file", "10.0.0.9")
    del ours_root


def test_shell_writer_matches_python_writer(tmp_path: Path) -> None:
    """The busybox-sh form of the plan builds the same tree as the Python form (plain directories)."""
    cfg = rich_config()
    ops = configfs.plan(cfg, buffered_io=True)
    py_root, sh_root = tmp_path / "py", tmp_path / "sh"
    py_root.mkdir()
    sh_root.mkdir()
    configfs.apply(ops, py_root)
    script = configfs.to_shell(ops, str(sh_root)) + "adp_configfs\n"
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot(sh_root) == snapshot(py_root)
    ns = f"subsystems/{SUB_OPEN}/namespaces/1"
    written = [op.path for op in ops if op.path.startswith(ns + "/")]
    assert written.index(f"{ns}/buffered_io") < written.index(f"{ns}/enable")


def test_undo_removes_exactly_our_objects(fake_configfs: Path) -> None:
    (fake_configfs / "hosts" / "someone-else").mkdir()
    cfg = rich_config()
    configfs.apply(configfs.plan(cfg), fake_configfs)
    errors = configfs.remove(configfs.undo_plan(cfg), fake_configfs)
    assert errors == []
    left = snapshot(fake_configfs)
    assert left == {"hosts": ("dir",), "subsystems": ("dir",), "ports": ("dir",), "hosts/someone-else": ("dir",)}


def test_guest_config_and_script() -> None:
    cfg = rich_config()
    g = guest_config(cfg)
    assert all(p.traddr == "0.0.0.0" for p in g.ports)
    assert [ns.path for s in g.subsystems for ns in s.namespaces] == [
        "/run/adp/s0-ns1.img", "/run/adp/s0-ns3.img", "/run/adp/s1-ns1.img"]
    assert cfg.ports[0].traddr == "127.0.0.1"  # original untouched
    script = guest_target_script(g, 64 << 20)
    assert "truncate -s 67108864 /run/adp/s0-ns1.img" in script and "adp_configfs" in script


def test_initiator_argument_validation() -> None:
    with pytest.raises(ValueError, match="multiples of 512"):
        run_guest_initiator(4420, "nqn.x:y", nbytes=1000)
    with pytest.raises(ValueError, match="subnqn"):
        run_guest_initiator(4420, "nqn.x:y z")
    p = make_pattern(8192, seed=3)
    assert p == make_pattern(8192, seed=3) != make_pattern(8192, seed=4)
    assert p[512:].startswith(b"ADPKV seed=3 block=1\n")


# ---------------------------------------------------------------------------------------------
# Real kernel target in a QEMU guest.

@pytest.mark.kernel
def test_vm_target_answers_icreq(guest_image: Any, workdir: Path) -> None:
    t = KernelTarget(default_config(), workdir, host_port=0, image=guest_image)
    try:
        info = t.start(timeout=30)
        assert info["hosted"] == "vm" and info["traddr"] == "127.0.0.1"
        assert info["subnqn"] == default_config().subsystems[0].nqn
        assert info["icresp"] == {"pfv": 0, "cpda": 0, "hdgst": 0, "ddgst": 0, "maxh2cdata": 4 << 20, "flags": 0,
                                  "pdo": 0}
        assert t.is_running()
        # a second, independent exchange on the forwarded port
        assert icreq_exchange("127.0.0.1", int(info["trsvcid"]))["pfv"] == 0
        # another process can stop it from the state file
        other = KernelTarget.from_workdir(workdir)
        assert other.is_running()
        other.stop()
        assert not other.is_running()
    finally:
        t.stop()
    assert not t.is_running()


@pytest.mark.kernel
def test_vm_kernel_initiator_round_trip_through_host(guest_image: Any, workdir: Path) -> None:
    """Guest initiator -> host 127.0.0.1 -> (hostfwd) -> guest nvmet: write, read back; then a second
    guest reads the same bytes over a fresh connection (the bytes landed in the target's backing)."""
    cfg = rich_config()
    t = KernelTarget(cfg, workdir / "target", host_port=0, image=guest_image, guest_capacity_bytes=64 << 20)
    try:
        info = t.start(timeout=30)
        port = int(info["trsvcid"])
        r = run_guest_initiator(port, SUB_LOCKED, hostnqn=HOST_A, nbytes=256 << 10, offset=1 << 20, seed=7,
                                timeout=60, image=guest_image)
        assert r.ok, r.console[-3000:]
        assert "connected size=67108864 lbs=4096" in r.markers
        r2 = run_guest_initiator(port, SUB_LOCKED, hostnqn=HOST_A, nbytes=256 << 10, offset=1 << 20, seed=7,
                                 write=False, timeout=60, image=guest_image)
        assert r2.ok, r2.console[-3000:]
        assert r2.readback_sha256 == r.readback_sha256
        # a host not in allowed_hosts is refused by nvmet
        r3 = run_guest_initiator(port, SUB_LOCKED, hostnqn=HOST_B, nbytes=4096, timeout=60, image=guest_image)
        assert not r3.ok and r3.failure == "connect", r3.markers
    finally:
        t.stop()


@pytest.mark.kernel
def test_guest_initiator_reports_refused_connection(guest_image: Any) -> None:
    """With nothing listening on the host port the guest boots, tries, and reports a failure."""
    from adp_emulator.kernel.vm import free_port

    r = run_guest_initiator(free_port(), "nqn.2026-11.io.awide:nobody", nbytes=4096, timeout=60, image=guest_image)
    assert not r.ok
    assert any(m.startswith("connecting 10.0.2.2:") for m in r.markers), r.console[-2000:]
    assert r.failure == "connect"


def test_host_mode_applies_and_undoes(fake_configfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-nvmet path (cannot run for real here): writer on a fake configfs, exact undo on stop()."""
    import adp_emulator.kernel.target as target_mod

    monkeypatch.setattr(configfs, "NVMET_ROOT", str(fake_configfs))
    monkeypatch.setattr(target_mod, "host_nvmet_status", lambda: (True, "test"))
    monkeypatch.setattr(target_mod.shutil, "which", lambda _name: None)
    monkeypatch.setattr(target_mod, "wait_icresp", lambda host, port, timeout: {"pfv": 0, "port": port})
    (fake_configfs / "hosts" / HOST_B).mkdir()  # pre-existing: must survive stop()
    cfg = default_config()
    cfg.adp.capacity_bytes = 1 << 20
    t = KernelTarget(cfg, tmp_path / "wd", mode="host")
    info = t.start()
    assert info["hosted"] == "host" and info["tool"] == "writer" and info["trsvcid"] == "4420"
    ns = fake_configfs / "subsystems" / cfg.subsystems[0].nqn / "namespaces" / "1"
    backing = Path((ns / "device_path").read_text())
    assert backing.stat().st_size == 1 << 20 and (ns / "enable").read_text() == "1"
    assert t.is_running()
    KernelTarget.from_workdir(tmp_path / "wd").stop()
    assert not backing.exists()
    assert snapshot(fake_configfs) == {"hosts": ("dir",), "subsystems": ("dir",), "ports": ("dir",),
                                       f"hosts/{HOST_B}": ("dir",)}


@pytest.mark.kernel
def test_kernel_initiator_against_userspace_target(guest_image: Any, tmp_path: Path) -> None:
    """Issue item 3: Linux nvme-tcp in a guest -> our userspace target on the host; the bytes the
    guest wrote through /dev/nvme0n1 must be in the target's backing file at the same offset."""
    from adp_emulator.target import UserspaceTarget, settings_from_config

    backing = tmp_path / "ns1.img"
    cfg = default_config(backing_path=str(backing))
    cfg.adp.capacity_bytes = 64 << 20
    with UserspaceTarget(settings_from_config(cfg, port=0)) as t:
        _host, port = t.address
        r = run_guest_initiator(port, cfg.subsystems[0].nqn, nbytes=1 << 20, offset=3 << 20, seed=11, timeout=90,
                                image=guest_image)
        assert r.ok, r.console[-3000:]
        assert "connected size=67108864 lbs=4096" in r.markers
    with open(backing, "rb") as f:
        f.seek(r.offset)
        assert f.read(len(r.pattern)) == r.pattern
