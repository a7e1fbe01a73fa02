"""A page store served by a helper process, so that page I/O does not run on the caller's GIL.

Why: in a vLLM engine the scheduler, the model runner and (vLLM 0.26) a busy-polling engine loop share one process.
The store's reader/writer threads then compete with them for one interpreter lock, and restores crawled at ~2 GB/s
on the H200 where the same client in its own process moved 14.6 GB/s (docs/benchmarks.md, GPU run 2).

:class:`StoreProcess` starts ``python -m adp_connector.store.process``, which opens the device and a
:class:`~adp_connector.store.PageStore` on it and serves ``save_batch``/``load_batch``/``discard``/``contains``
requests sent over a socket pair. Page bytes do not cross the socket: both processes map one
:class:`SharedArena` (a ``memfd``), and a buffer inside it travels as (offset, length). A buffer outside the arena
still works; its bytes are sent along (slower). The caller sees :class:`~adp_connector.store.BatchHandle` objects,
as with an in-process store.

Synchronous calls (``contains``, ``discard``, ``stats``, ...) go over a second socket pair, which the calling thread
reads itself, and the helper answers them in a thread of their own: they no longer queue behind batches in the
helper's main loop, nor does a batch wait behind them, and their answer no longer passes through the proxy's reader
thread, whose turn at the interpreter lock came on top of the caller's. Beside a thread that holds the lock, every
blocking system call still waits up to the switch interval for it: a one-key ``contains`` takes 5-10 ms there either
way (0.05 ms alone), and the calls pair takes one such wait off the slow end (p90 10.5 against 15.4 ms;
``scripts/store_call_latency.py``, docs/benchmarks.md). Batches, notices and ``close`` keep the first pair, in the
order they were sent.

A read-only helper (the scheduler's lookup helper) can also keep the caller's copy of its index up to date
(:meth:`StoreProcess.mirror_index`): it sends what each refresh changed on the first pair, and ``contains`` then
reads the copy, with no system call to wait behind the interpreter lock.

If the helper exits (crash, killed), every pending batch fails with ``ERROR`` and ``on_exit`` is called; the owner
decides whether to start another (:class:`adp_connector.vllm.backend.StoreLink` does).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from ..device import Buffer
from .results import BatchHandle, PageResult, PageStatus
from .store import EVICTED_KEYS_KEPT, PageStore, StoreConfig

log = logging.getLogger("adp_connector.store.process")

# Where a page's bytes are: (offset, length) in the arena; else the bytes (save) or the buffer length (load).
_Loc = tuple[int, int] | bytes | int
# Requests answered on the calls pair by the helper's calls thread (the others keep the first pair's order).
CALL_OPS = frozenset(("contains", "discard", "stats", "refresh", "indexed_keys", "thread_cpu"))


class SharedArena:
    """``nbytes`` of host memory (an anonymous ``memfd``) that a :class:`StoreProcess` maps too.

    The pages are allocated lazily by the kernel; the caller may pin the range for DMA (``cudaHostRegister``).
    """

    def __init__(self, nbytes: int, name: str = "adp-kv-arena") -> None:
        if nbytes <= 0:
            raise ValueError("arena size must be positive")
        self.nbytes = nbytes
        self.fd = os.memfd_create(name)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def locate(self, buf: Any) -> tuple[int, int] | None:
        """(offset, length) of a contiguous writable buffer that lies inside the arena, else None."""
        try:
            mv = memoryview(buf)
            if mv.readonly or not mv.c_contiguous:
                return None
            mv = mv.cast("B")
            n = mv.nbytes
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mv)) if n else -1
        except (TypeError, ValueError):
            return None
        off = addr - self.base
        if n == 0 or off < 0 or off + n > self.nbytes:
            return None
        return off, n

    def close(self) -> None:
        """Unmap (fails while views are exported, e.g. tensors over the arena are alive) and close the fd."""
        try:
            self.map.close()
        except BufferError:
            log.debug("arena still referenced; left mapped")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (mmap.MADV_POPULATE_WRITE is not in Python 3.11)
_POPULATE_CHUNK = 64 << 20


class ArenaPopulator:
    """Faults this process's page-table entries for the arena in, once, in the background.

    Each process that maps the arena takes a minor page fault on its first touch of every 4 KiB page; a restore
    into a slab the helper never touched paid ~0.3 core-seconds per GB in fault handling (about 40% of a helper's
    restore CPU, measured with perf on the restore-path benchmark), more than the socket receive itself.
    ``MADV_POPULATE_WRITE`` in 64 MiB steps (ctypes releases the GIL) moves that to the helper's start. The pages
    are the arena's own ``memfd`` pages: a pinned arena has them all already; an unpinned one gets any page the
    owner has not touched yet allocated now instead of at first use. ``ADP_KV_ARENA_POPULATE=0`` turns it off; a
    kernel without the advice stops it with one log line. ``done`` is set either way.
    """

    def __init__(self, arena: memoryview) -> None:
        self.arena = arena
        self.populated = 0
        self.done = threading.Event()

    def start(self) -> None:
        if os.environ.get("ADP_KV_ARENA_POPULATE", "1") == "0" or len(self.arena) == 0:
            self.done.set()
            return
        threading.Thread(target=self.run, name="arena-populate", daemon=True).start()

    def run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            base = ctypes.addressof(ctypes.c_char.from_buffer(self.arena))
            n = len(self.arena)
            for off in range(0, n, _POPULATE_CHUNK):
                step = min(_POPULATE_CHUNK, n - off)
                if libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(step), _MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    log.warning("arena populate stopped at %d of %d bytes: %s (pages fault in on first use)",
                             off, n, os.strerror(err))
                    return
                self.populated = off + step
        except (OSError, AttributeError, TypeError, ValueError) as exc:
            log.warning("arena populate unavailable: %s (pages fault in on first use)", exc)
        finally:
            self.done.set()


class StoreProcessError(RuntimeError):
    """The helper process could not open the store, or went away."""


class StartingHelper:
    """A helper process started by :meth:`StoreProcess.spawn` that has not reported its store open yet."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, arena: SharedArena, calls: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.calls = calls  # the synchronous calls' own socket pair
        self.arena = arena

    def ready(self, timeout: float, on_exit: Callable[[str], None] | None = None) -> StoreProcess:
        """Wait up to ``timeout`` s for the helper's store; raises :class:`StoreProcessError` (the helper's error
        text, or the timeout) and ends the process if it does not open."""
        conn, proc = self.conn, self.proc
        try:
            if not conn.poll(timeout):
                raise StoreProcessError(f"store process did not open the store in {timeout} s")
            kind, payload = conn.recv()
        except (EOFError, OSError) as exc:
            proc.kill()
            conn.close()
            self.calls.close()
            raise StoreProcessError(f"store process exited during start-up (rc={proc.wait()})") from exc
        except BaseException:
            self.abort()
            raise
        if kind != "ready":
            conn.close()
            self.calls.close()
            proc.wait()
            raise StoreProcessError(payload)
        return StoreProcess(proc, conn, self.arena, on_exit, payload, self.calls)

    def abort(self) -> None:
        """End the helper before it is ready."""
        self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.calls.close()


class StoreProcess:
    """The subset of :class:`PageStore` the connector's worker side uses, served by a helper process."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, arena: SharedArena,
                 on_exit: Callable[[str], None] | None, info: dict[str, Any], calls: Connection) -> None:
        self._proc = proc
        self._conn = conn
        self._calls = calls  # synchronous calls, read by the calling thread (one at a time: _call_lock)
        self._call_lock = threading.Lock()
        self._call_id = 0
        self._arena = arena
        self._on_exit = on_exit
        self.info = info
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        # own pages the helper's saves evicted, until take_evicted (bounded like the helper's own: a user that never
        # takes them keeps only the newest)
        self._evicted: deque[bytes] = deque(maxlen=EVICTED_KEYS_KEPT)
        self._next = 1
        self._pending: dict[int, tuple[BatchHandle | None, list[tuple[int, Any]], list[bytes]]] = {}
        self._replies: dict[int, Any] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._closed = False
        self.exit_reason = ""
        # the helper's index as of its last published change (:meth:`mirror_index`); None: ask the helper
        self._mirror: set[bytes] | None = None
        self._mirror_gen = 0
        self._mirror_cond = threading.Condition(threading.Lock())
        self._reader = threading.Thread(target=self._read_loop, name="adpkv-storeproc", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, open_device: Callable[..., Any], device_args: tuple, config: StoreConfig, arena: SharedArena, *,
              timeout: float = 30.0, on_exit: Callable[[str], None] | None = None) -> StoreProcess:
        """Start the helper; it calls ``open_device(*device_args)`` and opens a PageStore with ``config``.

        ``open_device`` must be importable by reference (a module-level function or a classmethod). Raises
        :class:`StoreProcessError` with the helper's error text if it cannot open the store in ``timeout`` s.
        """
        return cls.spawn(open_device, device_args, config, arena).ready(timeout, on_exit)

    @classmethod
    def spawn(cls, open_device: Callable[..., Any], device_args: tuple, config: StoreConfig,
              arena: SharedArena) -> StartingHelper:
        """Start the helper process and send it its store config, without waiting for it (:meth:`start` waits):
        several helpers then open their stores at the same time."""
        parent_sock, child_sock = socket.socketpair()
        parent_calls, child_calls = socket.socketpair()
        env = dict(os.environ)  # the helper imports this package from where the caller found it
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "adp_connector.store.process", str(child_sock.fileno()),
                 str(child_calls.fileno()), str(arena.fd), str(arena.nbytes)],
                pass_fds=(child_sock.fileno(), child_calls.fileno(), arena.fd), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            parent_sock.close()
            parent_calls.close()
            raise
        finally:
            child_sock.close()
            child_calls.close()
        conn = Connection(parent_sock.detach())
        starting = StartingHelper(proc, conn, arena, Connection(parent_calls.detach()))
        try:
            conn.send((open_device, device_args, config))
        except (EOFError, OSError) as exc:
            starting.abort()
            raise StoreProcessError(f"store process exited during start-up (rc={proc.wait()})") from exc
        return starting

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    @property
    def outstanding(self) -> int:
        """Requests sent to the helper and not answered yet (batches and calls)."""
        return len(self._pending)

    # ------------------------------------------------------------------ batches

    def save_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start saving ``buffers[i]`` under ``keys[i]`` (buffers unchanged until done), as PageStore does."""
        locs: list[_Loc] = []
        for b in buffers:
            loc = self._arena.locate(b)
            locs.append(loc if loc is not None else bytes(memoryview(b).cast("B")))
        return self._submit("save", keys, locs, [])

    def load_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start loading ``keys[i]`` into ``buffers[i]``, as PageStore does."""
        locs: list[_Loc] = []
        outside: list[tuple[int, Any]] = []
        for i, b in enumerate(buffers):
            loc = self._arena.locate(b)
            if loc is None:
                mv = memoryview(b).cast("B")
                outside.append((i, mv))
                locs.append(mv.nbytes)
            else:
                locs.append(loc)
        return self._submit("load", keys, locs, outside)

    def _submit(self, op: str, keys: Sequence[bytes], locs: list[_Loc], outside: list[tuple[int, Any]]) -> BatchHandle:
        if len(keys) != len(locs):
            raise ValueError("keys and buffers differ in length")
        h = BatchHandle(op, len(keys))
        raw = [bytes(k) for k in keys]
        rid = self._register((h, outside, raw))
        if rid is None:
            h._set([PageResult(k, PageStatus.ERROR, 0, "store process closed") for k in raw])
            return h
        self._send((op, rid, raw, locs))
        return h

    def _register(self, entry: tuple[BatchHandle | None, list[tuple[int, Any]], list[bytes]]) -> int | None:
        """A request id for ``entry`` (awaiting its reply), or None once the helper is gone."""
        with self._lock:
            if self._closed:
                return None
            rid = self._next
            self._next += 1
            self._pending[rid] = entry
            return rid

    def note_read_back(self, keys: Sequence[bytes]) -> None:
        """Tell the helper that ``keys`` were read back elsewhere (:meth:`PageStore.note_read_back`); no reply, so
        a reply thread may call it."""
        if not self._closed:
            self._send(("read_back", 0, [bytes(k) for k in keys], None))

    def take_evicted(self) -> list[bytes]:
        """The helper's own pages evicted by the saves completed since the last call (they come back with each
        save's results; :meth:`PageStore.take_evicted`)."""
        with self._lock:
            keys = list(self._evicted)
            self._evicted.clear()
        return keys

    def note_reading(self, keys: Sequence[bytes]) -> None:
        """Tell the helper that ``keys`` are about to be read (:meth:`PageStore.note_reading`); no reply, and it
        reaches the helper ahead of any save sent after it."""
        if not self._closed:
            self._send(("reading", 0, [bytes(k) for k in keys], None))

    def discard(self, keys: Iterable[bytes], timeout: float = 30.0) -> int:
        """Delete own pages; returns how many were removed."""
        return int(self._call("discard", [bytes(k) for k in keys], timeout))

    def contains(self, keys: Iterable[bytes], timeout: float = 30.0) -> list[bool]:
        """Which keys the helper's index holds: from the local copy once :meth:`mirror_index` made one (no round
        trip), else asked."""
        if self._mirror is not None:
            if self._closed:
                raise StoreProcessError(self.exit_reason or "store process closed")
            with self._mirror_cond:
                m = self._mirror
                return [(k if type(k) is bytes else bytes(k)) in m for k in keys]
        return list(self._call("contains", [bytes(k) for k in keys], timeout))

    def mirror_index(self, timeout: float = 30.0) -> int:
        """Keep a copy of the helper's index in this process, so that :meth:`contains` makes no round trip.

        The helper sends every change of its index (after each refresh, and at least every ``MIRROR_POLL_S``) on
        the batches' pair, which the reader thread applies; the first is the whole index, applied before this
        returns. The copy is as fresh as the helper's own index, which a refresh brings up to date every
        ``refresh_interval_s``: a scheduler's view of the card is that old either way. :meth:`refresh` returns
        once the copy has the refreshed index. Returns the number of keys copied. An index of more than
        ``MIRROR_MAX_KEYS`` pages is not copied, or stops being (``mirrored`` turns False): lookups ask again.
        """
        self._call("mirror", [], timeout)
        with self._mirror_cond:
            return len(self._mirror or ())

    @property
    def mirrored(self) -> bool:
        """Whether :meth:`contains` answers from a local copy of the helper's index."""
        return self._mirror is not None

    def stats(self, timeout: float = 30.0) -> dict[str, float]:
        """The helper store's counters (``StoreStats.snapshot``)."""
        return dict(self._call("stats", [], timeout))

    def refresh(self, timeout: float = 30.0) -> None:
        """Re-read the other writers' slot tables now (the helper also does it every ``refresh_interval_s``); with a
        mirrored index, return once the copy has what the refresh found."""
        deadline = time.monotonic() + timeout
        gen = self._call("refresh", [], timeout)
        if self._mirror is None or type(gen) is not int:
            return
        with self._mirror_cond:
            if not self._mirror_cond.wait_for(lambda: self._mirror_gen >= gen or self._closed,
                                              max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"store process: the index copy did not reach the refresh in {timeout} s")

    def indexed_keys(self, timeout: float = 30.0) -> list[bytes]:
        """Every key the helper's index holds (diagnostics and tests)."""
        return list(self._call("indexed_keys", [], timeout))

    def thread_cpu(self, timeout: float = 30.0) -> dict[str, tuple[float, float]]:
        """The helper's CPU seconds so far by thread role: ``{role: (user, system)}`` (:func:`thread_cpu`)."""
        return {k: (float(u), float(s)) for k, (u, s) in dict(self._call("thread_cpu", [], timeout)).items()}

    def _call(self, op: str, keys: list[bytes], timeout: float) -> Any:
        """Ask the helper and wait for its answer: on the calls pair, read here (:data:`CALL_OPS`), else on the first
        pair after everything sent before it, answered through the reader thread."""
        if op in CALL_OPS:
            return self._ask(op, keys, timeout)
        rid = self._register((None, [], keys))
        if rid is None:
            raise StoreProcessError(self.exit_reason or "store process closed")
        self._send((op, rid, keys, None))
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: rid in self._replies or self._closed, timeout):
                self._pending.pop(rid, None)
                raise TimeoutError(f"store process: {op} not answered in {timeout} s")
            if rid not in self._replies:
                raise StoreProcessError(self.exit_reason or "store process closed")
            reply = self._replies.pop(rid)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def _ask(self, op: str, keys: list[bytes], timeout: float) -> Any:
        """One synchronous call on the calls pair; the answer is read by this thread. A call that timed out leaves
        its answer to come: the next call skips answers of earlier ids."""
        with self._call_lock:
            if self._closed:
                raise StoreProcessError(self.exit_reason or "store process closed")
            self._call_id += 1
            rid = self._call_id
            deadline = time.monotonic() + timeout
            try:
                self._calls.send((op, rid, keys))
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._calls.poll(left):
                        raise TimeoutError(f"store process: {op} not answered in {timeout} s")
                    kind, got, payload = self._calls.recv()
                    if got == rid:
                        break
            except TimeoutError:
                raise
            except (EOFError, OSError) as exc:  # OSError: TimeoutError is one, hence the clause above
                raise StoreProcessError(self.exit_reason or f"store process unreachable: {exc!r}") from None
        if kind != "ok":
            raise StoreProcessError(str(payload))
        return payload

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:
            self._shutdown(f"store process unreachable: {exc}")

    # ------------------------------------------------------------------ replies

    def _read_loop(self) -> None:
        reason = "store process exited"
        try:
            while True:
                kind, rid, payload, extra = self._conn.recv()
                if kind == "index":  # a change of the helper's index: rid is its generation
                    self._apply_index(rid, payload, extra)
                    continue
                with self._lock:
                    entry = self._pending.pop(rid, None)
                if entry is None:
                    continue
                h, outside, _keys = entry
                if h is None:
                    with self._reply_ready:
                        self._replies[rid] = payload if kind == "ok" else StoreProcessError(str(payload))
                        self._reply_ready.notify_all()
                    continue
                if kind != "done":
                    h._set([PageResult(k, PageStatus.ERROR, 0, str(payload)) for k in _keys])
                    continue
                results = [PageResult(k, PageStatus(s), n, d) for k, s, n, d in payload]
                if h.kind == "save":
                    if extra:
                        with self._lock:
                            self._evicted.extend(extra)
                    h._set(results)
                    continue
                for (_, mv), data in zip(outside, extra or (), strict=False):
                    if data is not None:
                        mv[:len(data)] = data
                h._set(results)
        except (EOFError, OSError) as exc:
            try:  # the socket closes as the process dies; give the kernel a moment to report it
                rc: int | None = self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                rc = None
            reason = f"store process exited (rc={rc})" if rc is not None else f"store process connection lost: {exc!r}"
        self._shutdown(reason)

    def _apply_index(self, gen: int, added: list[bytes] | None, removed: list[bytes] | None) -> None:
        with self._mirror_cond:
            m = None  # the helper ended the copy (too many pages): ask it again
            if added is not None and removed is not None:
                m = self._mirror if self._mirror is not None else set()
                m.difference_update(removed)
                m.update(added)
            self._mirror, self._mirror_gen = m, gen
            self._mirror_cond.notify_all()

    def _shutdown(self, reason: str) -> None:
        """Fail everything pending; tell the owner once (unless it closed us)."""
        with self._lock:
            first = not self._closed
            self._closed = True
            pending, self._pending = self._pending, {}
            if first:
                self.exit_reason = reason
        for h, _, keys in pending.values():
            if h is not None and not h.done():
                h._set([PageResult(k, PageStatus.ERROR, 0, reason) for k in keys])
        with self._reply_ready:
            self._reply_ready.notify_all()
        with self._mirror_cond:
            self._mirror_cond.notify_all()
        if first and self._on_exit is not None:
            try:
                self._on_exit(reason)
            except Exception:
                log.exception("store process on_exit callback")

    def close(self, release: bool = True, timeout: float = 30.0) -> None:
        """Close the helper's store (releasing its writer lease unless ``release`` is False) and stop it."""
        if self.alive:
            self._on_exit = None
            try:
                self._call("close" if release else "abandon", [], timeout)
            except Exception as exc:
                log.debug("store process close: %s", exc)
        self._on_exit = None
        self._shutdown("store process closed")
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        with self._call_lock:  # after any call in flight (the helper has gone: it ends at once)
            self._calls.close()

    def kill(self) -> None:
        """Kill the helper (tests: a crash); pending batches fail and ``on_exit`` runs."""
        self._proc.kill()


def save_owner(key: bytes, writers: int) -> int:
    """The index of the writer helper that saves (and discards) ``key`` among ``writers``: a stable function of the
    key's first byte, so one key always goes to one writer (its dedupe stays exact) and keys spread evenly (they are
    hashes)."""
    return key[0] % writers if writers > 1 and key else 0


def member_writer_id(base: bytes, index: int) -> bytes:
    """Writer id of a group's writer ``index``: writer 0 keeps ``base`` (one writer behaves as without a group),
    the others derive theirs from it, so a restarted engine with the same base gets every writer's pages back."""
    if index == 0:
        return base
    return hashlib.blake2b(base + index.to_bytes(4, "little"), digest_size=16, person=b"adpkv-writer").digest()


class StoreGroup:
    """Writer helpers plus reader helpers, used like one :class:`StoreProcess`.

    A single helper is one interpreter: on the H200 it moved ~5-6 GB/s of restores (socket receive, checksums) and
    about 1 GB/s of saves while the target could take more. Store format v2 lets several writers share one card
    (each claims its own segments), so a group may have ``W`` writers: a save batch is split by
    :func:`save_owner` (one key always goes to the same writer), as are discards and lookups; each writer has its
    own stable writer id (:func:`member_writer_id`). Load batches go to the helper with the fewest requests
    outstanding (in turn among equals), each with its own NVMe/TCP controller. A helper indexes other writers' pages
    through its refreshes, so pages saved since its last refresh may come back MISSING there: those are loaded again
    through the key's writer before the batch completes. The pages a helper read back for another writer are noted
    to that writer (:meth:`StoreProcess.note_read_back`), whose eviction order counts them as read;
    :meth:`note_reading` names a restore's pages to their writers before its batches are read.
    """

    def __init__(self, writer: StoreProcess, readers: list[StoreProcess],
                 writers: list[StoreProcess] | None = None) -> None:
        self.writer = writer
        self.writers = [writer, *(writers or [])]
        self.readers = readers
        self._members = [*self.writers, *readers]
        self._turn = 0
        self._lock = threading.Lock()
        self.info = writer.info

    @classmethod
    def start(cls, open_device: Callable[..., Any], device_args: tuple, config: StoreConfig, arena: SharedArena, *,
              readers: int, writers: int = 1, timeout: float = 30.0,
              on_exit: Callable[[str], None] | None = None) -> StoreGroup:
        """Start ``writers`` writer helpers (the first with ``config``, the others with writer ids derived from its
        ``writer_id``) and ``readers`` read-only helpers; ``on_exit`` runs once, when the first of them exits (the
        owner then replaces the whole group). An extra writer that finds no free writer slot on the card (other
        engines hold them) serves as a reader instead and the group saves with the writers that got one (logged);
        the first writer's own state is what :class:`StoreProcess` reports."""
        if writers < 1 or readers < 0:
            raise ValueError("a store group needs at least one writer and no negative reader count")
        if writers > 1 and not config.writer:
            raise ValueError("several writer helpers need a writer config (config.writer is False)")
        fired = threading.Event()

        def exited(reason: str) -> None:
            if not fired.is_set():
                fired.set()
                if on_exit is not None:
                    on_exit(reason)

        base = bytes(config.writer_id) if config.writer_id is not None else os.urandom(16)
        started: list[StoreProcess] = []
        slotless: list[StoreProcess] = []  # extra writers the card had no slot for: they read
        pending: list[StartingHelper] = []
        try:
            # The first writer formats a blank card; then every other helper opens its store at the same time
            # (one after the other, 12 helpers took 13 s on the H200, past the engine's connect_timeout_s).
            started.append(StoreProcess.start(open_device, device_args, config, arena, timeout=timeout,
                                              on_exit=exited))
            for i in range(1, writers):
                wc = dataclasses.replace(config, writer=True, writer_id=member_writer_id(base, i),
                                         writer_label=f"{config.writer_label} writer {i}", preferred_partition=None)
                pending.append(StoreProcess.spawn(open_device, device_args, wc, arena))
            rc = dataclasses.replace(config, writer=False, writer_label=f"{config.writer_label} reader")
            pending += [StoreProcess.spawn(open_device, device_args, rc, arena) for _ in range(readers)]
            while pending:
                sp = pending[0].ready(timeout, exited)
                pending.pop(0)
                (started if sp.info.get("partition") is not None else slotless).append(sp)  # readers hold none
            if len(started) < writers:
                log.warning("page store: %d of %d writer helpers got a writer slot on the card (the others are held "
                            "by other writers); saving with %d", len(started), writers, len(started))
        except BaseException:
            fired.set()
            for p in pending:
                p.abort()
            for sp in started + slotless:
                sp.close()
            raise
        return cls(started[0], slotless, started[1:])

    @property
    def pid(self) -> int:
        return self.writer.pid

    @property
    def pids(self) -> list[int]:
        """Every helper's pid, writers first."""
        return [m.pid for m in self._members]

    @property
    def alive(self) -> bool:
        return all(m.alive for m in self._members)

    def owner(self, key: bytes) -> StoreProcess:
        """The writer helper that saves ``key``."""
        return self.writers[save_owner(key, len(self.writers))]

    def _split(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Request positions per owning writer index."""
        parts: dict[int, list[int]] = {}
        n = len(self.writers)
        for i, k in enumerate(keys):
            parts.setdefault(save_owner(bytes(k), n), []).append(i)
        return parts

    def save_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        if len(self.writers) == 1:
            return self.writer.save_batch(keys, buffers)
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        parts = self._split(keys)
        if len(parts) <= 1:
            return self.writers[next(iter(parts), 0)].save_batch(keys, buffers)
        out = BatchHandle("save", len(keys))
        res: list[PageResult | None] = [None] * len(keys)
        left = [len(parts)]
        lock = threading.Lock()

        def landed(pos: list[int], h: BatchHandle) -> None:
            sub = h.wait(0)
            with lock:
                for i, r in zip(pos, sub, strict=True):
                    res[i] = r
                left[0] -= 1
                last = left[0] == 0
            if last:
                out._set(list(res))  # type: ignore[arg-type]

        for w, pos in parts.items():
            h = self.writers[w].save_batch([keys[i] for i in pos], [buffers[i] for i in pos])
            h.add_done_callback(lambda hh, pos=pos: landed(pos, hh))
        return out

    def _load_member(self) -> StoreProcess:
        """The helper a load batch goes to: the one with the fewest requests outstanding, ties taken in turn. A
        writer still busy with saves then leaves restores to an idle helper (in strict turns, a restore waited behind
        that writer's saves)."""
        with self._lock:
            turn = self._turn
            self._turn += 1
        busy = [m.outstanding for m in self._members]
        least = min(busy)
        idle = [m for m, n in zip(self._members, busy, strict=True) if n == least]
        return idle[turn % len(idle)]

    def take_evicted(self) -> list[bytes]:
        """Pages the group's writers evicted since the last call."""
        return [k for w in self.writers for k in w.take_evicted()]

    def note_reading(self, keys: Sequence[bytes]) -> None:
        """Name pages about to be read to their writers (:meth:`StoreProcess.note_reading`), whichever helper will
        read them."""
        by_writer: dict[int, list[bytes]] = {}
        n = len(self.writers)
        for k in keys:
            by_writer.setdefault(save_owner(bytes(k), n), []).append(bytes(k))
        for w, ks in by_writer.items():
            self.writers[w].note_reading(ks)

    def load_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        member = self._load_member()
        first = member.load_batch(keys, buffers)
        if len(self.writers) == 1 and member is self.writer:
            return first
        out = BatchHandle("load", len(keys))

        def retry_missing(h: BatchHandle) -> None:
            res = list(h.wait(0))
            again: dict[int, list[int]] = {}
            read: dict[int, list[bytes]] = {}  # pages a helper other than their writer read back, by writer
            n = len(self.writers)
            for i, r in enumerate(res):
                w = save_owner(bytes(keys[i]), n)
                if self.writers[w] is member:
                    continue
                if r.status is PageStatus.MISSING:
                    again.setdefault(w, []).append(i)
                elif r.status is PageStatus.OK:
                    read.setdefault(w, []).append(bytes(keys[i]))
            for w, ks in read.items():  # their writer ranks them for eviction as if it had served the load
                try:
                    self.writers[w].note_read_back(ks)
                except Exception as exc:  # a lost notice costs an eviction rank, never the load
                    log.warning("ADP KV: telling writer %d about %d pages read back failed: %s", w, len(ks), exc)
            if not again:
                out._set(res)
                return
            left = [len(again)]
            lock = threading.Lock()

            def merged(pos: list[int], h2: BatchHandle) -> None:
                with lock:
                    for i, r in zip(pos, h2.wait(0), strict=True):
                        res[i] = r
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    out._set(res)

            for w, pos in again.items():
                self.writers[w].load_batch([keys[i] for i in pos], [buffers[i] for i in pos]).add_done_callback(
                    lambda hh, pos=pos: merged(pos, hh))

        first.add_done_callback(retry_missing)
        return out

    def discard(self, keys: Iterable[bytes], timeout: float = 30.0) -> int:
        ks = [bytes(k) for k in keys]
        return sum(self.writers[w].discard([ks[i] for i in pos], timeout) for w, pos in self._split(ks).items())

    def contains(self, keys: Iterable[bytes], timeout: float = 30.0) -> list[bool]:
        ks = [bytes(k) for k in keys]
        out = [False] * len(ks)
        for w, pos in self._split(ks).items():
            for i, hit in zip(pos, self.writers[w].contains([ks[i] for i in pos], timeout), strict=True):
                out[i] = hit
        return out

    def refresh(self, timeout: float = 30.0) -> None:
        """Refresh every helper's index now."""
        for m in self._members:
            m.refresh(timeout)

    def thread_cpu(self, timeout: float = 30.0) -> dict[str, tuple[float, float]]:
        """Every helper's CPU seconds by thread role, summed (:func:`thread_cpu`)."""
        total: dict[str, tuple[float, float]] = {}
        for m in self._members:
            for k, (u, sy) in m.thread_cpu(timeout).items():
                pu, ps = total.get(k, (0.0, 0.0))
                total[k] = (pu + u, ps + sy)
        return total

    def stats(self, timeout: float = 30.0) -> dict[str, float]:
        """Every helper's counters (summed)."""
        total = dict(self.writer.stats(timeout))
        for r in self._members[1:]:
            for k, v in r.stats(timeout).items():
                total[k] = total.get(k, 0) + v
        lb, ls = total.get("bytes_loaded", 0), total.get("load_seconds", 0)
        total["load_gbps"] = lb / ls / 1e9 if ls else 0.0
        sb, ss = total.get("bytes_saved", 0), total.get("save_seconds", 0)
        total["save_gbps"] = sb / ss / 1e9 if ss else 0.0
        return total

    def close(self, release: bool = True, timeout: float = 30.0) -> None:
        for r in self.readers:
            r.close(True, timeout)
        for w in reversed(self.writers):
            w.close(release, timeout)

    def kill(self) -> None:
        """Kill the first writer (tests: a crash)."""
        self.writer.kill()


# ---------------------------------------------------------------------- the helper process


MIRROR_POLL_S = 1.0  # an index publisher looks for changes at least this often (a refresh wakes it at once)
MIRROR_MAX_KEYS = 1 << 22  # beyond this many pages (~400 MB of copy in the owner) the owner asks the helper again


class IndexPublisher:
    """Sends the owner what the helper's index gained and lost since the last time (:meth:`StoreProcess.mirror_index`),
    as ``("index", generation, added, removed)`` on the batches' pair; the first message is the whole index.

    A thread sends after each change the store signals (``index_changed``: a refresh that found other writers'
    pages changed, a stale page dropped on a load) and every ``MIRROR_POLL_S`` in any case. The diff is taken
    here, in the helper, so the owner's process only applies it. An index of more than ``max_keys`` pages ends
    the copy (``("index", generation, None, None)``): the owner asks the helper again.
    """

    def __init__(self, store: PageStore, send: Callable[[tuple], None], poll_s: float = MIRROR_POLL_S,
                 max_keys: int = MIRROR_MAX_KEYS) -> None:
        self.store = store
        self.send = send
        self.poll_s = poll_s
        self.max_keys = max_keys
        self.generation = 0
        self._published: set[bytes] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def start(self) -> int:
        """Publish the whole index now, then keep publishing changes; the generation sent."""
        gen = self.publish()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adpkv-store-mirror", daemon=True)
            self._thread.start()
        return gen

    def publish(self) -> int:
        """Send what changed since the last message (nothing when nothing did); the generation the owner has then."""
        with self._lock:
            if self._stop.is_set():
                return self.generation
            self.store.index_changed.clear()
            now = set(self.store.indexed_keys())
            if len(now) > self.max_keys:
                log.warning("index publisher: %d pages are more than %d; the owner asks again", len(now),
                            self.max_keys)
                self.generation += 1
                self.send(("index", self.generation, None, None))
                self._published = set()
                self._stop.set()
                return self.generation
            added, removed = now - self._published, self._published - now
            if added or removed or self.generation == 0:
                self.generation += 1
                self.send(("index", self.generation, list(added), list(removed)))
                self._published = now
            return self.generation

    def stop(self) -> None:
        self._stop.set()
        self.store.index_changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.store.index_changed.wait(self.poll_s)
            if self._stop.is_set():
                return
            try:
                self.publish()
            except (OSError, ValueError):  # the owner is gone
                return
            except Exception:
                log.exception("index publisher")


def _answer(store: PageStore | None, op: str, keys: list[bytes], populator: ArenaPopulator | None,
            publisher: IndexPublisher | None = None) -> Any:
    """The answer to one synchronous call (:data:`CALL_OPS`)."""
    if store is None:
        raise StoreProcessError("the store is closed")
    if op == "discard":
        return store.discard(keys)
    if op == "contains":
        return store.contains(keys)
    if op == "refresh":
        store.refresh()
        if publisher is not None and publisher.active:  # the change goes out before this answer does
            return publisher.publish()
        return True
    if op == "indexed_keys":
        return store.indexed_keys()
    if op == "thread_cpu":
        return thread_cpu()
    if op == "stats":
        out = store.stats.snapshot()
        if populator is not None:  # summed over a group: bytes, and helpers whose populate ended
            out["arena_populated_bytes"] = populator.populated
            out["arena_populate_done"] = int(populator.done.is_set())
        return out
    raise ValueError(f"unknown request {op!r}")


def _serve_calls(calls: Connection, store_of: Callable[[], PageStore | None],
                 populator: ArenaPopulator | None, publisher: IndexPublisher | None = None) -> None:
    """The calls thread: answer synchronous calls on their own socket pair until it closes."""
    while True:
        try:
            op, rid, keys = calls.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple = ("ok", rid, _answer(store_of(), op, keys, populator, publisher))
        except Exception as exc:
            reply = ("error", rid, f"{type(exc).__name__}: {exc}")
        try:
            calls.send(reply)
        except OSError:
            return


def _serve(conn: Connection, calls: Connection, arena: memoryview, populator: ArenaPopulator | None = None) -> None:
    """Helper main: open the store from the first message, then serve requests until EOF or close (synchronous
    calls on ``calls``, in a thread of their own)."""
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    open_device, device_args, config = conn.recv()
    device = store = None
    try:
        device = open_device(*device_args)
        store = PageStore(device, config)
    except BaseException as exc:
        send(("error", f"{type(exc).__name__}: {exc}"))
        if device is not None:
            device.close()
        return
    g = store.geometry
    publisher = IndexPublisher(store, send)
    threading.Thread(target=_serve_calls, args=(calls, lambda: store, populator, publisher),
                     name="adpkv-store-calls", daemon=True).start()
    send(("ready", {"partition": store.partition, "pid": os.getpid(),
                    "geometry": {"slots_per_segment": g.slots_per_segment, "data_lbas": g.data_lbas,
                                 "lba_size": g.lba_size, "segments": g.segments}}))

    def done(rid: int, h: BatchHandle, inline: list[tuple[int, bytearray]]) -> None:
        try:
            res = h.wait(0)
        except Exception as exc:
            send(("error", rid, repr(exc), None))
            return
        data: Any = [bytes(buf[:res[i].nbytes]) if res[i].ok else None for i, buf in inline] if inline else None
        if h.kind == "save" and store is not None:
            data = store.take_evicted()  # what this save's allocations evicted rides back with its results
        send(("done", rid, [(r.key, r.status.value, r.nbytes, r.detail) for r in res], data))

    try:
        while True:
            try:
                op, rid, keys, locs = conn.recv()
            except EOFError:
                break
            if op in ("read_back", "reading"):  # notices: no reply
                if store is not None:
                    (store.note_read_back if op == "read_back" else store.note_reading)(keys)
                continue
            if op in ("save", "load"):
                bufs: list[Any] = []
                inline: list[tuple[int, bytearray]] = []
                for i, loc in enumerate(locs):
                    if isinstance(loc, tuple):
                        bufs.append(arena[loc[0]:loc[0] + loc[1]])
                    elif isinstance(loc, int):  # a load into a buffer outside the arena: bytes go back inline
                        b = bytearray(loc)
                        inline.append((i, b))
                        bufs.append(b)
                    else:
                        bufs.append(loc)
                try:
                    h = (store.save_batch if op == "save" else store.load_batch)(keys, bufs)
                except Exception as exc:
                    send(("error", rid, f"{type(exc).__name__}: {exc}", None))
                    continue
                h.add_done_callback(lambda hh, rid=rid, inline=inline: done(rid, hh, inline))
                continue
            if op == "mirror":
                try:
                    send(("ok", rid, publisher.start(), None))  # after the whole index, on the same pair
                except Exception as exc:
                    send(("error", rid, f"{type(exc).__name__}: {exc}", None))
                continue
            try:
                if op not in ("close", "abandon"):  # the synchronous calls come on the calls pair
                    raise ValueError(f"unknown request {op!r}")
                (store.close if op == "close" else store.abandon)()
                send(("ok", rid, True, None))
                store = None
                break
            except Exception as exc:
                send(("error", rid, f"{type(exc).__name__}: {exc}", None))
    finally:
        publisher.stop()
        if store is not None:
            store.close()
        device.close()


def thread_role(name: str) -> str:
    """The role of a helper thread by its name: ``rx`` / ``tx`` (an NVMe/TCP queue's receive / send loop),
    ``batch`` (the store's batch workers: checksums, page bookkeeping), ``refresh`` (the index refresh and the
    publisher of its changes),
    ``main`` (requests from the owner, completions back, synchronous calls), else ``other`` (keep-alive, arena
    pre-fault, ...)."""
    if name.startswith("nvme-q"):
        return "rx" if name.endswith("-rx") else "tx" if name.endswith("-tx") else "other"
    if name.startswith("adpkv-store_"):
        return "batch"
    if name in ("adpkv-store-bg", "adpkv-store-mirror"):
        return "refresh"
    if name in ("MainThread", "adpkv-store-calls"):
        return "main"
    return "other"


def thread_cpu() -> dict[str, tuple[float, float]]:
    """This process's CPU seconds by thread role (:func:`thread_role`), ``{role: (user, system)}``, from
    /proc/self/task (threads that ended are not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for t in threading.enumerate():
        tid = t.native_id
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        role = thread_role(t.name)
        u, sy = out.get(role, (0.0, 0.0))
        out[role] = (u + int(fields[11]) / tick, sy + int(fields[12]) / tick)
    return out


def main(argv: list[str]) -> None:
    # Ctrl-C in the engine's terminal reaches this process group too: the owner ends the helper (closing the socket
    # or asking it to close), so that the store is closed in order and no replacement is started mid-shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock_fd, calls_fd, arena_fd, arena_bytes = (int(x) for x in argv)
    conn, calls = Connection(sock_fd), Connection(calls_fd)
    arena = memoryview(mmap.mmap(arena_fd, arena_bytes))
    populator = ArenaPopulator(arena)
    populator.start()
    try:
        _serve(conn, calls, arena, populator)
    finally:
        conn.close()
        calls.close()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("ADP_KV_STORE_LOG", "WARNING"))
    main(sys.argv[1:])
    os._exit(0)  # the store's daemon threads are done; skip interpreter teardown
