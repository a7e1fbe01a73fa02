"""``python -m adp_emulator serve ...``: run the userspace NVMe/TCP target in the foreground."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adp-emulator", description="ADP KV emulator (userspace NVMe/TCP target)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the target until SIGINT/SIGTERM")
    s.add_argument("--config", help="nvmetcli JSON (+ 'adp' section); other options override it")
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="TCP port (default 4420, 0 = any free port)")
    s.add_argument("--nqn", help="subsystem NQN")
    s.add_argument("--capacity", help="namespace size, e.g. 1G")
    s.add_argument("--lba-size", type=int, choices=(512, 4096))
    s.add_argument("--mdts", help="max data transfer size, e.g. 128K")
    s.add_argument("--queues", type=int, help="max I/O queues")
    s.add_argument("--queue-depth", type=int)
    s.add_argument("--backing", help="backing file (default: RAM)")
    s.add_argument("--allow-host", action="append", default=None, metavar="NQN", help="allowed host NQN (repeat)")
    s.add_argument("--allow-any-host", action="store_true", default=None)
    s.add_argument("--require-data-digest", action="store_true", default=None)
    s.add_argument("-v", "--verbose", action="store_true")
    return p


def _settings(args: argparse.Namespace) -> Any:
    from adp_emulator.target import TargetSettings, parse_size, settings_from_config

    kw: dict[str, Any] = {}
    for opt, key, conv in (("host", "host", str), ("port", "port", int), ("nqn", "subnqn", str),
                           ("capacity", "capacity_bytes", parse_size), ("lba_size", "lba_size", int),
                           ("mdts", "mdts_bytes", parse_size), ("queues", "max_io_queues", int),
                           ("queue_depth", "queue_depth", int), ("backing", "backing_path", str),
                           ("allow_host", "allowed_hosts", list), ("allow_any_host", "allow_any_host", bool),
                           ("require_data_digest", "require_data_digest", bool)):
        val = getattr(args, opt)
        if val is not None:
            kw[key] = conv(val)
    if args.config:
        from adp_emulator.config import load_config

        return settings_from_config(load_config(args.config), **kw)
    return TargetSettings(**kw)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from adp_emulator.target import UserspaceTarget

    try:
        settings = _settings(args)
    except ValueError as e:
        print(f"adp-emulator: {e}", file=sys.stderr)
        return 2
    target = UserspaceTarget(settings)
    try:
        target.start()
    except OSError as e:
        print(f"adp-emulator: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 1
    done = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    host, port = target.address
    print(f"ADP-EMULATOR READY {host} {port} {settings.subnqn}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        target.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
