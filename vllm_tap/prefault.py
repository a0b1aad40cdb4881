"""Map a shared file's pages into this process ahead of use, in one call.

A store into a MAP_SHARED tmpfs page that is not yet in this process's page table faults (~1 µs a
4 KiB page: a 16 MiB region takes 4,096 of them), and every process that maps the file pays that
once per page. MADV_POPULATE_WRITE (Linux 5.14) maps a range at once without writing it; the
caller decides when that cost is paid (at start-up, when space is reserved), not the hot path.
"""

from __future__ import annotations

import mmap

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13 names it


def populate_write(mm: mmap.mmap, start: int = 0, length: int = 0) -> bool:
    """Map [start, start + length) of `mm` writable now (length 0: to the end; start page-aligned).
    False where the kernel cannot (older than 5.14, or the range is not backed): the pages then
    fault in on first use, as without this call."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length or len(mm) - start)
    except (OSError, ValueError):
        return False
    return True
