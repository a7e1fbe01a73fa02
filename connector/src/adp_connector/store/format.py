"""On-device format v2.0 of the page store: structures, geometry and checksums (see docs/format.md).

All integers are little-endian and at most 64 bits wide; no field narrower than 32 bits holds a size, count,
offset or sequence. Every record carries a CRC32C; records other than the superblock seed it with the store UUID so
entries left over from an earlier format of the same namespace never validate.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import crc32c
import xxhash

FORMAT_MAJOR = 2
FORMAT_MINOR = 0
SB_MAGIC = b"ADPKVPS1"  # the same in every major version: a store of another version is recognised, not formatted
LEASE_MAGIC = b"ADPLEASE"
SEGMENT_MAGIC = b"ADPKVSEG"
PAGE_MAGIC = b"ADPKVPG1"
CHECKSUM_XXH3_128 = 1
META_ALIGN = 4096
SLOT_ENTRY_BYTES = 64
RECORD_BYTES = 128  # superblock body (256 incl. reserved), lease, segment record and page header use 128 bytes
SLOT_VALID = 1
LEASE_FREE = 0
LEASE_HELD = 1
SEGMENT_FREE = 0
SEGMENT_OWNED = 1
MAX_DEFAULT_SEGMENTS = 1024
MIN_DEFAULT_SEGMENT_BYTES = 64 << 20  # a segment holds the largest page (multi-MiB Mamba states) many times over

# magic, major, minor, lba, header_bytes, capacity, uuid, created_ns, writers, slot_entry_bytes,
# lease_off, lease_rec_bytes, segtab_off, seg_rec_bytes, segments_off, segment_stride, segments,
# slots_per_segment, slot_table_bytes, data_bytes, algo, flags
_SB = struct.Struct("<8sIIIIQ16sQIIQQQQQQQQQQII")
_SB_V1_MAJOR_AT = 8
_SB_CRC_AT = 252
SUPERBLOCK_BYTES = 256
# magic, writer slot, state, writer_id, instance, generation, heartbeat_ns, ttl_ns, label, wanted segments
_LEASE = struct.Struct("<8sII16s16sQQQ48sI")
# magic, segment, state, owner writer slot, reserved, writer_id, owner generation, claimed_ns, reserved
_SEG = struct.Struct("<8sIIII16sQQ68s")
# key, seq, lba, length, flags
_SLOT = struct.Struct("<32sQQQI")
# magic, key, seq, length, lba, segment, algo, checksum, generation, created_ns, reserved
_HDR = struct.Struct("<8s32sQQQII16sQQ20s")
assert _SB.size == 152 and _LEASE.size == 124 and _SEG.size == 124 and _SLOT.size == 60 and _HDR.size == 124


class FormatError(Exception):
    """The device does not hold a valid store of a supported version."""


class FormatVersionError(FormatError):
    """The device holds a page store of another format version (never formatted over without ``reformat``)."""


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
    writers: int
    lease_table_offset: int
    lease_record_bytes: int
    segment_table_offset: int
    segment_record_bytes: int
    segments_offset: int
    segment_stride: int
    segments: int
    slots_per_segment: int
    slot_table_bytes: int
    data_bytes: int
    header_bytes: int

    @property
    def crc_seed(self) -> int:
        """CRC32C of the store UUID, the seed of every non-superblock record CRC."""
        return crc32c.crc32c(self.store_uuid)

    @property
    def partitions(self) -> int:
        """Writer slots (leases): the most writers that can hold the store at once (v1 name)."""
        return self.writers

    def segment_base(self, s: int) -> int:
        """Byte offset of segment ``s`` (its slot table)."""
        return self.segments_offset + s * self.segment_stride

    def data_start_lba(self, s: int) -> int:
        """First LBA of the data area of segment ``s``."""
        return (self.segment_base(s) + self.slot_table_bytes) // self.lba_size

    @property
    def data_lbas(self) -> int:
        """LBAs in the data area of one segment."""
        return self.data_bytes // self.lba_size

    @property
    def total_data_lbas(self) -> int:
        """LBAs of page data on the whole card (every segment's data area)."""
        return self.segments * self.data_lbas

    def lease_offset(self, w: int) -> int:
        """Byte offset of the lease record of writer slot ``w``."""
        return self.lease_table_offset + w * self.lease_record_bytes

    def segment_record_offset(self, s: int) -> int:
        """Byte offset of the ownership record of segment ``s``."""
        return self.segment_table_offset + s * self.segment_record_bytes

    def segment_of_lba(self, lba: int) -> int:
        """The segment whose data area holds ``lba`` (callers check the range)."""
        return (lba * self.lba_size - self.segments_offset) // self.segment_stride

    def page_lbas(self, length: int) -> int:
        """LBAs a page of ``length`` payload bytes occupies: one header block plus the padded payload."""
        return 1 + -(-length // self.lba_size)


def compute_geometry(capacity: int, lba: int, writers: int, slots_per_segment: int | None,
                     avg_page_bytes: int, store_uuid: bytes, created_ns: int,
                     segment_bytes: int | None = None) -> Geometry:
    """Lay out a namespace of ``capacity`` bytes; raises ValueError if it is too small.

    By default a segment is at least ``MIN_DEFAULT_SEGMENT_BYTES`` (on a small card: a quarter of a writer's share)
    and 16 pages of ``avg_page_bytes``, and there are at most ``MAX_DEFAULT_SEGMENTS`` of them; a card smaller than
    one segment is one segment.
    """
    if writers < 1:
        raise ValueError("need at least one writer slot")
    unit = align_up(META_ALIGN, lba)
    lease_off = unit
    segtab_off = lease_off + align_up(writers * lba, unit)
    page = max(avg_page_bytes + lba, lba)
    room = capacity - segtab_off
    if segment_bytes is None:
        stride = max(align_up(min(MIN_DEFAULT_SEGMENT_BYTES, room // (4 * writers)), unit),
                     align_up(16 * page + SLOT_ENTRY_BYTES * 16, unit),
                     align_up(-(-room // MAX_DEFAULT_SEGMENTS), unit))
    else:
        stride = align_up(segment_bytes, unit)
    stride = max(unit, min(stride, align_down(capacity - segtab_off - unit, unit)))  # a small card: one segment
    # each segment costs its stride plus one record (one LBA) in the segment table
    nseg = max(0, room // (stride + lba)) + 1
    while nseg > 0 and segtab_off + align_up(nseg * lba, unit) + nseg * stride > capacity:
        nseg -= 1
    segs_off = segtab_off + align_up(max(nseg, 1) * lba, unit)
    if slots_per_segment is None:
        slots_per_segment = max(16, stride // page)
    slot_table = align_up(slots_per_segment * SLOT_ENTRY_BYTES, unit)
    slots_per_segment = slot_table // SLOT_ENTRY_BYTES
    data = stride - slot_table
    if nseg < 1 or data < 2 * lba:
        raise ValueError(f"namespace of {capacity} bytes too small for one segment of {stride} bytes")
    return Geometry(lba, capacity, store_uuid, created_ns, writers, lease_off, lba, segtab_off, lba, segs_off,
                    stride, nseg, slots_per_segment, slot_table, data, lba)


def pack_superblock(g: Geometry) -> bytes:
    """The superblock: 252 bytes of fields/reserved then CRC32C of them."""
    body = _SB.pack(SB_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, g.lba_size, g.header_bytes, g.capacity_bytes,
                    g.store_uuid, g.created_ns, g.writers, SLOT_ENTRY_BYTES, g.lease_table_offset,
                    g.lease_record_bytes, g.segment_table_offset, g.segment_record_bytes, g.segments_offset,
                    g.segment_stride, g.segments, g.slots_per_segment, g.slot_table_bytes, g.data_bytes,
                    CHECKSUM_XXH3_128, 0)
    body = body.ljust(_SB_CRC_AT, b"\0")
    return body + struct.pack("<I", crc32c.crc32c(body))


REFORMAT_HINT = ("reopen with StoreConfig(reformat=True) (the connector's option format_card: true) to erase it and "
                 "format version 2")
PROBE_HEAD_BYTES = 1 << 20  # holds_data: the namespace's first MiB is read whole ...
PROBE_SAMPLES = 16  # ... and this many 4 KiB samples spread over the rest


class ForeignDataError(FormatError):
    """The device holds data but no page store (never formatted over without ``reformat``)."""


def holds_data(read: Callable[[int, int], bytes], capacity: int) -> bool:
    """Whether a namespace without a superblock holds data, as far as a quick look tells: a non-zero byte in its
    first MiB or in :data:`PROBE_SAMPLES` spread 4 KiB samples (``read(offset, length)`` reads the device)."""
    head = min(PROBE_HEAD_BYTES, capacity)
    if any(read(0, head)):
        return True
    step = max(capacity // PROBE_SAMPLES, 4096) // 4096 * 4096
    return any(any(read(off, 4096)) for off in range(head // 4096 * 4096, capacity - 4096 + 1, step))


def unpack_superblock(raw: bytes | memoryview) -> Geometry:
    """Parse and validate a superblock; raises FormatError (FormatVersionError for another major version)."""
    raw = bytes(raw[:SUPERBLOCK_BYTES])
    if raw[:8] != SB_MAGIC:
        raise FormatError("no page-store superblock (bad magic)")
    (crc,) = struct.unpack_from("<I", raw, _SB_CRC_AT)
    if crc32c.crc32c(raw[:_SB_CRC_AT]) != crc:
        raise FormatError("superblock checksum mismatch")
    (major,) = struct.unpack_from("<I", raw, _SB_V1_MAJOR_AT)
    if major != FORMAT_MAJOR:
        raise FormatVersionError(f"the device holds a page store of format version {major}, this build reads only "
                                 f"version {FORMAT_MAJOR}: {REFORMAT_HINT} (destroys its pages)")
    (_, _major, _minor, lba, hdr, cap, uuid, created, writers, seb, lease_off, lease_rec, segtab_off, seg_rec,
     segs_off, stride, nseg, slots, slot_table, data, algo, _flags) = _SB.unpack_from(raw)
    if seb != SLOT_ENTRY_BYTES or algo != CHECKSUM_XXH3_128:
        raise FormatError("unsupported slot entry size or checksum algorithm")
    return Geometry(lba, cap, uuid, created, writers, lease_off, lease_rec, segtab_off, seg_rec, segs_off, stride,
                    nseg, slots, slot_table, data, hdr)


@dataclass(frozen=True)
class LeaseRecord:
    """Ownership record of one writer slot."""

    writer_slot: int
    state: int
    writer_id: bytes
    instance: bytes
    generation: int
    heartbeat_ns: int
    ttl_ns: int
    label: str = ""
    wanted: int = 0  # segments this writer asks live owners above their fair share to hand over (§9)

    def expired(self, now_ns: int) -> bool:
        """True when the holder missed its heartbeat deadline (or the record is free)."""
        return self.state != LEASE_HELD or self.heartbeat_ns + self.ttl_ns < now_ns


def pack_lease(rec: LeaseRecord, seed: int) -> bytes:
    """A 128-byte lease record (the caller pads it to one LBA)."""
    body = _LEASE.pack(LEASE_MAGIC, rec.writer_slot, rec.state, rec.writer_id, rec.instance, rec.generation,
                       rec.heartbeat_ns, rec.ttl_ns, rec.label.encode()[:48], rec.wanted)
    return body + struct.pack("<I", seeded_crc(seed, body))


def unpack_lease(raw: bytes | memoryview, seed: int) -> LeaseRecord | None:
    """Parse a lease record; None if never written, torn or from another format."""
    raw = bytes(raw[:RECORD_BYTES])
    if raw[:8] != LEASE_MAGIC:
        return None
    (crc,) = struct.unpack_from("<I", raw, _LEASE.size)
    if seeded_crc(seed, raw[:_LEASE.size]) != crc:
        return None
    _, part, state, wid, inst, gen, hb, ttl, label, wanted = _LEASE.unpack_from(raw)
    return LeaseRecord(part, state, wid, inst, gen, hb, ttl, label.rstrip(b"\0").decode(errors="replace"), wanted)


@dataclass(frozen=True)
class SegmentRecord:
    """Ownership record of one segment: which writer slot may write it, since when."""

    segment: int
    state: int
    owner: int
    writer_id: bytes
    generation: int
    claimed_ns: int


def pack_segment(rec: SegmentRecord, seed: int) -> bytes:
    """A 128-byte segment record (the caller pads it to one LBA)."""
    body = _SEG.pack(SEGMENT_MAGIC, rec.segment, rec.state, rec.owner, 0, rec.writer_id, rec.generation,
                     rec.claimed_ns, b"")
    return body + struct.pack("<I", seeded_crc(seed, body))


def unpack_segment(raw: bytes | memoryview, seed: int) -> SegmentRecord | None:
    """Parse a segment record; None if never written, torn or from another format (the segment is free)."""
    raw = bytes(raw[:RECORD_BYTES])
    if raw[:8] != SEGMENT_MAGIC:
        return None
    (crc,) = struct.unpack_from("<I", raw, _SEG.size)
    if seeded_crc(seed, raw[:_SEG.size]) != crc:
        return None
    _, seg, state, owner, _r, wid, gen, claimed, _ = _SEG.unpack_from(raw)
    return SegmentRecord(seg, state, owner, wid, gen, claimed)


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
    segment: int
    checksum: bytes
    generation: int
    created_ns: int


def pack_header(h: PageHeader, seed: int) -> bytes:
    """A 128-byte page header (padded to one LBA by the caller)."""
    body = _HDR.pack(PAGE_MAGIC, h.key, h.seq, h.length, h.lba, h.segment, CHECKSUM_XXH3_128, h.checksum,
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
