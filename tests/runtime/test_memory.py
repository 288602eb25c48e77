"""The run's memory readings and the allocator's freed pages given back
(sao.runtime.memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sao.runtime.memory import GIB, MemoryMeter, heap_live, process_tree_rss

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_meter_keeps_the_highest_reading() -> None:
    readings = iter([(0, 3 * 2**30), (2**30, 5 * 2**30), (0, 2**30)])  # (children, own)
    meter = MemoryMeter(read_rss=lambda: next(readings))
    if not meter.supported:
        pytest.skip("no /proc")
    first, second, third = meter.read(), meter.read(), meter.read()
    # rss = children + own: 3, then 1 + 5 = 6, then 1 GiB
    assert [first["memory/rss_gib"], second["memory/rss_gib"], third["memory/rss_gib"]] == [
        3.0,
        6.0,
        1.0,
    ]
    # the peak never falls (this process's own high-water mark may lift it further)
    assert second["memory/peak_gib"] >= 6.0
    assert third["memory/peak_gib"] == second["memory/peak_gib"]


@linux
def test_process_tree_counts_children() -> None:
    """A child holding 200 MiB shows in the children's share, not in this process's."""
    child = subprocess.Popen(
        [sys.executable, "-c", "b = bytearray(200 * 2**20); import time; time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        for _ in range(100):  # until the child has touched its pages
            children, _own = process_tree_rss()
            if children > 200 * 2**20:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert children > 200 * 2**20
    finally:
        child.kill()
        child.wait()


@linux
def test_give_back_freed_returns_fragmented_pages() -> None:
    """The failure the trainer's steps met: after a large tensor is freed, glibc
    serves smaller ones from its heap; freed ones that are not at the heap's top
    stay resident. ``give_back_freed`` returns them (live memory untouched)."""
    if heap_live() is None:
        pytest.skip("not glibc")
    script = textwrap.dedent(
        """
        import torch
        from sao.runtime.memory import give_back_freed, process_tree_rss
        big = torch.ones(16 * 2**20 // 4)  # 16 MiB, mmapped; freeing it raises the
        del big                            # mmap threshold to 16 MiB
        small = [torch.ones(2**20 // 4) for _ in range(300)]  # 300 x 1 MiB from the heap
        keep = small[-1]                   # the heap's top stays live
        del small
        before = process_tree_rss()[1]
        give_back_freed()
        after = process_tree_rss()[1]
        print(before - after, float(keep[0]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    returned = int(out.split()[0])
    # 299 freed MiB were resident; at least 250 of them go back
    assert returned > 250 * 2**20, f"only {returned / 2**20:.0f} MiB given back"


@linux
def test_heap_counts_live_tensors() -> None:
    import torch

    if heap_live() is None:
        pytest.skip("not glibc")
    before = heap_live()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB
    after = heap_live()
    assert after - before >= 64 * 2**20 - 2**20
    del x
    assert heap_live() < after
    assert GIB == 2**30


@linux
def test_the_peak_counts_from_the_meters_start() -> None:
    """A process that held 400 MiB before the run (a test worker, say) does not
    report that as the run's peak: the kernel's high-water mark is reset."""
    script = textwrap.dedent(
        """
        from sao.runtime.memory import MemoryMeter
        held = bytearray(400 * 2**20)
        del held
        meter = MemoryMeter()
        print(meter.hwm, meter.read()["memory/peak_gib"] * 1024)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[0] != "True":
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert float(out[1]) < 300  # MiB: the interpreter and torch, not the 400 freed
