"""StagingPool: slabs are reused, capped, and let go when still in use."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from adp_connector.vllm.staging import StagingPool  # noqa: E402


def test_slabs_are_reused_up_to_the_cap() -> None:
    pool = StagingPool(slab_bytes=1024, max_bytes=2048, pinned=False)
    a, b = pool.take(1000), pool.take(1024)
    assert a.numel() == b.numel() == 1024 and pool.allocated_bytes == 2048
    c = pool.take(10)  # over the cap: a temporary buffer of the asked size
    assert c.numel() == 10 and pool.temporary == 1
    big = pool.take(4096)  # larger than a slab: temporary as well
    assert big.numel() == 4096 and pool.temporary == 2
    pool.give(c)
    pool.give(big)  # temporary ones are dropped
    pool.give(a)
    assert pool.take(512).data_ptr() == a.data_ptr()  # the same slab again
    assert pool.take(8).numel() == 8  # b still out, a taken again: the cap holds
    pool.give(b)
    pool.give(b)  # a double give does not grow the free list beyond the slabs allocated
    assert pool.take(8).data_ptr() == b.data_ptr()
    assert pool.take(8).numel() == 8


def test_bad_slab_size_is_refused() -> None:
    with pytest.raises(ValueError):
        StagingPool(slab_bytes=0, max_bytes=1, pinned=False)


def test_slabs_are_carved_from_a_shared_arena() -> None:
    from adp_connector.store.process import SharedArena

    arena = SharedArena(3 * 1024 + 100)
    t = torch.frombuffer(arena.map, dtype=torch.int8)
    pool = StagingPool(slab_bytes=1024, max_bytes=0, pinned=False, arena=t)
    assert pool.max_slabs == 3
    slabs = [pool.take(1024) for _ in range(3)]
    assert [arena.locate(s.numpy()) for s in slabs] == [(0, 1024), (1024, 1024), (2048, 1024)]
    extra = pool.take(8)  # the arena is used up: a temporary buffer outside it
    assert arena.locate(extra.numpy()) is None and pool.temporary == 1
    pool.give(slabs[1])
    assert pool.take(10).data_ptr() == slabs[1].data_ptr()
    del slabs, extra, t


def test_the_pipelines_import_no_vllm() -> None:
    """adp_connector.pipeline is vLLM-free (torch only); the connector front, by contrast, loads vLLM."""
    import subprocess
    import sys

    # the answer on a line of its own: importing vLLM may print its own log lines to stdout (0.26 does)
    probe = "import sys, importlib; importlib.import_module({!r}); print('vllm loaded:', 'vllm' in sys.modules)"
    mods = ("adp_connector.pipeline", "adp_connector.vllm.connector")
    out = [[ln for ln in subprocess.run([sys.executable, "-c", probe.format(m)], capture_output=True, text=True,
                                        check=True, timeout=120).stdout.splitlines() if ln.startswith("vllm loaded:")]
           for m in mods]
    assert out == [["vllm loaded: False"], ["vllm loaded: True"]]
