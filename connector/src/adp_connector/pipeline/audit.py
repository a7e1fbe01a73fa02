"""Acceptance audit: the digest of every saved and restored page, and the counters' totals, as files.

``pages-<pid>.jsonl`` (one JSON object per page: op, group, key, sha256, bytes) and ``stats-<role>-<pid>.json``
in ``path``; ``testbed verify`` and the engine tests compare them. :func:`write_totals` alone keeps the totals (the
connector's ``stats_path``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import torch


class PageAudit:
    """Appends page digests under ``path`` (thread-safe)."""

    def __init__(self, path: str, role: str) -> None:
        self.path = path
        self.role = role
        self._lock = threading.Lock()

    def record(self, op: str, gid: int, keys: list[bytes], pages: torch.Tensor) -> None:
        """One line per page of ``pages`` (``[n, page_bytes]`` host int8) under ``keys``."""
        lines = []
        for i, k in enumerate(keys):
            digest = hashlib.sha256(pages[i].contiguous().numpy().tobytes()).hexdigest()
            lines.append(json.dumps({"op": op, "group": gid, "key": k.hex(), "sha256": digest,
                                     "bytes": int(pages.shape[1])}))
        with self._lock:
            os.makedirs(self.path, exist_ok=True)
            with open(os.path.join(self.path, f"pages-{os.getpid()}.jsonl"), "a") as f:
                f.write("\n".join(lines) + "\n")

    def write_totals(self, totals: dict[str, float]) -> None:
        write_totals(self.path, self.role, totals)


def write_totals(path: str, role: str, totals: dict[str, float]) -> None:
    """The counters' running totals as ``stats-<role>-<pid>.json`` under ``path``, replaced whole: a reader never
    sees a half-written file (an engine stopped mid-write left an empty one)."""
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, f"stats-{role}-{os.getpid()}.json")
    with open(name + ".tmp", "w") as f:
        json.dump(totals, f)
    os.replace(name + ".tmp", name)
