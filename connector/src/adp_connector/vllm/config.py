"""``kv_connector_extra_config`` options of the ADP connector, validated once at start-up.

Every option, its type and default lives in :data:`OPTIONS`; docs/connector.md carries the same table. Unknown keys
and ill-typed values raise :class:`ConfigError` naming the key, so a typo fails the engine start instead of silently
turning the cache off.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


class ConfigError(ValueError):
    """An invalid ``kv_connector_extra_config``."""


@dataclass(frozen=True)
class ADPConfig:
    """Validated connector options (see :data:`OPTIONS` for the meaning of each field)."""

    traddr: str = "127.0.0.1"
    trsvcid: int = 4420
    subnqn: str | None = None
    io_queues: int = 4
    queue_depth: int = 64
    verify: bool = True
    format_card: bool = False
    load: bool = True
    save: bool = True
    model_id: str | None = None
    namespace_extra: str = ""
    connect_timeout_s: float = 5.0
    retry_interval_s: float = 5.0
    load_timeout_s: float = 30.0
    refresh_interval_s: float = 1.0
    max_pending_save_mb: int = 4096
    staging_mb: int = 4096
    save_spill_mb: int | None = None
    read_ahead_mb: int | None = None
    restore_batches: int | None = None
    min_hit_blocks: int = 1
    min_load_tokens: int = 0
    restore_policy: str = "auto"
    restore_prior_gbps: float = 4.0
    restore_stream_priority: str = "high"
    page_copy: str = "fused"
    switch_interval_ms: float = 0.0
    io_threads: int = 2
    io_process: bool = True
    lookup_mirror: bool = True
    load_processes: int = 1
    save_processes: int = 1
    max_io_kib: int = 0
    eviction: str = "slru"
    admission: str = "frequency"
    store_drafter_kv: bool = True
    audit_path: str | None = None
    stats_path: str | None = None


# name -> (accepted python types, one-line description); defaults come from ADPConfig.
OPTIONS: dict[str, tuple[tuple[type, ...], str]] = {
    "traddr": ((str,), "NVMe/TCP target address (IP or host name)"),
    "trsvcid": ((int,), "NVMe/TCP target port"),
    "subnqn": ((str, type(None)), "subsystem NQN; null asks the discovery controller at traddr:trsvcid"),
    "io_queues": ((int,), "NVMe I/O queues per connection (1..128)"),
    "queue_depth": ((int,), "commands per I/O queue (1..1023)"),
    "verify": ((bool,), "verify the payload checksum of every restored page (a mismatch -> recompute)"),
    "format_card": ((bool,), "format a namespace that holds data but no page store, or a page store of another "
                             "format version (its content is lost); without it such a card is refused"),
    "load": ((bool,), "restore pages (false: write-only cache)"),
    "save": ((bool,), "write pages (false: read-only cache, e.g. a consumer of a shared card)"),
    "model_id": ((str, type(None)), "model identity in the page namespace; null: the model path/name. Set it when "
                 "weights change under the same name"),
    "namespace_extra": ((str,), "free text mixed into the namespace (e.g. a deployment or weights version)"),
    "connect_timeout_s": ((int, float), "connect timeout; the engine serves without a cache meanwhile"),
    "retry_interval_s": ((int, float), "seconds between reconnect attempts while the target is unreachable"),
    "load_timeout_s": ((int, float), "a restore that makes no progress for this long fails (-> recompute): a batch "
                       "in flight not landed, or a wait for staging while no restore lands"),
    "refresh_interval_s": ((int, float), "scheduler: re-read other writers' slot tables this often (0: never)"),
    "max_pending_save_mb": ((int,), "staged bytes of saves in flight; beyond it new saves wait "
                            "(save_spill_mb)"),
    "staging_mb": ((int,), "host staging memory for page I/O (pinned when the KV cache is on a GPU; shared with the "
                   "I/O helper): restores stream through it; with io_process a save finding it full waits "
                   "(save_spill_mb), without it uses a temporary unpinned buffer"),
    "save_spill_mb": ((int, type(None)), "memory on the KV cache's device for copies of the pages of saves that "
                      "wait for staging or for max_pending_save_mb (a burst of prefills faster than the card "
                      "writes): staged oldest first as room comes back; a save finding it full too is dropped "
                      "(counted); 0: drop at once; null: derived when the KV cache registers (GPU: min(24 GiB, "
                      "half of its free memory); CPU: staging_mb)"),
    "read_ahead_mb": ((int, type(None)), "staging that read-aheads may hold: the pages of a request waiting for GPU "
                      "blocks (vLLM asks the connector about the request at the head of its queue every step) are "
                      "read from the card into staging before its blocks exist, so its restore only copies them into "
                      "place; only with slabs no restore waits for; 0: off; null: three quarters of staging_mb"),
    "restore_batches": ((int, type(None)), "restore batches (staging slabs of 64 MiB) in flight at once across the "
                        "worker's restores, queued in the helpers beyond what they run; the last of a restore wait "
                        "behind them. null: 4 per batch the helpers run at once (4 x max(load_processes, "
                        "save_processes) x io_threads: 96 with a 16-core GPU host's defaults)"),
    "min_hit_blocks": ((int,), "ignore external hits shorter than this many blocks"),
    "min_load_tokens": ((int,), "no restore (and no extra engine step) when it adds fewer tokens than this beyond "
                        "the local prefix hit: they are recomputed (0: any gain of a block or more)"),
    "restore_policy": ((str,), "auto: restore a hit only while the card, with the restores ahead of it, delivers it "
                       "sooner than the GPU recomputes it with the prefills ahead of it, plus the delay a recompute "
                       "adds to the other requests on the GPU (both rates measured by this engine; declined hits "
                       "counted in restores_declined); always: restore every hit"),
    "restore_prior_gbps": ((int, float), "auto: the restore throughput (GB/s) assumed until this engine measured four "
                           "restores (0: restore every hit until then)"),
    "restore_stream_priority": ((str,), "GPU: high: restored pages are copied into the KV cache on a CUDA stream of "
                                "a higher priority than the engine's compute (its kernels start ahead of queued "
                                "prefill kernels); normal: the compute stream's priority"),
    "page_copy": ((str,), "GPU: fused: a batch of pages moves between staging and every layer of the KV cache in one "
                  "Triton kernel launch (restores and saves; layer by layer where the layout or the host does not "
                  "allow it, logged); per_layer: tensor calls per layer"),
    "switch_interval_ms": ((int, float), "GPU worker: set the engine process's interpreter switch interval "
                           "(sys.setswitchinterval; Python's default 5 ms) when the KV cache registers: how long the "
                           "restore driver waits for the interpreter lock that vLLM's step loop holds, after each "
                           "copy launch; 0: leave it as it is"),
    "io_threads": ((int,), "concurrent store batches per process"),
    "io_process": ((bool,), "worker: run page I/O (NVMe/TCP, checksums) in a helper process that shares the "
                   "staging memory, off the engine process's interpreter lock; false: in the engine process"),
    "lookup_mirror": ((bool,), "scheduler, with io_process: keep a copy of the lookup helper's index in the "
                      "engine process, updated by the helper after each refresh, so a lookup makes no round trip; "
                      "false: every lookup asks the helper"),
    "load_processes": ((int,), "worker, with io_process: helper processes restores are spread over (1 writer + "
                       "read-only helpers, each with its own NVMe/TCP connection)"),
    "save_processes": ((int,), "worker, with io_process: writer helpers saves are spread over (1..16; a key always "
                       "goes to the same one, each holds its own writer slot on the card; they serve restores too, "
                       "so the helpers are max(load_processes, save_processes))"),
    "max_io_kib": ((int,), "split device commands at this size (0: the controller's MDTS)"),
    "eviction": ((str,), "which own pages a writer evicts when the card is full: slru: pages never restored "
                 "first, pages restored at least once (up to 80% of its pages) only after them; lru: the least "
                 "recently used. Either way a prefix loses its last pages first"),
    "admission": ((str,), "whether a new page may evict one when the card is full: frequency: only if it was asked "
                  "for (saved or read back) more often than the page it would evict, so a working set larger than "
                  "the card keeps a stable part on it instead of evicting what is read next (declined pages: "
                  "saves_not_admitted); a page untouched past twice the reuse seen lately, or past twice its own "
                  "reuse cycle and a card of asks, goes whatever its count; always: every new page evicts the "
                  "next victim"),
    "store_drafter_kv": ((bool,), "speculative decoding (MTP/EAGLE heads in the target's KV-cache group): store the "
                         "drafter layers' KV in the pages, so a restore keeps the acceptance rate (a hit then ends "
                         "where the next stored page begins); false: pages without them, shared by engines with "
                         "speculation on or off, the drafter's KV of restored blocks zero-filled"),
    "audit_path": ((str, type(None)), "test/acceptance only: directory where every saved and restored page's "
                   "digest and the connector counters are recorded"),
    "stats_path": ((str, type(None)), "directory where the connector's counters are kept as running totals "
                   "(stats-<role>-<pid>.json, replaced whole as they change), without audit_path's page digests: "
                   "for runs whose vLLM drops the counters of steps without outputs (the 0.26 LLM class)"),
}

_POSITIVE = {"trsvcid", "io_queues", "queue_depth", "io_threads", "min_hit_blocks", "load_processes",
             "save_processes", "restore_batches"}
_NON_NEGATIVE = {"connect_timeout_s", "retry_interval_s", "load_timeout_s", "refresh_interval_s",
                 "max_pending_save_mb", "max_io_kib", "staging_mb", "min_load_tokens", "restore_prior_gbps",
                 "switch_interval_ms", "save_spill_mb", "read_ahead_mb"}


MAX_SAVE_PROCESSES = 16  # a card formatted by the store has 16 writer slots; each writer helper holds one
RESTORE_POLICIES = ("auto", "always")
RESTORE_STREAM_PRIORITIES = ("high", "normal")
PAGE_COPIES = ("fused", "per_layer")
EVICTIONS = ("slru", "lru")  # StoreConfig.eviction (the store's EVICTION_POLICIES; no store import here)
ADMISSIONS = ("frequency", "always")  # StoreConfig.admission (the store's ADMISSION_POLICIES)
MIN_IO_KIB = 4  # the largest LBA size the page store runs on (4 KiB; 512 B devices need no more)

# Options whose default comes from the host (host_defaults) when kv_connector_extra_config leaves them out.
HOST_DERIVED = {
    "load_processes": "host: min(12, 3 * cores // 4) with a CUDA GPU, else 1",
    "io_queues": "host: 2 with a CUDA GPU (many helpers of 2 queues), else 4",
    "save_processes": "host: min(2, load_processes) with a CUDA GPU, else 1",
    "staging_mb": "host: RAM / 16, within 1024..8192",
    "max_pending_save_mb": "max(4096, staging_mb)",
}


def cuda_gpu_present() -> bool:
    """A CUDA GPU this process may use (the NVIDIA driver lists one and CUDA_VISIBLE_DEVICES does not hide it);
    no CUDA initialisation (config is parsed in every vLLM process, some of which must not touch the GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def host_defaults(cpu_count: int | None = None, gpu: bool | None = None,
                  ram_bytes: int | None = None) -> dict[str, int]:
    """Defaults for :data:`HOST_DERIVED` on this host (or the one described).

    Restores (GPU run 11 on the H200, 16 cores, docs/benchmarks.md): the restore path rose with the helper count at
    2 queues each (8 target workers: 4 / 8 / 12 helpers 7.1 / 9.0 / 12.4 GB/s into GPU memory; 4 helpers of 4
    queues 10.2), and the 8-agent run with 12 helpers of 2 queues reached 13.2 tok/s per agent with no save dropped,
    against 12.0 and 8% dropped with the earlier 4 helpers of 4 queues. A helper is busy only while a restore
    runs, so a GPU host gets one per 4/3 core, up to 12, each with 2 queues. Without a GPU the engine computes on
    the cores itself: one helper with 4 queues. Staging is 1/16 of the RAM, 1-8 GiB (GPU run 7 dropped saves for
    want of staging at 8 agents with 4 GiB, where one 40k-token prefill produces 5 GB of pages in about 1.5 s).
    Saves: one writer helper saved 3.9 GB/s, two 8.0 GB/s (2.05x), four 8.5 GB/s (2.19x; GPU run 7), while 8 agents
    produce ~3 GB/s of KV: a GPU host gets two writers (``save_processes``; each holds one of the card's 16 writer
    slots), never more than its restore helpers.
    """
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    has_gpu = cuda_gpu_present() if gpu is None else gpu
    ram = _ram_bytes() if ram_bytes is None else ram_bytes
    load = max(1, min(12, 3 * (cpus or 1) // 4)) if has_gpu else 1
    return {"load_processes": load, "save_processes": min(2, load) if has_gpu else 1,
            "io_queues": 2 if has_gpu else 4, "staging_mb": max(1024, min(8192, (ram >> 20) // 16))}


def parse_config(extra: Mapping[str, Any] | None) -> ADPConfig:
    """Validate ``kv_connector_extra_config`` and return an :class:`ADPConfig` (raises :class:`ConfigError`)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(OPTIONS), key=str)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), list(OPTIONS), n=1, cutoff=0.6)
            hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
        raise ConfigError(f"ADPConnector: unknown kv_connector_extra_config key(s) {', '.join(hints)}; "
                          f"valid keys: {', '.join(OPTIONS)}")
    values: dict[str, Any] = {}
    for f in fields(ADPConfig):
        if f.name not in extra:
            continue
        v = extra[f.name]
        types, _ = OPTIONS[f.name]
        # bool is an int subclass: refuse True for an int option and 1 for a bool option.
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"ADPConnector: kv_connector_extra_config[{f.name!r}] must be {names}, "
                              f"got {v!r} ({type(v).__name__})")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"ADPConnector: kv_connector_extra_config[{f.name!r}] must be a finite number, "
                              f"got {v!r}")
        if f.name in _POSITIVE and v is not None and v <= 0:
            raise ConfigError(f"ADPConnector: kv_connector_extra_config[{f.name!r}] must be > 0, got {v!r}")
        if f.name in _NON_NEGATIVE and v is not None and v < 0:
            raise ConfigError(f"ADPConnector: kv_connector_extra_config[{f.name!r}] must be >= 0, got {v!r}")
        values[f.name] = float(v) if float in types and not isinstance(v, bool) else v
    for name, value in host_defaults().items():
        values.setdefault(name, value)
    if "max_pending_save_mb" not in extra and "staging_mb" in values:
        values["max_pending_save_mb"] = max(ADPConfig.max_pending_save_mb, values["staging_mb"])
    if "save_processes" not in extra and "save_processes" in values:  # a derived default: never more writers
        values["save_processes"] = min(values["save_processes"], values.get("load_processes", 1))  # than helpers
    cfg = ADPConfig(**values)
    if cfg.io_queues > 128 or cfg.queue_depth > 1023:
        raise ConfigError("ADPConnector: io_queues must be <= 128 and queue_depth <= 1023")
    if cfg.save_processes > MAX_SAVE_PROCESSES:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['save_processes'] must be <= "
                          f"{MAX_SAVE_PROCESSES} (each writer holds one of the card's writer slots), "
                          f"got {cfg.save_processes}")
    if cfg.trsvcid > 65535:
        raise ConfigError(f"ADPConnector: trsvcid must be a TCP port, got {cfg.trsvcid}")
    if 0 < cfg.max_io_kib < MIN_IO_KIB:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['max_io_kib'] must be 0 (the controller's MDTS) "
                          f"or >= {MIN_IO_KIB} (a command moves whole 4 KiB LBAs), got {cfg.max_io_kib}")
    if not cfg.traddr:
        raise ConfigError("ADPConnector: traddr must not be empty")
    if cfg.restore_policy not in RESTORE_POLICIES:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['restore_policy'] must be one of "
                          f"{', '.join(RESTORE_POLICIES)}, got {cfg.restore_policy!r}")
    if cfg.restore_stream_priority not in RESTORE_STREAM_PRIORITIES:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['restore_stream_priority'] must be one of "
                          f"{', '.join(RESTORE_STREAM_PRIORITIES)}, got {cfg.restore_stream_priority!r}")
    if cfg.page_copy not in PAGE_COPIES:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['page_copy'] must be one of "
                          f"{', '.join(PAGE_COPIES)}, got {cfg.page_copy!r}")
    if cfg.eviction not in EVICTIONS:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['eviction'] must be one of "
                          f"{', '.join(EVICTIONS)}, got {cfg.eviction!r}")
    if cfg.admission not in ADMISSIONS:
        raise ConfigError(f"ADPConnector: kv_connector_extra_config['admission'] must be one of "
                          f"{', '.join(ADMISSIONS)}, got {cfg.admission!r}")
    return cfg


def options_table() -> str:
    """The options as a Markdown table (used to keep docs/connector.md in sync)."""
    defaults = {f.name: f.default for f in fields(ADPConfig)}
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, (types, desc) in OPTIONS.items():
        tname = " \\| ".join("null" if t is type(None) else t.__name__ for t in types)
        d = defaults[name]
        shown = f"`{'null' if d is None else str(d).lower() if isinstance(d, bool) else d}`"
        rows.append(f"| `{name}` | {tname} | {HOST_DERIVED.get(name, shown)} | {desc} |")
    return "\n".join(rows)
