"""Wall time the connector spends inside each vLLM hook, on the thread that called it (issue 14 item 6: where a
request's extra time goes when there is nothing to restore).

The hooks run on vLLM's own threads: the scheduler's (lookups, planning) and the model runner's (submitting
restores, staging saves, collecting results). Time spent there is time the engine's step does not spend on the
GPU's work, so it is what the connector costs a request. Each timed call adds its seconds and one call to the
connector's :class:`HookClock`; the stats carry them as :data:`HOOK_SECONDS_PREFIX` + hook and
:data:`HOOK_CALLS_PREFIX` + hook, exported with a ``hook`` label (``vllm:adp_kv_hook_seconds``,
``vllm:adp_kv_hook_calls``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import perf_counter
from typing import Any, TypeVar

HOOK_SECONDS_PREFIX = "hook_s_"
HOOK_CALLS_PREFIX = "hook_calls_"
# a step that counted only hook time reports no stats unless this long has passed since hook time alone was last
# reported (vLLM moves connector stats with every step that has any: a decode step would carry them every time)
HOOK_REPORT_INTERVAL_S = 0.5
# the timed hooks (the ``hook`` label's values)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "start_load_kv", "wait_for_save", "get_transfer_results",
         "get_block_ids_with_load_errors", "build_connector_worker_meta")

HOOK_INDEX = {h: i for i, h in enumerate(HOOKS)}

F = TypeVar("F", bound=Callable[..., Any])


class HookClock:
    """Seconds and calls per hook of one connector role, since the last :meth:`drain`.

    No lock, so a timed call costs two clock reads and two list additions (a 1-agent decode step is ~6 ms and runs
    ten hooks): each role calls its hooks, and drains them in ``get_kv_connector_stats``, from vLLM's one thread for
    that role (the scheduler's, the model runner's). A call racing a drain from another thread could lose its own
    figure, never anything else.
    """

    __slots__ = ("calls", "seconds")

    def __init__(self) -> None:
        self.seconds = [0.0] * len(HOOKS)
        self.calls = [0] * len(HOOKS)

    def any(self) -> bool:
        """Whether a hook ran since the last drain."""
        return any(self.calls)

    def drain(self) -> dict[str, float]:
        """The hooks that ran since the last drain, as counters (:data:`HOOK_SECONDS_PREFIX` + hook and
        :data:`HOOK_CALLS_PREFIX` + hook), and start again from zero."""
        out: dict[str, float] = {}
        for i, hook in enumerate(HOOKS):
            if self.calls[i]:
                out[HOOK_SECONDS_PREFIX + hook] = self.seconds[i]
                out[HOOK_CALLS_PREFIX + hook] = self.calls[i]
                self.seconds[i], self.calls[i] = 0.0, 0
        return out


def timed(hook: str) -> Callable[[F], F]:
    """Decorate a connector method: its wall time and one call go to ``self.hook_clock`` (a :class:`HookClock`)."""
    if hook not in HOOK_INDEX:
        raise ValueError(f"unknown hook {hook!r}")
    i = HOOK_INDEX[hook]

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                clock = self.hook_clock
                clock.seconds[i] += perf_counter() - t0
                clock.calls[i] += 1
        return run  # type: ignore[return-value]
    return wrap


def hook_seconds(data: dict[str, Any]) -> dict[str, float]:
    """{hook: seconds} of the hooks timed in ``data`` (drained counters)."""
    n = len(HOOK_SECONDS_PREFIX)
    return {k[n:]: float(v) for k, v in data.items() if k.startswith(HOOK_SECONDS_PREFIX) and v}
