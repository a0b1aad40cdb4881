"""Byte layout of the daemon's delivery arena: the one place its constants live.

The daemon keeps the arrays of reassembled captures (what it delivers live and what it retains for
late subscribers and watchers) in one shared-memory file of its own, the arena. A subscriber on
the same host maps it read-only and gets small descriptors over ZeroMQ instead of payload frames;
it copies each array out once. The daemon writes it (daemon/arena.py), clients only read it
(client/arena.py).

    file offset
    0            +--------------------------------------------------------------+
                 | header (HEADER_SIZE bytes, little-endian)                    |
                 |   0 magic        8s   b"VTAPARNA"                            |
                 |   8 version      u32  ARENA_FORMAT_VERSION                   |
                 |  12 header_size  u32  HEADER_SIZE                            |
                 |  16 arena_id     u64  random, new for every daemon run       |
                 |  24 capacity     u64  bytes of the data area                 |
                 |  32 block        u32  BLOCK: bytes per generation slot       |
                 |  36 flags        u32  0                                      |
                 |  40 n_blocks     u64  capacity / BLOCK                       |
                 |  48 gen_offset   u64  file offset of the generation table    |
                 |  56 data_offset  u64  file offset of the data area           |
                 |  64 creator_pid  u64  the daemon's pid                       |
                 |  72 created_ns   u64  time.time_ns() at creation             |
    gen_offset   +--------------------------------------------------------------+
                 | generation table: n_blocks x u64, one per BLOCK of data      |
    data_offset  +--------------------------------------------------------------+
                 | data area: capacity bytes, regions of BLOCK * 2**k bytes,     |
                 | each starting at a multiple of its own size (a buddy heap)   |
                 +--------------------------------------------------------------+

Regions and generations (the "never garbage" rule). A region is handed out by the daemon's
allocator, filled (by pread straight from a ring), and only then named in a descriptor. The
u64 at gen[region_start / BLOCK] is the region's generation: the daemon adds one to it when it
frees the region, before any byte of it can be handed out again (x86-64 keeps stores in order; the
daemon runs nowhere else). A descriptor carries the generation read at allocation. A reader copies
the bytes out, then reads the generation: equal to the descriptor's, the copy is the region the
daemon described; different, the region was freed (and maybe rewritten) under it and the copy is
thrown away. The counter only grows, so an old descriptor can never match a later region.

Descriptors (a TOKENS message's "tensors" list, wire_format): [name, dtype, rows, cols, block, gen,
offset], the array being rows*cols items of dtype at data-area byte `offset`, inside the region
that starts at `block` * BLOCK. The message names the arena by its arena_id.

Any change a reader of the previous version would misread bumps ARENA_FORMAT_VERSION; readers
refuse another version (and the client falls back to payload frames).
"""

from __future__ import annotations

import struct

ARENA_FORMAT_VERSION = 1
ARENA_MAGIC = b"VTAPARNA"
ARENA_PREFIX = ".arena-"  # <arena_dir>/.arena-<arena_id hex> (arena_dir: <shm_dir>.arena unless configured)
HEADER_SIZE = 4096
BLOCK = 4096  # allocation granularity and generation slot size (a page)
PAGE = 4096

HEADER = struct.Struct("<8sIIQQIIQQQQQ")
# magic, version, header_size, arena_id, capacity, block, flags, n_blocks, gen_offset, data_offset,
# creator_pid, created_ns
assert HEADER.size <= HEADER_SIZE

PID = struct.Struct("<Q")
HEADER_PID_OFFSET = 64  # creator_pid: the daemon that holds the arena now (a later run that adopts it writes its own)

# The arena file is created with this mode (owner read/write, group read: subscribers in the
# daemon's group may map it; nobody else can open it) and never widened.
FILE_MODE = 0o640

# One descriptor of a tensor in the arena: [name, dtype, rows, cols, block, gen, offset].
DESC_LEN = 7


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


def layout(capacity: int) -> tuple[int, int, int, int]:
    """(n_blocks, gen_offset, data_offset, file_size) of an arena with `capacity` data bytes."""
    if capacity <= 0 or capacity % BLOCK:
        raise ValueError(f"arena capacity {capacity} must be a positive multiple of {BLOCK}")
    n_blocks = capacity // BLOCK
    gen_offset = HEADER_SIZE
    data_offset = align_up(gen_offset + 8 * n_blocks)
    return n_blocks, gen_offset, data_offset, data_offset + capacity


def arena_name(arena_id: int) -> str:
    return f"{ARENA_PREFIX}{arena_id:016x}"
