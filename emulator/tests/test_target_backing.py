"""A namespace its backing cannot hold in full is refused at start (target/backing.py), unless overcommitted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import open_admin, open_io

from adp_emulator.config import AdpSettings
from adp_emulator.target import TargetSettings, UserspaceTarget
from adp_emulator.target import backing as B
from adp_emulator.target.server import BackingError
from adp_wire.constants import IoOpcode
from adp_wire.sqe import rw_cmd

TiB = 1 << 40


def _beyond(room: int) -> int:
    """A capacity one TiB past ``room``, a multiple of 4 KiB."""
    return (room + TiB) // 4096 * 4096


def test_a_file_namespace_its_filesystem_cannot_hold_is_refused_and_nothing_is_created(tmp_path) -> None:
    img = tmp_path / "card.img"
    cap = _beyond(B.backing_room(str(img)).room)
    with pytest.raises(BackingError, match=r"does not fit in .*free space.*--overcommit"):
        UserspaceTarget(TargetSettings(port=0, capacity_bytes=cap, backing_path=str(img))).start()
    assert not img.exists()
    # control: the same namespace, overcommitted, is served (sparse: writing near its end allocates one block)
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=cap, backing_path=str(img),
                                        backing_overcommit=True)) as t:
        q = open_admin(t.address)
        io = open_io(t.address, q.cntlid)
        slba = cap // 4096 - 1
        assert io.cmd(rw_cmd(IoOpcode.WRITE, 1, slba, 1, 4096), b"\x5a" * 4096)[0].status.ok
        assert io.cmd(rw_cmd(IoOpcode.READ, 1, slba, 1, 4096))[1] == b"\x5a" * 4096
        io.close()
        q.close()
    assert img.stat().st_size == cap and img.stat().st_blocks * 512 < 1 << 30


def test_a_ram_namespace_is_bounded_by_the_memory_available() -> None:
    cap = _beyond(B.ram_available())
    with pytest.raises(BackingError, match=r"RAM \(memfd, MemAvailable\)"):
        UserspaceTarget(TargetSettings(port=0, capacity_bytes=cap)).start()
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=1 << 20)):  # control: one that fits
        pass


def test_a_file_in_ram_is_bounded_by_the_memory_available_too(tmp_path, monkeypatch) -> None:
    shm = "/dev/shm"
    if not os.path.isdir(shm) or B.filesystem_type(shm) not in B.RAM_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm")
    if B.filesystem_type(tmp_path) in B.RAM_FILESYSTEMS:
        pytest.skip("the test's directory is in RAM too: no disk to compare with")
    if os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize < 1 << 30:
        pytest.skip("under 1 GiB free in /dev/shm")
    monkeypatch.setattr(B, "ram_available", lambda: 1 << 30)  # as if 1 GiB of RAM were left
    why = B.shortfall(2 << 30, os.path.join(shm, "card.img"))
    assert why is not None and "tmpfs, in RAM" in why and "stalls the host" in why
    assert B.shortfall(512 << 20, os.path.join(shm, "card.img")) is None
    # control: on a disk the same 2 GiB is bounded by free space alone
    assert B.shortfall(2 << 30, str(tmp_path / "card.img")) is None
    # a reserve for the other processes counts only where the card lives in RAM
    assert B.shortfall(768 << 20, os.path.join(shm, "card.img"), reserve=512 << 20) is not None
    assert B.shortfall(768 << 20, str(tmp_path / "card.img"), reserve=512 << 20) is None


def test_bytes_a_file_already_holds_count_as_held(tmp_path, monkeypatch) -> None:
    if B.filesystem_type(tmp_path) in B.RAM_FILESYSTEMS:
        pytest.skip("the test's directory is in RAM: MemAvailable would bound it as well")
    full, sparse = tmp_path / "full.img", tmp_path / "sparse.img"
    full.write_bytes(b"\x01" * (8 << 20))
    with open(sparse, "wb") as f:
        f.truncate(8 << 20)
    assert B.backing_room(str(full)).held >= 8 << 20
    assert B.backing_room(str(sparse)).held < 1 << 20
    # as if the filesystem had 4 MiB free: a 12 MiB namespace over the written file needs 4 MiB more, and fits
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(B.os, "statvfs", lambda _p: type("V", (), {"f_bavail": (4 << 20) // real.f_frsize,
                                                                    "f_frsize": real.f_frsize})())
    assert B.shortfall(12 << 20, str(full)) is None
    assert B.shortfall(12 << 20, str(sparse)) is not None  # control: over the sparse file it needs 12 MiB


def test_the_cli_names_the_option_in_one_line() -> None:
    cap = _beyond(B.ram_available()) >> 30
    p = subprocess.run([sys.executable, "-m", "adp_emulator", "serve", "--port", "0", "--capacity", f"{cap}G"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adp-emulator: --capacity: ") and "--overcommit" in lines[0]


def test_overcommit_in_a_config_and_its_validation() -> None:
    AdpSettings(overcommit=True).validate()
    with pytest.raises(ValueError, match=r"adp\.overcommit"):
        AdpSettings(overcommit="yes").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backing_overcommit"):
        TargetSettings(backing_overcommit=1)  # type: ignore[arg-type]


def test_a_link_is_measured_where_it_leads_and_mount_paths_are_unescaped(tmp_path) -> None:
    assert B.unescape_mount_path(r"/mnt/a\040b\011c\134d") == "/mnt/a b\tc\\d"
    shm = "/dev/shm"
    if not os.path.isdir(shm) or B.filesystem_type(shm) not in B.RAM_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm")
    if B.filesystem_type(tmp_path) in B.RAM_FILESYSTEMS:
        pytest.skip("the test's directory is in RAM too")
    link = tmp_path / "card.img"
    link.symlink_to(os.path.join(shm, f"adp-test-{os.getpid()}.img"))
    assert B.backing_room(str(link)).in_ram and B.backing_room(str(link)).where == shm
    assert not B.backing_room(str(tmp_path / "plain.img")).in_ram  # control: a file of the disk itself
