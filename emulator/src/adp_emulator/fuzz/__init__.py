"""Structure-aware fuzzing of the userspace NVMe/TCP target over real loopback sockets.

* :mod:`.generator`: one fuzz input per connection, built from the codec and mutated (driven by :class:`Src`:
  hypothesis, :class:`random.Random` or atheris);
* :mod:`.harness`: runs an input against a live target and checks the invariants between batches;
* :mod:`.rawhost`: the raw-socket host the harness (and the target's tests) speak NVMe/TCP with;
* :mod:`.run`: the long run (``scripts/fuzz-target``).

The names below load their module on first use, so importing this package (or :mod:`.run`) imports neither the
target nor the codec: atheris must instrument those before they are imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FuzzInput": "generator", "HypothesisSrc": "generator", "ProviderSrc": "generator", "RandomSrc": "generator",
    "Src": "generator", "Witness": "generator", "gen_input": "generator",
    "WITNESS_LBA": "harness", "ErrorLog": "harness", "FuzzHarness": "harness", "Outcome": "harness",
    "fuzz_settings": "harness", "max_rss_bytes": "harness", "rss_bytes": "harness", "run_input": "harness",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{where}", __name__), name)
