"""Seeded synthetic traffic and a streaming ``/v1/completions`` client that measures TTFT.

Prompts are token-id lists drawn from ``random.Random(seed)``: reproducible, no downloads, no tokenizer. Requests
are greedy (``temperature 0``, ``ignore_eos``) so both arms generate the same number of tokens, and ask for
``return_token_ids`` so outputs can be compared token for token.
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

LOW_ID, HIGH_ID = 3, 30000  # token ids drawn from [LOW_ID, HIGH_ID) (clear of bos/eos/pad of the tiny models)

T = TypeVar("T")


def tokens(seed: int | str, n: int) -> list[int]:
    """``n`` reproducible pseudo-random token ids for ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]


def independent_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts sharing no prefix (the first token of each differs, so no cache block is shared)."""
    out: list[list[int]] = []
    for i in range(n):
        p = tokens(f"prompt-{seed}-{i}", length)
        p[0] = LOW_ID + i % (HIGH_ID - LOW_ID)
        out.append(p)
    return out


@dataclass
class Result:
    """One request: times in seconds from its start; ``token_ids`` are the generated ids."""

    prompt_tokens: int
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    started_s: float = 0.0
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the whole request (prefill included): what a caller experiences."""
        return self.output_tokens / self.latency_s if self.ok and self.latency_s else 0.0

    def to_json(self, with_ids: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_ids:
            d.pop("token_ids")
        for k in ("ttft_s", "latency_s", "started_s"):
            if d[k] is not None:
                d[k] = round(d[k], 4)
        return d


class Client:
    """A streaming completions client for one server (one HTTP connection per request; thread-safe)."""

    def __init__(self, base_url: str, model: str, timeout: float = 600.0) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.model, self.timeout = model, timeout

    def complete(self, prompt: Sequence[int], max_tokens: int, t0: float | None = None) -> Result:
        """Send ``prompt`` (token ids), stream the answer; TTFT = time to the first chunk carrying a token."""
        res = Result(prompt_tokens=len(prompt))
        body = json.dumps({"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
        start = time.perf_counter()
        res.started_s = start - (t0 if t0 is not None else start)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
                return res
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    return res
                for ch in msg.get("choices") or []:
                    ids = ch.get("token_ids") or []
                    if ids and res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - start
                    res.token_ids.extend(ids)
            res.latency_s = time.perf_counter() - start
            res.output_tokens = len(res.token_ids)
            res.ok = res.output_tokens > 0
            if not res.ok:
                res.error = "no tokens streamed"
        except (OSError, http.client.HTTPException, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return res


class Progress:
    """A one-line progress bar on stderr (only redrawn when stderr is a terminal; else a line every 10 %)."""

    def __init__(self, total: int, label: str, stream: Any = None) -> None:
        self.total, self.label, self.n = max(1, total), label, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._last_decile = -1
        self._draw()

    def update(self, k: int = 1) -> None:
        with self._lock:
            self.n += k
            self._draw()

    def _draw(self) -> None:
        frac = min(1.0, self.n / self.total)
        el = time.monotonic() - self.t0
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:<30}] {self.n}/{self.total} {el:6.1f}s")
            if self.n >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(f"{self.label}: {self.n}/{self.total} ({el:.1f} s)\n")
            self.stream.flush()


def run_concurrent(jobs: Iterable[Callable[[], T]], workers: int, progress: Progress | None = None) -> list[T]:
    """Run callables on ``workers`` threads; results in job order."""
    jobs = list(jobs)

    def wrap(fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            if progress is not None:
                progress.update()

    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        return list(ex.map(wrap, jobs))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..100); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99, max of ``values`` (rounded; None when empty)."""
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {"n": len(values), "mean": r(sum(values) / len(values)) if values else None,
            "p50": r(percentile(values, 50)), "p95": r(percentile(values, 95)), "p99": r(percentile(values, 99)),
            "max": r(max(values)) if values else None}
