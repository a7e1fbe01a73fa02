"""Structure-aware fuzzing of the userspace NVMe/TCP target over real loopback sockets.

* :mod:`.generator`: one fuzz input per connection, built from the codec and mutated (driven by :class:`Src`:
  hypothesis, :class:`random.Random` or atheris);
* :mod:`.harness`: runs an input against a live target and checks the invariants between batches;
* :mod:`.rawhost`: the raw-socket host the harness (and the target's tests) speak NVMe/TCP with.

Used by the emulator's fuzz tests and by ``scripts/fuzz-target`` (the long run).
"""

from __future__ import annotations

from .generator import FuzzInput, HypothesisSrc, ProviderSrc, RandomSrc, Src, Witness, gen_input
from .harness import (
    WITNESS_LBA,
    ErrorLog,
    FuzzHarness,
    Outcome,
    fuzz_settings,
    max_rss_bytes,
    rss_bytes,
    run_input,
)

__all__ = ["WITNESS_LBA", "ErrorLog", "FuzzHarness", "FuzzInput", "HypothesisSrc", "Outcome", "ProviderSrc",
           "RandomSrc", "Src", "Witness", "fuzz_settings", "gen_input", "max_rss_bytes", "rss_bytes", "run_input"]
