"""How many bytes a namespace's backing store can still take, and whether a namespace of a given size fits.

A namespace is mapped sparse: its file (or memfd) is extended to the capacity without allocating it. One larger
than its backing can hold fails late and badly. A write into a full filesystem raises SIGBUS through the mapping
(the target dies). A file on tmpfs, or a memfd, grows in RAM, and on a host without swap a tmpfs that outgrows RAM
stalls every process on it: GPU run 21's sweep put a 512 GiB card in /dev/shm on a 125 GiB host, and the engine
stopped for minutes once ~112 GiB were written (keep-alives missed, associations dropped by the target). So the
target refuses such a namespace at start, unless told to overcommit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # filesystems whose files live in RAM


@dataclass(frozen=True)
class BackingRoom:
    """What a backing store can still take: ``room`` more bytes, besides the ``held`` bytes its file already has."""

    where: str  # the file's directory, or "RAM" for a memfd
    fstype: str  # the directory's filesystem type ("memfd" for RAM)
    in_ram: bool  # its bytes live in RAM (memfd, tmpfs, ramfs): bounded by MemAvailable too
    room: int
    held: int


def ram_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (what can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable missing from /proc/meminfo")


def filesystem_type(directory: str | Path) -> str:
    """The type of the filesystem mounted at ``directory`` or above it (from /proc/self/mountinfo)."""
    target = os.path.realpath(directory)
    best, fstype = "", "unknown"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            mount = head.split()[4].replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fstype = mount, tail.split()[0]
    return fstype


def backing_room(path: str | None) -> BackingRoom:
    """The room left for a namespace backed by the file at ``path`` (None: a memfd in RAM)."""
    if path is None:
        return BackingRoom("RAM", "memfd", True, ram_available(), 0)
    directory = os.path.dirname(os.path.abspath(path))
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize
    try:
        held = os.stat(path).st_blocks * 512
    except FileNotFoundError:
        held = 0
    fstype = filesystem_type(directory)
    in_ram = fstype in RAM_FILESYSTEMS
    if in_ram:
        room = min(room, ram_available())
    return BackingRoom(directory, fstype, in_ram, room, held)


def shortfall(capacity: int, path: str | None, reserve: int = 0) -> str | None:
    """Why a namespace of ``capacity`` bytes at ``path`` (None: RAM) cannot be written in full while leaving
    ``reserve`` bytes of RAM to other processes (counted only where the bytes live in RAM), or None if it can."""
    r = backing_room(path)
    need = max(0, capacity - r.held) + (reserve if r.in_ram else 0)
    if need <= r.room:
        return None
    kind = "MemAvailable" if path is None else "in RAM: free space and MemAvailable" if r.in_ram else "free space"
    keep = f" (less {_gib(reserve)} of RAM left to the other processes)" if reserve and r.in_ram else ""
    harm = "stalls the host" if r.in_ram else "kills the target (SIGBUS)"
    return (f"a {_gib(capacity)} namespace does not fit in {r.where} ({r.fstype}, {kind}): {_gib(r.room)} more can "
            f"be written there{keep}, and writing past that {harm}")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
