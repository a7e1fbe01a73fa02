"""What the scheduler side sends the workers each step, and what the workers send back (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

PageRef = tuple[int, int, bytes]  # (group id, block id, page key)


@dataclass
class ADPMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's restores and saves (picklable)."""

    loads: dict[str, list[PageRef]] = field(default_factory=dict)
    zero: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # drafter (group, block) to zero-fill
    saves: list[PageRef] = field(default_factory=list)
    # vLLM 0.26: block ids a failed restore reports (get_block_ids_with_load_errors), from the first restored one
    load_blocks: dict[str, list[int]] = field(default_factory=dict)
    # TP > 1: the block hash behind each key of this step (keys are rank 0's; a worker of another rank derives its
    # own key for groups that differ per rank)
    block_hashes: dict[bytes, bytes] = field(default_factory=dict)
    # requests waiting for GPU blocks whose restore the workers may read ahead: (group id, page key) of its pages
    read_ahead: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    read_ahead_drop: list[str] = field(default_factory=list)  # read-aheads no restore will use (request finished)


class ADPWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: keys whose save failed (saved again later), requests whose restore failed
    (vLLM 0.26 has no ``failed_recving``: the scheduler side learns of them here), keys the card no longer
    serves though the scheduler's index may still list them (evicted, or missing at a restore): not offered
    again until the index has caught up, and saved again; and keys a full card declined: asked for again by the next
    request that computes them."""

    def __init__(self, failed_saves: list[bytes], failed_loads: list[str] | None = None,
                 lost: list[bytes] | None = None, declined: list[bytes] | None = None) -> None:
        self.failed_saves = failed_saves
        self.failed_loads = failed_loads or []
        self.lost = lost or []
        self.declined = declined or []

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return ADPWorkerMetadata(self.failed_saves + list(getattr(other, "failed_saves", ())),
                                 self.failed_loads + list(getattr(other, "failed_loads", ())),
                                 self.lost + list(getattr(other, "lost", ())),
                                 self.declined + list(getattr(other, "declined", ())))
