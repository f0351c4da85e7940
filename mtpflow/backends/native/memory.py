"""Large buffers the kernel streams every step (the int8 model's weights), on huge pages where Linux grants them.

A decode step at batch 1 reads every weight once. On 4 KB pages that read needs a TLB entry for each 4 KB and the
hardware prefetchers stop at each page boundary. Linux backs an anonymous private mapping with transparent huge
pages (2 MB on x86) when the process asks for them with ``madvise(MADV_HUGEPAGE)``. Under the common system setting,
``madvise`` in /sys/kernel/mm/transparent_hugepage/enabled, it grants them only then, and torch's allocator never
asks. ``streamed_empty`` asks. Where the system refuses (``never``, no memory to compact, another OS), the buffer
is plain memory and everything computes the same: only the speed differs (docs/int8.md#how-the-kernel-is-laid-out;
docs/bench/huge_pages_dec06.md has what it measured). ``MTPFLOW_HUGE_PAGES=0`` turns the request off.
"""
from __future__ import annotations

import mmap
import os
import re

import torch

_ENV = "MTPFLOW_HUGE_PAGES"
_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def huge_page_size() -> int:
    """The size of a transparent huge page here (bytes), 0 where there are none to ask for."""
    if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return 0
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return 0
    try:
        with open(_PMD_SIZE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def streamed_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor of ``numel`` elements, on huge pages where the system grants them: an anonymous
    private mapping aligned to a huge page and advised ``MADV_HUGEPAGE`` (its pages become resident as they are
    written, as ``torch.empty``'s do). A buffer smaller than one huge page, or a system without them, gets
    ``torch.empty``. The tensor holds the mapping: it is unmapped when the last view of it goes."""
    size = huge_page_size()
    nbytes = numel * dtype.itemsize
    if size <= 0 or nbytes < size:
        return torch.empty(numel, dtype=dtype)
    try:  # the slack up to the first aligned byte is never written, so it never becomes resident
        region = mmap.mmap(-1, nbytes + size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(numel, dtype=dtype)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (a kernel without THP): plain pages, the same numbers
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % size
    return raw[start:start + nbytes].view(dtype)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s memory on huge pages now, from /proc/self/smaps (0 where it cannot be read): the
    ``AnonHugePages`` of each mapping that overlaps the tensor, at most the overlap. smaps counts per mapping, not
    per address, so this is exact for a mapping of the tensor's own (``streamed_empty``'s) and may count another
    allocation's huge pages for memory in a shared mapping (``torch.empty``'s heap). Reads the whole smaps file:
    for reports, not for a step."""
    lo = tensor.data_ptr()
    hi = lo + tensor.numel() * tensor.element_size()
    total = 0
    try:
        with open("/proc/self/smaps") as f:
            span = None
            for line in f:
                head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    start, end = int(head.group(1), 16), int(head.group(2), 16)
                    span = (start, end) if start < hi and lo < end else None
                elif span is not None and line.startswith("AnonHugePages:"):
                    overlap = min(hi, span[1]) - max(lo, span[0])
                    total += min(int(line.split()[1]) * 1024, overlap)
    except OSError:
        return 0
    return total

