"""Where ADP KV keeps things on this machine; every package resolves these directories here.

* state: ``$ADP_KV_STATE_DIR``, else ``~/.local/state/adp-kv`` (the running target's record, its log,
  management tokens);
* cache: ``$ADP_KV_CACHE``, else ``~/.cache/adp-kv`` (guest images, generated models).
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_ENV = "ADP_KV_STATE_DIR"
CACHE_ENV = "ADP_KV_CACHE"


def state_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The state directory (``override`` first, then ``$ADP_KV_STATE_DIR``, then the default); not created."""
    return Path(override or os.environ.get(STATE_ENV) or Path.home() / ".local" / "state" / "adp-kv").expanduser()


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory (``override`` first, then ``$ADP_KV_CACHE``, then the default); not created."""
    return Path(override or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "adp-kv").expanduser()
