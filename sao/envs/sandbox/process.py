"""The sandbox's process handling (:mod:`sao.envs.sandbox`): start the
supervisor, capture its output with a cap, and stop it at the deadline or on
an output flood, also when the caller is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

__all__ = ["MARKERS", "Capture", "supervise"]

_SUPERVISOR = Path(__file__).with_name("supervisor.py")
_STOP_GRACE_S = 5.0
MARKERS = (
    (b"MemoryError", "memory_limit"),
    (b"Cannot allocate memory", "memory_limit"),
    (b"Resource temporarily unavailable", "process_limit"),
    (b"can't start new thread", "process_limit"),
    (b"File too large", "file_size_limit"),
    (b"No space left on device", "disk_limit"),
)
"""stderr texts that name the limit a program ran into, in order of precedence."""
_MARKER_TAIL = max(len(m) for m, _ in MARKERS)
_BACKGROUND: set[asyncio.Task[None]] = set()
"""Clean-up tasks of cancelled runs (kept referenced until they finish)."""


class Capture(asyncio.SubprocessProtocol):
    """Keeps at most ``cap_bytes`` of each stream and counts the rest."""

    def __init__(self, cap_bytes: int, flood_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.flood_bytes = flood_bytes
        self.data: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self.reasons: set[str] = set()
        """Limits named anywhere in stderr (also past the cap), see ``MARKERS``."""
        self._tail = b""
        self.total = 0
        self.truncated = False
        self.exited = asyncio.Event()
        self.closed = asyncio.Event()
        self.flooded = asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buf = self.data[fd]
        room = self.cap_bytes - len(buf)
        if room > 0:
            buf += data[:room]
        if len(data) > room:
            self.truncated = True
        self.total += len(data)
        if self.total > self.flood_bytes:
            self.flooded.set()
        if fd == 2:
            window = self._tail + data
            self.reasons.update(r for marker, r in MARKERS if marker in window)
            self._tail = window[-_MARKER_TAIL:]

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


async def supervise(
    cfg: dict[str, object], capture: Capture, wall_s: float
) -> tuple[int, str | None]:
    """Start the supervisor, enforce the deadline and the output cap, and wait
    until it and every pipe writer are gone. Returns its pid and why it was
    stopped (``timeout``, ``output_limit``) or None."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.subprocess_exec(
        lambda: capture,
        sys.executable,
        "-I",
        "-S",
        str(_SUPERVISOR),
        json.dumps(cfg),
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    pid = transport.get_pid()
    try:
        stop_reason = await _enforce(pid, capture, wall_s)
    except BaseException:  # cancelled: the supervisor cleans up, then the pipes close
        if not capture.exited.is_set():
            _signal(pid, signal.SIGUSR1)
            task = asyncio.ensure_future(_close_when_exited(transport, capture))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            raise
        transport.close()
        raise
    transport.close()
    return pid, stop_reason


async def _enforce(pid: int, capture: Capture, wall_s: float) -> str | None:
    """Wait for the supervisor to exit, stopping it at the deadline or on an
    output flood; returns ``timeout``, ``output_limit`` or None."""
    waiters = [asyncio.ensure_future(e.wait()) for e in (capture.exited, capture.flooded)]
    try:
        await asyncio.wait(waiters, timeout=wall_s, return_when="FIRST_COMPLETED")
    finally:
        for w in waiters:
            w.cancel()
    stop_reason = None
    if not capture.exited.is_set():
        stop_reason = "output_limit" if capture.flooded.is_set() else "timeout"
        _signal(pid, signal.SIGUSR1)
        await _wait_event(capture.exited, _STOP_GRACE_S)
    if not capture.exited.is_set():
        _signal(pid, signal.SIGKILL, group=True)  # backstop: the supervisor is stuck
        await _wait_event(capture.exited, _STOP_GRACE_S)
    await _wait_event(capture.closed, 1.0)
    return stop_reason


async def _close_when_exited(transport: asyncio.SubprocessTransport, capture: Capture) -> None:
    """After a cancellation: give the supervisor time to clean up, then close."""
    try:
        await _wait_event(capture.exited, _STOP_GRACE_S)
    finally:
        transport.close()


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


def _signal(pid: int, sig: signal.Signals, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
