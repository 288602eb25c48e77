"""The run's memory readings and the allocator's freed pages given back
(sao.runtime.memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

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
def test_process_tree_counts_shared_pages_once(tmp_path: Path) -> None:
    """Two processes mapping the same 200 MiB (as rollout workers map an update in
    Ray's object store) hold 200 MiB of the machine's RAM, not 400: each one's
    share is half (plus its own small runtime). The launcher writes the pages,
    unmaps them, and starts the two readers; its descendants are measured."""
    launcher = textwrap.dedent(
        """
        import mmap, os, subprocess, sys
        path, size = sys.argv[1], 200 * 2**20
        with open(path, "wb") as f:
            f.truncate(size)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
            m.write(b"x" * size)
        reader = sys.argv[2]
        for p in [subprocess.Popen([sys.executable, "-c", reader, path]) for _ in range(2)]:
            p.wait()
        """
    )
    reader = textwrap.dedent(
        """
        import mmap, os, sys, time
        f = open(sys.argv[1], "rb")
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        sum(m[i] for i in range(0, len(m), 4096))  # every page, mapped here
        os.write(1, b"ready\\n")  # one write: the two readers' lines never interleave
        time.sleep(30)
        """
    )
    shared = tmp_path / "shared.bin"
    child = subprocess.Popen(
        [sys.executable, "-c", launcher, str(shared), reader],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        assert [child.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]
        readers, _launcher = process_tree_rss(child.pid)
        assert 200 * 2**20 < readers < 290 * 2**20  # 400+ MiB when each counted its own
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the readers too
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
