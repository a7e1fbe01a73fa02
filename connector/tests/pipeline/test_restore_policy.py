"""RestorePolicy: restore a hit only while the card, with its queue, beats the GPU's recompute with its queue."""

from __future__ import annotations

from adp_connector.pipeline.policy import MIN_SAMPLES, PREFILL_STEP_MIN_TOKENS, RestorePolicy

GB = 1 << 30


def _steps(p: RestorePolicy, t0: float, n: int, tokens: int, dt: float, queued: int = 0) -> float:
    """``n`` prefill steps of ``tokens`` tokens, ``dt`` apart; returns the time after them."""
    t = t0
    for _ in range(n + 1):  # a step's interval is known at the next one
        p.on_step(t, tokens, queued)
        t += dt
    return t


def _restores(p: RestorePolicy, t0: float, n: int, nbytes: int, secs: float) -> float:
    t = t0
    for i in range(n):
        p.on_restore_planned(f"r{t0}-{i}", nbytes, t)
        t += secs
        p.on_restore_done(f"r{t0}-{i}", t)
    return t


def test_restores_until_both_rates_are_measured() -> None:
    p = RestorePolicy()
    assert p.choose(8000, 10 * GB).restore and p.choose(8000, 10 * GB).restore_s is None
    t = _steps(p, 0.0, MIN_SAMPLES, 8192, 0.3)
    assert p.prefill_tokens_per_s is not None and p.choose(8000, 10 * GB).restore  # no restore measured yet
    _restores(p, t, MIN_SAMPLES - 1, GB, 1.0)
    assert p.restore_bytes_per_s is None and p.choose(8000, 10 * GB).restore


def test_the_faster_side_wins() -> None:
    p = RestorePolicy()
    t = _steps(p, 0.0, 8, 10_000, 1.0)  # 10k tokens/s
    _restores(p, t, 8, GB, 0.5)  # 2 GB/s
    assert abs(p.prefill_tokens_per_s - 10_000) < 1 and abs(p.restore_bytes_per_s - 2 * GB) < 1
    c = p.choose(10_000, GB)  # 0.5 s restore vs 1 s recompute
    assert c.restore and abs(c.restore_s - 0.5) < 1e-9 and abs(c.recompute_s - 1.0) < 1e-9
    assert not p.choose(10_000, 4 * GB).restore  # control: 2 s restore vs 1 s recompute


def test_queues_on_both_sides_count() -> None:
    p = RestorePolicy()
    t = _steps(p, 0.0, 8, 10_000, 1.0)
    t = _restores(p, t, 8, GB, 0.5)
    assert p.choose(10_000, GB).restore
    for i in range(4):  # 4 GB of restores already in flight: this one would finish after 2.5 s
        p.on_restore_planned(f"q{i}", GB, t)
    assert p.inflight_bytes == 4 * GB and not p.choose(10_000, GB).restore
    p.on_step(t + 1.0, 10_000, queued_prefill_tokens=40_000)  # but the GPU has 4 s of prefill ahead of it
    assert p.choose(10_000, GB).restore


def test_a_recompute_delays_the_other_requests_and_a_restore_delays_none() -> None:
    """GPU run 9, 8 agents: a 5 GB restore slower than its own 1.5 s recompute was declined while 4 other
    requests shared the GPU; each of them would have waited for that recompute too. GPU run 10: restores are
    served oldest first, so one waits behind those in flight and they do not wait for it."""
    p = RestorePolicy()
    t = _steps(p, 0.0, 8, 10_000, 1.0)  # 10k tokens/s
    t = _restores(p, t, 8, GB, 0.5)  # 2 GB/s
    c = p.choose(10_000, 3 * GB)  # alone: 1.5 s restore vs 1 s recompute
    assert not c.restore and abs(c.restore_delay_s - 1.5) < 1e-9 and abs(c.recompute_delay_s - 1.0) < 1e-9
    c = p.choose(10_000, 3 * GB, others_active=4)  # the recompute delays 4 more requests by 1 s each
    assert c.restore and abs(c.recompute_delay_s - 5.0) < 1e-9 and abs(c.restore_s - 1.5) < 1e-9
    for i in range(3):  # 3 GB already in flight: this restore ends at 3 s, and the 3 ahead end as before
        p.on_restore_planned(f"q{i}", GB, t)
    c = p.choose(10_000, 3 * GB, others_active=4)
    assert c.restore and abs(c.restore_delay_s - 3.0) < 1e-9  # 3 s against 5 s (run 10's rule: 7.5 s, declined)
    for i in range(4):  # control: 4 GB more in flight, 5 s behind them: the restore ends at 5 s, after 5 s
        p.on_restore_planned(f"r{i}", GB, t)
    c = p.choose(10_000, 3 * GB, others_active=4)
    assert c.restore and abs(c.restore_delay_s - 5.0) < 1e-9  # a tie restores (margin 1.0)
    p.on_restore_planned("s", GB, t)
    assert not p.choose(10_000, 3 * GB, others_active=4).restore  # 5.5 s against 5 s: recompute


def test_concurrent_restores_measure_their_aggregate_throughput() -> None:
    p = RestorePolicy()
    t = 0.0
    for k in range(MIN_SAMPLES):  # pairs of 1 GB restores, overlapping fully, 2 s each: 1 GB/s together
        p.on_restore_planned(f"a{k}", GB, t)
        p.on_restore_planned(f"b{k}", GB, t)
        p.on_restore_done(f"a{k}", t + 2.0)
        p.on_restore_done(f"b{k}", t + 2.0)
        t += 10.0  # idle between pairs: not busy time
    assert abs(p.restore_bytes_per_s - GB) < 1  # per restore it looks like 0.5 GB/s


def test_idle_time_between_steps_is_not_prefill_time() -> None:
    p = RestorePolicy()
    t = _steps(p, 0.0, 16, 10_000, 1.0)
    p.on_step(t + 300.0, 10_000, 0)  # the engine sat idle for 5 minutes
    p.on_step(t + 301.0, 10_000, 0)
    assert abs(p.prefill_tokens_per_s - 10_000) < 1
    q = RestorePolicy()  # control: decode-only steps never count as prefill
    _steps(q, 0.0, 16, PREFILL_STEP_MIN_TOKENS - 1, 0.01)
    assert q.prefill_tokens_per_s is None


def test_a_forgotten_restore_leaves_no_sample() -> None:
    p = RestorePolicy()
    p.on_restore_planned("x", GB, 0.0)
    p.forget("x")
    p.on_restore_done("x", 5.0)
    assert p.inflight_bytes == 0 and not p._done


def test_a_prior_throughput_decides_until_restores_are_measured() -> None:
    """GPU run 9's sweep, 1 user: an 8k-token, 1 GB hit the GPU recomputes in 0.13 s was restored (every hit was,
    until four restores were measured) in 0.2-0.3 s. A 4 GB/s prior declines it on an idle engine and still restores
    it under load; measured restores then replace the prior."""
    p = RestorePolicy(prior_bytes_per_s=4e9)
    assert p.choose(8000, GB).restore  # no prefill measured either: restore
    t = _steps(p, 0.0, MIN_SAMPLES, 8192, 8192 / 63_000)  # ~63k tokens/s
    idle = p.choose(8000, GB)
    assert not idle.restore and idle.prior and abs(idle.restore_s - GB / 4e9) < 1e-9
    assert p.choose(8000, GB, others_active=15).restore  # 15 requests would wait for the recompute
    assert RestorePolicy().choose(8000, GB).restore  # the control: no prior, the old rule restores it
    _restores(p, t, MIN_SAMPLES, GB, 0.05)  # this card delivers 20 GB/s: the measurement wins
    fast = p.choose(8000, GB)
    assert fast.restore and not fast.prior
