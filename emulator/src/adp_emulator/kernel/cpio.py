"""A minimal writer for the ``newc`` cpio format the Linux initramfs loader reads.

Format facts from the kernel's Documentation/driver-api/early-userspace/buffer-format.rst: a 110-byte
ASCII header (magic ``070701`` then 13 eight-digit hex fields), the NUL-terminated name, padding to a
multiple of 4, the data, padding to 4; the archive ends with an entry named ``TRAILER!!!``.  Several
(gzip-compressed) archives may be concatenated; later entries override earlier ones.
"""

from __future__ import annotations

import gzip
import io
import stat


class CpioWriter:
    """Accumulate entries, then :meth:`finish` to get the archive bytes."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._ino = 1
        self._dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1) -> None:
        name_b = name.encode() + b"\0"
        fields = [self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name_b), 0]
        self._ino += 1
        hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
        self._buf.write(hdr + name_b)
        self._buf.write(b"\0" * (-(len(hdr) + len(name_b)) % 4))
        self._buf.write(data)
        self._buf.write(b"\0" * (-len(data) % 4))

    def add_dir(self, name: str, mode: int = 0o755) -> None:
        """Add a directory (and its missing parents)."""
        name = name.strip("/")
        parts = name.split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in self._dirs:
                self._dirs.add(d)
                self._entry(d, stat.S_IFDIR | mode, nlink=2)

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Add a regular file (parents are created)."""
        name = name.strip("/")
        if "/" in name:
            self.add_dir(name.rsplit("/", 1)[0])
        self._entry(name, stat.S_IFREG | mode, data)

    def add_symlink(self, name: str, target: str) -> None:
        """Add a symbolic link ``name`` -> ``target``."""
        name = name.strip("/")
        if "/" in name:
            self.add_dir(name.rsplit("/", 1)[0])
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def finish(self) -> bytes:
        """Terminate the archive and return its bytes."""
        self._entry("TRAILER!!!", 0)
        data = self._buf.getvalue()
        return data + b"\0" * (-len(data) % 512)


def gzip_cpio(writer: CpioWriter, level: int = 6) -> bytes:
    """The finished archive, gzip-compressed (mtime 0 for reproducible output)."""
    return gzip.compress(writer.finish(), compresslevel=level, mtime=0)
