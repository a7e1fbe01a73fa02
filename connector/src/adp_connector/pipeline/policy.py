"""Restore or recompute: the choice for one external hit, from rates this engine measured itself.

A restore only pays while the card delivers a hit sooner than the GPU would recompute it. Both sides are
queues, so the estimate counts what is ahead of the hit on each:

* restore time = (bytes of restores in flight + the hit's bytes) / restore throughput, where the throughput is
  the bytes of finished restores over the time at least one restore was in flight (concurrent restores share
  the I/O path: the aggregate is what a new one gets);
* recompute time = (prompt tokens the GPU still has to prefill + the hit's tokens) / prefill throughput, where
  the throughput is the tokens scheduled over the wall time of the steps that scheduled at least
  :data:`PREFILL_STEP_MIN_TOKENS` (decode-only steps say nothing about prefill).

The two are compared by the delay each choice adds to every request on this engine, not only to the hit's
own: a recompute takes GPU time from every other active request (each of them waits ``hit_tokens /
prefill throughput`` longer). A restore delays no other request: the restore pipeline serves restores oldest
first, so a new one waits behind those in flight (counted in its own time) and they do not wait for it. Alone
on the engine, that is the hit's own latency either way; under load a slower restore still wins while it delays
the engine less (GPU run 9: comparing own latencies alone declined most hits at 8 agents, and per-agent speed
fell from 12.8 to 10.1 tok/s against run 8's restore-everything; GPU run 10: also charging each restore in
flight with the new one's transfer time, as if they shared the card fairly, still declined 309 times there,
10.6 tok/s).

Until :data:`MIN_SAMPLES` restores are measured, the restore side uses a prior throughput (``prior_bytes_per_s``,
the connector's ``restore_prior_gbps``): restoring every hit until then made the first requests on an idle engine
wait for the card where the GPU recomputes faster (GPU run 9's sweep: an 8k-token, 1 GB hit that the H200
recomputes in 0.13 s, restored in 0.2-0.3 s, so the 1-user point's p95 was 1.4x the baseline's). Under load the
engine-wide comparison still picks restores with the prior, and the first ones measured replace it. Without a prior,
or before :data:`MIN_SAMPLES` prefill steps, every hit is restored. A declined hit is recomputed: never wrong, only
slower when the estimate is. No vLLM import here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PREFILL_STEP_MIN_TOKENS = 256  # a step that schedules fewer tokens is (mostly) decode
MIN_SAMPLES = 4  # steps and finished restores needed before the policy declines anything
WINDOW = 64  # samples each throughput averages over
IDLE_GAP = 8.0  # a step interval this many times the window's median is idle time, not compute


@dataclass
class Choice:
    """The decision and the estimates behind it (seconds; ``None`` while a rate is not measured): the hit's own
    latency either way, and the delay each choice adds to the whole engine, the two compared."""

    restore: bool
    restore_s: float | None
    recompute_s: float | None
    recompute_delay_s: float | None = None
    prior: bool = False  # the restore side is the prior throughput (no restore measured yet)

    @property
    def restore_delay_s(self) -> float | None:
        """What a restore adds to the engine: its own time (it waits behind the restores in flight, delaying none)."""
        return self.restore_s


class RestorePolicy:
    """Tracks restore and prefill throughput; :meth:`choose` says whether a hit is worth restoring."""

    def __init__(self, margin: float = 1.0, prior_bytes_per_s: float | None = None) -> None:
        self.margin = margin  # restore while restore_s <= margin * recompute_s
        self.prior_bytes_per_s = prior_bytes_per_s or None  # restore throughput assumed until one is measured
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds) of prefill steps
        self._last_step: tuple[float, int] | None = None  # (when, tokens) of the previous step
        self._queued_prefill = 0
        self._inflight: dict[str, int] = {}  # request -> bytes of its restore in flight
        self._done: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (bytes, busy seconds) per finished restore
        self._busy_since: float | None = None  # last event time while a restore was in flight
        self._busy_acc = 0.0  # busy seconds since the previous finished restore

    # ------------------------------------------------------------------ observations

    def on_step(self, now: float, scheduled_tokens: int, queued_prefill_tokens: int) -> None:
        """One scheduler step: the tokens it scheduled and the prompt tokens still to prefill after it."""
        self._queued_prefill = max(0, queued_prefill_tokens)
        last = self._last_step
        self._last_step = (now, scheduled_tokens)
        if last is None or last[1] < PREFILL_STEP_MIN_TOKENS:
            return
        dt = now - last[0]
        if dt <= 0:
            return
        if len(self._steps) >= MIN_SAMPLES:
            gaps = sorted(s for _, s in self._steps)
            if dt > IDLE_GAP * gaps[len(gaps) // 2]:
                return  # the engine sat idle between these steps
        self._steps.append((last[1], dt))

    def on_restore_planned(self, rid: str, nbytes: int, now: float) -> None:
        self._advance(now)
        if self._busy_since is None:
            self._busy_since = now
        self._inflight[rid] = self._inflight.get(rid, 0) + nbytes

    def on_restore_done(self, rid: str, now: float) -> None:
        """A restore finished (or failed: its time was spent all the same)."""
        if rid not in self._inflight:
            return
        self._advance(now)
        nbytes = self._inflight.pop(rid)
        self._done.append((nbytes, self._busy_acc))
        self._busy_acc = 0.0
        if not self._inflight:
            self._busy_since = None

    def forget(self, rid: str) -> None:
        """A request ended with its restore still counted (aborted): drop it without a sample."""
        if self._inflight.pop(rid, None) is not None and not self._inflight:
            self._busy_since = None
            self._busy_acc = 0.0

    def _advance(self, now: float) -> None:
        if self._busy_since is not None and self._inflight:
            self._busy_acc += max(0.0, now - self._busy_since)
            self._busy_since = now

    # ------------------------------------------------------------------ estimates

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return _rate(self._steps)

    @property
    def restore_bytes_per_s(self) -> float | None:
        return _rate(self._done)

    @property
    def inflight_bytes(self) -> int:
        return sum(self._inflight.values())

    def choose(self, hit_tokens: int, nbytes: int, others_active: int = 0) -> Choice:
        """Restore ``hit_tokens`` (``nbytes`` of pages) or recompute them, whichever delays this engine less;
        ``others_active``: the other requests on the GPU (running; not those waiting for their restore)."""
        rbw, pbw = self.restore_bytes_per_s, self.prefill_tokens_per_s
        prior = rbw is None and self.prior_bytes_per_s is not None
        if prior:
            rbw = self.prior_bytes_per_s
        if rbw is None or pbw is None:
            return Choice(True, None, None)
        restore_s = (self.inflight_bytes + nbytes) / rbw  # behind the restores in flight, delaying none of them
        recompute_s = (self._queued_prefill + hit_tokens) / pbw
        recompute_delay = recompute_s + max(0, others_active) * hit_tokens / pbw
        return Choice(restore_s <= self.margin * recompute_delay, restore_s, recompute_s, recompute_delay, prior)


def _rate(samples: deque[tuple[int, float]]) -> float | None:
    """Amount per second over ``(amount, seconds)`` samples; ``None`` under :data:`MIN_SAMPLES` samples."""
    if len(samples) < MIN_SAMPLES:
        return None
    secs = sum(s for _, s in samples)
    return sum(a for a, _ in samples) / secs if secs > 0 else None
