"""Group commit for device flushes: concurrent batches share one flush instead of queueing one each."""

from __future__ import annotations

import threading
from collections.abc import Callable


class FlushGroup:
    """Serialise flushes of one device and let callers that arrive while one runs share the next one.

    A flush makes durable every write completed before it was issued. A caller therefore needs a flush that starts
    after it called :meth:`flush`: if one is running, it waits for it to end and then either starts the next one
    or, if another caller already did, waits for that one. N concurrent callers cost at most two flushes, not N.
    """

    def __init__(self, flush: Callable[[float | None], None]) -> None:
        self._flush = flush
        self._cond = threading.Condition()
        self._started = 0   # flushes issued so far
        self._finished = 0  # the last flush that finished
        self._running = False
        self._errors: dict[int, BaseException] = {}  # generation -> its failure (kept for its waiters)
        self.issued = 0     # device flushes actually issued (for tests and stats)

    def flush(self, timeout: float | None = None) -> None:
        """Return once a flush issued after this call has completed; raises that flush's error."""
        with self._cond:
            need = self._started + 1
            while not self._finished >= need and self._running:
                self._cond.wait()
            if self._finished >= need:
                err = self._errors.get(need)
                if err is not None:
                    raise err
                return
            self._running = True
            self._started += 1
            mine = self._started
        err: BaseException | None = None
        try:
            self.issued += 1
            self._flush(timeout)
        except BaseException as exc:
            err = exc
        with self._cond:
            self._running = False
            self._finished = mine
            for g in [g for g in self._errors if g < mine - 64]:
                del self._errors[g]
            if err is not None:
                self._errors[mine] = err
            self._cond.notify_all()
        if err is not None:
            raise err
