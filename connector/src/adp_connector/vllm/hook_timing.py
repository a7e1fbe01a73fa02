"""Wall time the connector spends inside each vLLM hook, on the thread that called it (issue 14 item 6: where a
request's extra time goes when there is nothing to restore).

The hooks run on vLLM's own threads: the scheduler's (lookups, planning) and the model runner's (submitting
restores, staging saves, collecting results). Time spent there is time the engine's step does not spend on the
GPU's work, so it is what the connector costs a request. Each timed call adds its seconds under
:data:`HOOK_SECONDS_PREFIX` + hook and one call under :data:`HOOK_CALLS_PREFIX` + hook to the connector's counters;
they are exported with a ``hook`` label (``vllm:adp_kv_hook_seconds``, ``vllm:adp_kv_hook_calls``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

HOOK_SECONDS_PREFIX = "hook_s_"
HOOK_CALLS_PREFIX = "hook_calls_"
HOOK_PREFIXES = (HOOK_SECONDS_PREFIX, HOOK_CALLS_PREFIX)
# a step that counted only hook time reports no stats unless this long has passed since hook time alone was last
# reported (vLLM moves connector stats with every step that has any: a decode step would carry them every time)
HOOK_REPORT_INTERVAL_S = 0.5
# the timed hooks (the ``hook`` label's values)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "start_load_kv", "wait_for_save", "get_transfer_results",
         "get_block_ids_with_load_errors", "build_connector_worker_meta")

F = TypeVar("F", bound=Callable[..., Any])


def timed(hook: str) -> Callable[[F], F]:
    """Decorate a connector method: its wall time and call count go to ``self.counters`` under ``hook``."""
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}")
    seconds, calls = HOOK_SECONDS_PREFIX + hook, HOOK_CALLS_PREFIX + hook

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.counters.add(**{seconds: time.perf_counter() - t0, calls: 1})
        return run  # type: ignore[return-value]
    return wrap


def hook_seconds(data: dict[str, Any]) -> dict[str, float]:
    """{hook: seconds} of the hooks timed in ``data`` (drained counters)."""
    n = len(HOOK_SECONDS_PREFIX)
    return {k[n:]: float(v) for k, v in data.items() if k.startswith(HOOK_SECONDS_PREFIX) and v}
