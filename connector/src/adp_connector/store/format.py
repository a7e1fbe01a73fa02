"""On-device format v1.0 of the page store: structures, geometry and checksums (see docs/format.md).

All integers are little-endian and at most 64 bits wide; no field narrower than 32 bits holds a size, count,
offset or sequence. Every record carries a CRC32C; records other than the superblock seed it with the store UUID so
entries left over from an earlier format of the same namespace never validate.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c
import xxhash

FORMAT_MAJOR = 1
FORMAT_MINOR = 0
SB_MAGIC = b"ADPKVPS1"
LEASE_MAGIC = b"ADPLEASE"
PAGE_MAGIC = b"ADPKVPG1"
CHECKSUM_XXH3_128 = 1
META_ALIGN = 4096
SLOT_ENTRY_BYTES = 64
RECORD_BYTES = 128  # superblock body (256 incl. reserved), lease record and page header use their first 128 bytes
SLOT_VALID = 1
LEASE_FREE = 0
LEASE_HELD = 1

# magic, major, minor, lba, header_bytes, capacity, uuid, created_ns, partitions, slot_entry_bytes,
# lease_off, lease_rec_bytes, parts_off, part_stride, slots_per_part, slot_table_bytes, data_bytes, algo, flags
_SB = struct.Struct("<8sIIIIQ16sQIIQQQQQQQII")
_SB_CRC_AT = 252
SUPERBLOCK_BYTES = 256
# magic, partition, state, writer_id, instance, generation, heartbeat_ns, ttl_ns, label, reserved
_LEASE = struct.Struct("<8sII16s16sQQQ48sI")
# key, seq, lba, length, flags
_SLOT = struct.Struct("<32sQQQI")
# magic, key, seq, length, lba, partition, algo, checksum, generation, created_ns, reserved
_HDR = struct.Struct("<8s32sQQQII16sQQ20s")
assert _SB.size == 128 and _LEASE.size == 124 and _SLOT.size == 60 and _HDR.size == 124


class FormatError(Exception):
    """The device does not hold a valid store of a supported version."""


def align_up(x: int, a: int) -> int:
    """Round ``x`` up to a multiple of ``a``."""
    return -(-x // a) * a


def align_down(x: int, a: int) -> int:
    """Round ``x`` down to a multiple of ``a``."""
    return x // a * a


def seeded_crc(seed: int, data: bytes | memoryview) -> int:
    """CRC32C of ``data`` continued from ``seed`` (the CRC32C of the store UUID)."""
    return crc32c.crc32c(data, seed)


def page_checksum(key: bytes, seq: int, length: int, payload: bytes | bytearray | memoryview,
                  *more: bytes | bytearray | memoryview) -> bytes:
    """XXH3-128 over ``key || seq || length || payload`` (binds the bytes to the key and the version).

    ``more`` continues the payload (a page read as body and tail hashes as if it were one buffer).
    """
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(struct.pack("<QQ", seq, length))
    h.update(payload)
    for part in more:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class Geometry:
    """Where everything lives on the namespace; all values are bytes unless named ``*_lba``."""

    lba_size: int
    capacity_bytes: int
    store_uuid: bytes
    created_ns: int
    partitions: int
    lease_table_offset: int
    lease_record_bytes: int
    partitions_offset: int
    partition_stride: int
    slots_per_partition: int
    slot_table_bytes: int
    data_bytes: int
    header_bytes: int

    @property
    def crc_seed(self) -> int:
        """CRC32C of the store UUID, the seed of every non-superblock record CRC."""
        return crc32c.crc32c(self.store_uuid)

    def partition_base(self, p: int) -> int:
        """Byte offset of partition ``p`` (its slot table)."""
        return self.partitions_offset + p * self.partition_stride

    def data_start_lba(self, p: int) -> int:
        """First LBA of the data area of partition ``p``."""
        return (self.partition_base(p) + self.slot_table_bytes) // self.lba_size

    @property
    def data_lbas(self) -> int:
        """LBAs in the data area of one partition."""
        return self.data_bytes // self.lba_size

    def lease_offset(self, p: int) -> int:
        """Byte offset of the lease record of partition ``p``."""
        return self.lease_table_offset + p * self.lease_record_bytes

    def page_lbas(self, length: int) -> int:
        """LBAs a page of ``length`` payload bytes occupies: one header block plus the padded payload."""
        return 1 + -(-length // self.lba_size)


def compute_geometry(capacity: int, lba: int, partitions: int, slots_per_partition: int | None,
                     avg_page_bytes: int, store_uuid: bytes, created_ns: int) -> Geometry:
    """Lay out a namespace of ``capacity`` bytes; raises ValueError if it is too small."""
    if partitions < 1:
        raise ValueError("need at least one partition")
    unit = align_up(META_ALIGN, lba)
    lease_off = unit
    parts_off = lease_off + align_up(partitions * lba, unit)
    stride = align_down((capacity - parts_off) // partitions, unit) if capacity > parts_off else 0
    if slots_per_partition is None:
        slots_per_partition = max(16, stride // max(avg_page_bytes + lba, lba))
    slot_table = align_up(slots_per_partition * SLOT_ENTRY_BYTES, unit)
    slots_per_partition = slot_table // SLOT_ENTRY_BYTES
    data = stride - slot_table
    if data < 2 * lba:
        raise ValueError(f"namespace of {capacity} bytes too small for {partitions} partitions")
    return Geometry(lba, capacity, store_uuid, created_ns, partitions, lease_off, lba, parts_off, stride,
                    slots_per_partition, slot_table, data, lba)


def pack_superblock(g: Geometry) -> bytes:
    """The superblock: 252 bytes of fields/reserved then CRC32C of them."""
    body = _SB.pack(SB_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, g.lba_size, g.header_bytes, g.capacity_bytes,
                    g.store_uuid, g.created_ns, g.partitions, SLOT_ENTRY_BYTES, g.lease_table_offset,
                    g.lease_record_bytes, g.partitions_offset, g.partition_stride, g.slots_per_partition,
                    g.slot_table_bytes, g.data_bytes, CHECKSUM_XXH3_128, 0)
    body = body.ljust(_SB_CRC_AT, b"\0")
    return body + struct.pack("<I", crc32c.crc32c(body))


def unpack_superblock(raw: bytes | memoryview) -> Geometry:
    """Parse and validate a superblock; raises FormatError."""
    raw = bytes(raw[:SUPERBLOCK_BYTES])
    if raw[:8] != SB_MAGIC:
        raise FormatError("no page-store superblock (bad magic)")
    (crc,) = struct.unpack_from("<I", raw, _SB_CRC_AT)
    if crc32c.crc32c(raw[:_SB_CRC_AT]) != crc:
        raise FormatError("superblock checksum mismatch")
    (_, major, _minor, lba, hdr, cap, uuid, created, parts, seb, lease_off, lease_rec, parts_off, stride, slots,
     slot_table, data, algo, _flags) = _SB.unpack_from(raw)
    if major != FORMAT_MAJOR:
        raise FormatError(f"unsupported format major version {major}")
    if seb != SLOT_ENTRY_BYTES or algo != CHECKSUM_XXH3_128:
        raise FormatError("unsupported slot entry size or checksum algorithm")
    return Geometry(lba, cap, uuid, created, parts, lease_off, lease_rec, parts_off, stride, slots, slot_table,
                    data, hdr)


@dataclass(frozen=True)
class LeaseRecord:
    """Ownership record of one writer partition."""

    partition: int
    state: int
    writer_id: bytes
    instance: bytes
    generation: int
    heartbeat_ns: int
    ttl_ns: int
    label: str = ""

    def expired(self, now_ns: int) -> bool:
        """True when the holder missed its heartbeat deadline (or the record is free)."""
        return self.state != LEASE_HELD or self.heartbeat_ns + self.ttl_ns < now_ns


def pack_lease(rec: LeaseRecord, seed: int) -> bytes:
    """A 128-byte lease record (the caller pads it to one LBA)."""
    body = _LEASE.pack(LEASE_MAGIC, rec.partition, rec.state, rec.writer_id, rec.instance, rec.generation,
                       rec.heartbeat_ns, rec.ttl_ns, rec.label.encode()[:48], 0)
    return body + struct.pack("<I", seeded_crc(seed, body))


def unpack_lease(raw: bytes | memoryview, seed: int) -> LeaseRecord | None:
    """Parse a lease record; None if never written, torn or from another format."""
    raw = bytes(raw[:RECORD_BYTES])
    if raw[:8] != LEASE_MAGIC:
        return None
    (crc,) = struct.unpack_from("<I", raw, _LEASE.size)
    if seeded_crc(seed, raw[:_LEASE.size]) != crc:
        return None
    _, part, state, wid, inst, gen, hb, ttl, label, _ = _LEASE.unpack_from(raw)
    return LeaseRecord(part, state, wid, inst, gen, hb, ttl, label.rstrip(b"\0").decode(errors="replace"))


@dataclass(frozen=True)
class SlotEntry:
    """Commit record of one page: where it lives and which version it is."""

    key: bytes
    seq: int
    lba: int
    length: int


def pack_slot(e: SlotEntry, seed: int) -> bytes:
    """A 64-byte slot entry."""
    body = _SLOT.pack(e.key, e.seq, e.lba, e.length, SLOT_VALID)
    return body + struct.pack("<I", seeded_crc(seed, body))


EMPTY_SLOT = bytes(SLOT_ENTRY_BYTES)


def unpack_slots(raw: bytes | memoryview, seed: int, first_slot: int = 0) -> list[tuple[int, SlotEntry]]:
    """All valid entries in a run of slot-table bytes, as (slot index, entry)."""
    out: list[tuple[int, SlotEntry]] = []
    mv = memoryview(raw)
    n = len(mv) // SLOT_ENTRY_BYTES
    chunk = 4096
    zero = bytes(chunk)
    for c0 in range(0, n * SLOT_ENTRY_BYTES, chunk):
        block = mv[c0:c0 + chunk]
        if block == zero[:len(block)]:
            continue
        for off in range(0, len(block) - SLOT_ENTRY_BYTES + 1, SLOT_ENTRY_BYTES):
            ent = block[off:off + SLOT_ENTRY_BYTES]
            if ent[56] & SLOT_VALID == 0:
                continue
            (crc,) = struct.unpack_from("<I", ent, _SLOT.size)
            if seeded_crc(seed, ent[:_SLOT.size]) != crc:
                continue
            key, seq, lba, length, _flags = _SLOT.unpack_from(ent)
            if seq == 0:
                continue
            out.append((first_slot + (c0 + off) // SLOT_ENTRY_BYTES, SlotEntry(key, seq, lba, length)))
    return out


@dataclass(frozen=True)
class PageHeader:
    """The LBA-aligned block in front of every payload."""

    key: bytes
    seq: int
    length: int
    lba: int
    partition: int
    checksum: bytes
    generation: int
    created_ns: int


def pack_header(h: PageHeader, seed: int) -> bytes:
    """A 128-byte page header (padded to one LBA by the caller)."""
    body = _HDR.pack(PAGE_MAGIC, h.key, h.seq, h.length, h.lba, h.partition, CHECKSUM_XXH3_128, h.checksum,
                     h.generation, h.created_ns, b"")
    return body + struct.pack("<I", seeded_crc(seed, body))


def unpack_header(raw: bytes | memoryview, seed: int) -> PageHeader | None:
    """Parse a page header; None if absent, torn or foreign."""
    raw = bytes(raw[:RECORD_BYTES])
    if raw[:8] != PAGE_MAGIC:
        return None
    (crc,) = struct.unpack_from("<I", raw, _HDR.size)
    if seeded_crc(seed, raw[:_HDR.size]) != crc:
        return None
    _, key, seq, length, lba, part, algo, cks, gen, created, _ = _HDR.unpack_from(raw)
    if algo != CHECKSUM_XXH3_128:
        return None
    return PageHeader(key, seq, length, lba, part, cks, gen, created)
