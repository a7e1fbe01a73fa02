"""Where a profiled engine spends its samples: py-spy raw output (``bench ... --profile``) -> samples per process kind
and, in the engine-core process (its engine thread and the connector's own threads), per connector entry point (the
outermost ``adp_connector`` frame).

    python3 scripts/gpu/pyspy_connector_frames.py docs/results/gpu-2026-12-01-run9/agents/logs/pyspy-adp-engine.txt.gz

py-spy records active samples only (no ``--idle``), so every count is time on a CPU, at the bench's 25 Hz; with
``--profile-gil`` only the thread holding the interpreter lock is sampled, so the engine core's phases below are the
time its lock was held, by whom; with ``--profile-idle`` waiting threads are sampled too, so every count is wall
time (a hook's samples then include its waits, on the leaf frame it waits in).
"""

from __future__ import annotations

import collections
import gzip
import re
import sys

_PROCESS = re.compile(r'process \d+:"([^"]*)')  # py-spy's process header (a command may hold ";")


def kind(stack: str) -> str:
    """The process a stack belongs to (its innermost ``process`` header): the engine core, a page-store helper (the
    connector's I/O and lookup helpers), or the rest (the API server)."""
    heads = _PROCESS.findall(stack)
    head = heads[-1] if heads else ""
    if "adp_connector.store.process" in head:
        return "store helper"
    if "multiprocessing-fork" in head:
        return "engine-core"
    return "other"


def phase(stack: str) -> str:
    """Where an engine-core sample falls: start-up, vLLM's busy loop (its own code, or inside the connector's calls),
    the connector's threads (restore driver, store proxy reader, save submitter), or vLLM's other threads."""
    frames = [fr for fr in stack.split(";") if re.match(r"\S+ \(", fr)]  # frames, not process headers
    text = ";".join(frames)
    if "run_busy_loop (" in text:
        return "busy loop: inside the connector's calls" if "adp_connector/" in text else "busy loop: vLLM"
    if "EngineCoreProc.__init__ (" in text or "run_module (" in text:
        return "start-up (imports, compile, graph capture)"
    if "adp_connector/" in text:
        return "connector threads"
    return "other threads"


def summarize(path: str) -> tuple[collections.Counter[str], collections.Counter[str], collections.Counter[str]]:
    procs: collections.Counter[str] = collections.Counter()
    entries: collections.Counter[str] = collections.Counter()
    phases: collections.Counter[str] = collections.Counter()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            n = int(count)
            k = kind(stack)
            procs[k] += n
            if k != "engine-core":
                continue
            phases[phase(stack)] += n
            first = next((fr for fr in stack.split(";") if "adp_connector/" in fr), None)
            if first is not None:
                entries[re.sub(r":\d+\)$", ")", first)] += n
    return procs, entries, phases


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: pyspy_connector_frames.py PYSPY_RAW[.gz]", file=sys.stderr)
        return 2
    procs, entries, phases = summarize(argv[0])
    for k, n in procs.most_common():
        print(f"{n:7d}  {k}")
    print(f"{sum(phases.values()):7d}  engine-core samples by phase:")
    for ph, n in phases.most_common():
        print(f"{n:7d}    {ph}")
    print(f"{sum(entries.values()):7d}  engine-core samples inside the connector, by entry point:")
    for fr, n in entries.most_common():
        print(f"{n:7d}    {fr}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
