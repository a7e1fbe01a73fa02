"""vLLM-free page pipelines: KV pages gathered from and scattered into block tensors, staged through host slabs,
saved and restored through a :class:`~adp_connector.store.api.Store`.

Torch is the only dependency above the store; ``adp_connector.vllm`` drives these from the engine's hooks and
``testbed bench restore-path`` drives :class:`RestorePipeline` directly.
"""

from .audit import PageAudit, write_totals
from .counters import Counters
from .pages import PagedKV, PageSink
from .restore import Cause, LoadChunk, LoadJob, RestorePipeline, failure_counter
from .save import SaveLedger, SavePipeline
from .staging import StagingPool

PageRef = tuple[int, int, bytes]  # (group id, block id, page key)

__all__ = [
           "Cause",
           "Counters",
           "LoadChunk",
           "LoadJob",
           "PageAudit",
           "PageRef",
           "PageSink",
           "PagedKV",
           "RestorePipeline",
           "SaveLedger",
           "SavePipeline",
           "StagingPool",
           "failure_counter",
           "write_totals",
]
