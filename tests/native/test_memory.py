"""The streamed buffers (``backends.native.memory``): the int8 weights on huge pages where the system grants them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import prompt_rows, tiny_loaded
from mtpflow import backends
from mtpflow.backends.native import int8_reference as R, kernel
from mtpflow.backends.native.memory import huge_page_bytes, huge_page_size, streamed_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_setting() -> str | None:
    """The bracketed choice of the system's THP setting (always, madvise, never), None where there is none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def thp_disabled_for_process() -> bool:
    """Whether this process may not have huge pages at all (``prctl(PR_SET_THP_DISABLE)``, as some container
    runtimes set it): /proc/self/status says ``THP_enabled: 0``."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    return any(line.split()[1:] == ["0"] for line in status.splitlines() if line.startswith("THP_enabled:"))


def thp_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_a_streamed_buffer_is_aligned_sized_and_writable(dtype):
    size = huge_page_size()
    item = dtype.itemsize
    n = (3 * max(size, 2 << 20) + 4096 + 5 * item) // item  # three huge pages and a bit: not a multiple of one
    t = streamed_empty(n, dtype)
    assert t.shape == (n,) and t.dtype == dtype and t.is_contiguous()
    if size:
        assert t.data_ptr() % size == 0
    t.copy_(torch.arange(n).remainder(100).to(dtype))
    assert torch.equal(t[-7:], torch.arange(n - 7, n).remainder(100).to(dtype))


def test_small_buffers_and_the_switch_take_plain_memory(monkeypatch):
    """Below one huge page, and with MTPFLOW_HUGE_PAGES=0, no mapping is made: torch.empty's memory."""
    from mtpflow.backends.native import memory

    mapped = []
    real = memory.mmap.mmap
    monkeypatch.setattr(memory.mmap, "mmap", lambda *a, **k: mapped.append(a) or real(*a, **k))
    small = streamed_empty(1000, torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32 and not mapped
    monkeypatch.setenv("MTPFLOW_HUGE_PAGES", "0")
    assert huge_page_size() == 0
    off = streamed_empty(3 * (2 << 20), torch.int8).fill_(1)
    # No mapping is the whole check. smaps cannot prove "none granted": torch.empty may hand back heap memory that
    # other code advised earlier and freed (CI once saw 2560 bytes of such a neighbour counted against this buffer).
    assert off.numel() == 3 * (2 << 20) and not mapped
    monkeypatch.delenv("MTPFLOW_HUGE_PAGES")
    if huge_page_size():  # the same size switched back on: one mapping
        streamed_empty(3 * (2 << 20), torch.int8)
        assert len(mapped) == 1


@pytest.mark.skipif(thp_setting() not in ("always", "madvise") or not huge_page_size() or thp_disabled_for_process(),
                    reason="this system grants this process no transparent huge pages")
def test_the_system_grants_the_huge_pages_asked_for():
    size = huge_page_size()
    before = thp_fallbacks()
    t = streamed_empty(4 * size, torch.int8).fill_(1)
    if thp_fallbacks() != before:
        pytest.skip("the system had no free huge page for this buffer (thp_fault_fallback rose)")
    assert huge_page_bytes(t) == 4 * size


@pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")
def test_the_int8_weights_are_views_of_one_streamed_buffer():
    """A model whose int8 weights span several huge pages: every packed weight is a view of ``Int8Weights.buffer``
    (huge-page aligned where the system has them), and the kernel's forward over it equals the reference's."""
    loaded = tiny_loaded(seed=3, layers=6, hidden=256)
    weights = backends.quantize_int8(loaded.model)
    buf = weights.buffer
    assert buf.numel() > 2 << 20  # more than one huge page: streamed_empty maps it
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    lins = [lin for layer in weights.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for lin in [*lins, weights.head]:
        assert lo <= lin.q.data_ptr() and lin.q.data_ptr() + lin.q.numel() <= hi
    assert sum(lin.q.numel() for lin in [*lins, weights.head]) == buf.numel()
    if huge_page_size():
        assert lo % huge_page_size() == 0
    backend = backends.create(loaded.model, "auto", int8=weights)
    # khugepaged may still collapse pages of the advised buffer between two reads: the count only grows
    before = round(huge_page_bytes(buf) / 2**20, 1)
    reported = backend.stats()["int8_weights_huge_pages_mb"]
    assert before <= reported <= round(huge_page_bytes(buf) / 2**20, 1)
    ids = torch.tensor([5, 9, 33, 100, 7, 8, 9, 10, 11, 12])
    logits, _ = backend.run(backend.make_pool(1), prompt_rows(ids, 0))
    assert torch.equal(logits, R.Int8Reference(weights).forward(ids)[0])


def test_the_int8_weights_keep_their_values_off_huge_pages(monkeypatch):
    """The switch changes where the weights lie, never what they are."""
    loaded = tiny_loaded(seed=5, layers=6, hidden=256)
    on = backends.quantize_int8(loaded.model)
    monkeypatch.setenv("MTPFLOW_HUGE_PAGES", "0")
    loaded = tiny_loaded(seed=5, layers=6, hidden=256)
    off = backends.quantize_int8(loaded.model)
    assert torch.equal(on.buffer, off.buffer)


def test_packed_copies_are_streamed_and_unchanged(monkeypatch):
    """The float32 panels and the int8 panels (the copies a float32 step streams) come from ``streamed_empty``: the
    same bytes as on plain pages, aligned to a huge page where the system has them."""
    from mtpflow.backends.native import products

    weight = torch.randn(1000, 640)  # 2.6 MB of panels: more than one huge page
    q, _ = products.quantize_int8(torch.randn(4000, 640))  # 2.6 MB of int8 panels
    on = products.pack_panels(weight), products.pack_q8_panels(q)
    monkeypatch.setenv("MTPFLOW_HUGE_PAGES", "0")
    off = products.pack_panels(weight), products.pack_q8_panels(q)
    for a, b in zip(on, off):
        assert torch.equal(a, b) and a.is_contiguous() and a.shape == b.shape
    monkeypatch.delenv("MTPFLOW_HUGE_PAGES")
    if huge_page_size():
        assert all(t.data_ptr() % huge_page_size() == 0 for t in on)
