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
import re
from dataclasses import dataclass
from pathlib import Path

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # filesystems whose files live in RAM
UNBOUNDED = 1 << 62  # the room where no bound is known


@dataclass(frozen=True)
class BackingRoom:
    """What a backing store can still take: ``room`` more bytes, besides the ``held`` bytes its file already has."""

    where: str  # the file's directory, or "RAM" for a memfd
    fstype: str  # the directory's filesystem type ("memfd" for RAM)
    in_ram: bool  # its bytes live in RAM (memfd, tmpfs, ramfs): bounded by MemAvailable too
    room: int
    held: int

    def writable(self, reserve: int = 0) -> int:
        """Bytes that can still be written, leaving ``reserve`` bytes of RAM to other processes where the bytes live
        in RAM."""
        return self.room - (reserve if self.in_ram else 0)

    def shortfall(self, capacity: int, reserve: int = 0) -> str | None:
        """Why a namespace of ``capacity`` bytes cannot be written in full here (what its file does not hold yet
        must be :meth:`writable`), or None if it can."""
        if max(0, capacity - self.held) <= self.writable(reserve):
            return None
        kind = ("MemAvailable" if self.fstype == "memfd" else "in RAM: free space and MemAvailable" if self.in_ram
                else "free space")
        keep = f" (less {_gib(reserve)} of RAM left to the other processes)" if reserve and self.in_ram else ""
        harm = "stalls the host" if self.in_ram else "kills the target (SIGBUS)"
        return (f"a {_gib(capacity)} namespace does not fit in {self.where} ({self.fstype}, {kind}): "
                f"{_gib(self.room)} more can be written there{keep}, and writing past that {harm}")


class NoRoom(ValueError):
    """A namespace larger than its backing can hold (:meth:`BackingRoom.shortfall`)."""


def ram_available() -> int | None:
    """Bytes of RAM this process can still fill without swapping: MemAvailable from /proc/meminfo, lowered to what
    its cgroup allows (memory.max less memory.current, cgroup v2) where one limits it; None where neither is
    readable (no bound is known)."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is not None:
            base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    left = max(0, int(limit) - int(f.read()))
                avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape_mount_path(text: str) -> str:
    """A mount point as /proc/self/mountinfo writes it, with its octal escapes (space, tab, newline, backslash)
    undone."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def filesystem_type(directory: str | Path) -> str:
    """The type of the filesystem mounted at ``directory`` or above it (from /proc/self/mountinfo; "unknown" where
    that cannot be read)."""
    target = os.path.realpath(directory)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return fstype
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, kinds = head.split(), tail.split()
        if len(fields) < 5 or not kinds:
            continue
        mount = unescape_mount_path(fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, kinds[0]
    return fstype


def backing_room(path: str | None) -> BackingRoom:
    """The room left for a namespace backed by the file at ``path`` (None: a memfd in RAM); a file that is a link
    is measured where it leads."""
    if path is None:
        avail = ram_available()
        return BackingRoom("RAM", "memfd", True, UNBOUNDED if avail is None else avail, 0)
    real = os.path.realpath(path)
    directory = os.path.dirname(real)
    st = os.statvfs(directory)
    fstype = filesystem_type(directory)
    in_ram = fstype in RAM_FILESYSTEMS
    # ramfs, and tmpfs mounted with size=0, have no size of their own: only RAM bounds them
    room = UNBOUNDED if in_ram and st.f_blocks == 0 else st.f_bavail * st.f_frsize
    try:
        held = os.stat(real).st_blocks * 512
    except FileNotFoundError:
        held = 0
    if in_ram:
        avail = ram_available()
        if avail is not None:
            room = min(room, avail)
    return BackingRoom(directory, fstype, in_ram, room, held)


def shortfall(capacity: int, path: str | None, reserve: int = 0) -> str | None:
    """Why a namespace of ``capacity`` bytes at ``path`` (None: RAM) cannot be written in full while leaving
    ``reserve`` bytes of RAM to other processes (counted only where the bytes live in RAM), or None if it can."""
    return backing_room(path).shortfall(capacity, reserve)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
