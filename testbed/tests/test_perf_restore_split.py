"""scripts/perf_restore_split.py: helpers found among the processes of a perf dump, their samples split by category."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf_restore_split.py"
_spec = importlib.util.spec_from_file_location("perf_restore_split", SCRIPT)
assert _spec is not None and _spec.loader is not None
split_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(split_mod)

DUMP = """\
 100/101   10.000: ffffffff8100 _copy_to_iter+0x6 ([kernel.kallsyms])
 100/101   10.100: 7f00 XXH3_update_avx512+0x1 (/x/_xxhash.so)
 100/102   10.200: 7f01 _PyEval_EvalFrameDefault+0x2 (/x/libpython3.11.so)
 100/102   10.300: ffffffff8200 tcp_recvmsg_locked+0x2 ([kernel.kallsyms])
 100/101   10.400: ffffffff8100 _copy_to_iter+0x6 ([kernel.kallsyms])
 100/101   11.000: 7f01 _PyEval_EvalFrameDefault+0x2 (/x/libpython3.11.so)
 200/201   10.050: ffffffff8100 _copy_to_iter+0x6 ([kernel.kallsyms])
 200/201   10.060: ffffffff8300 shmem_get_folio_gfp+0x6 ([kernel.kallsyms])
 300/301   10.050: ffffffff8100 _copy_from_iter+0x6 ([kernel.kallsyms])
 300/301   10.070: ffffffff8100 _copy_from_iter+0x6 ([kernel.kallsyms])
 300/301   10.080: 7f00 XXH3_update_avx512+0x1 (/x/_xxhash.so)
"""


def test_helpers_are_the_processes_that_receive_and_checksum() -> None:
    samples = split_mod.parse(DUMP.splitlines())
    # 200 receives without checksums (a target), 300 checksums and sends (a writer): neither is a restore helper
    assert split_mod.helper_pids(samples) == {"100"}


def test_samples_inside_the_receive_window_are_split_by_category() -> None:
    counts, total, window = split_mod.split(split_mod.parse(DUMP.splitlines()), {"100"})
    assert total == 5 and round(window, 3) == 0.4  # the sample at 11.0 s is after the last receive copy
    assert counts == {"socket receive copy": 2, "page checksum (XXH3)": 1, "Python interpreter and objects": 1,
                      "TCP/IP stack and softirq": 1}


def test_the_command_prints_the_table_and_refuses_a_dump_without_helpers(tmp_path: Path) -> None:
    dump = tmp_path / "perf.script"
    dump.write_text(DUMP)
    r = subprocess.run([sys.executable, str(SCRIPT), str(dump)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "| socket receive copy | 2 | 40.0% |" in r.stdout
    dump.write_text("\n".join(line for line in DUMP.splitlines() if not line.startswith(" 100/")))
    r = subprocess.run([sys.executable, str(SCRIPT), str(dump)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no process both receives pages and checksums them" in r.stderr
