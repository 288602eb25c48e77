"""The code sandbox: each hostile program is stopped or refused, the reason is
reported, nothing is left running, and the next run still works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest

from sao.envs.sandbox import SandboxResult, run_python

IS_ROOT = os.geteuid() == 0


def run(code: str, **kwargs: object) -> SandboxResult:
    kwargs.setdefault("wall_s", 2.0)
    kwargs.setdefault("cpu_s", 2)
    return asyncio.run(run_python(code, **kwargs))  # type: ignore[arg-type]


def alive_processes(result: SandboxResult) -> list[int]:
    """Live (non-zombie) processes in the run's process group or under its uid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        same_uid = result.isolation.uid is not None and int(uid_line.split()[1]) == (
            result.isolation.uid
        )
        if stat[0] != "Z" and (int(stat[3]) == result.pid or same_uid):
            found.append(int(name))
    return found


def assert_clean(result: SandboxResult) -> None:
    assert alive_processes(result) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)


def assert_next_run_works() -> None:
    result = run("print(6 * 7)")
    assert result.ok and result.stdout == "42\n", result


def test_ordinary_program_output_and_errors() -> None:
    ok = run("import json\nprint(json.dumps([1, 2]))")
    assert ok.ok and ok.stdout == "[1, 2]\n" and ok.stderr == ""
    crash = run("x = 1\n1 / 0")
    assert crash.exit_code == 1 and crash.killed_reason is None
    assert 'File "main.py", line 2' in crash.stderr and "ZeroDivisionError" in crash.stderr
    assert_clean(crash)


def test_isolation_as_root() -> None:
    if not IS_ROOT:
        pytest.skip("namespaces and the uid drop need root")
    result = run("import os\nprint(os.getuid(), os.getcwd() == os.environ['HOME'])")
    assert result.isolation.namespaces and not result.isolation.as_root
    assert result.isolation.uid is not None
    assert result.isolation.level.startswith("namespaces")
    assert result.stdout == f"{result.isolation.uid} True\n"


def test_infinite_loop_hits_the_wall_clock() -> None:
    result = run("while True:\n    pass", wall_s=1.5, cpu_s=10)
    assert result.timed_out and result.killed_reason == "timeout"
    assert result.duration_s < 5
    assert_clean(result)


def test_cpu_limit() -> None:
    result = run("while True:\n    pass", wall_s=6.0, cpu_s=1)
    assert not result.timed_out and result.killed_reason == "cpu_limit"
    assert result.exit_code is not None and result.exit_code < 0
    assert_clean(result)
    assert_next_run_works()


def test_fork_bomb_is_refused_and_cleaned_up() -> None:
    result = run("import os\nwhile True:\n    os.fork()", max_processes=16)
    assert result.killed_reason in ("process_limit", "timeout")
    spinning = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        max_processes=16,
    )
    assert spinning.timed_out
    for r in (result, spinning):
        assert_clean(r)
    assert_next_run_works()


def test_memory_hog() -> None:
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", memory_mb=128)
    assert result.killed_reason == "memory_limit" and "MemoryError" in result.stderr
    assert_clean(result)
    assert_next_run_works()


def test_writes_outside_the_working_directory_are_refused() -> None:
    home = Path.home()
    code = (
        "import os\n"
        "targets = [os.path.join(os.path.dirname(os.getcwd()), 'escape.txt'),\n"
        f"           {str(home / 'sao_sandbox_escape.txt')!r}, '/tmp/sao_sandbox_escape.txt']\n"
        "for t in targets:\n"
        "    try:\n"
        "        open(t, 'w').write('x')\n"
        "        print('WROTE', t)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    result = run(code)
    escaped = [home / "sao_sandbox_escape.txt", Path("/tmp/sao_sandbox_escape.txt")]
    leaked = [p for p in escaped if p.exists()]
    for p in leaked:
        p.unlink()
    if not IS_ROOT:
        pytest.skip("without root, files are protected only by ordinary permissions")
    assert "WROTE" not in result.stdout and leaked == []
    assert result.stdout.count("refused") == 3 and result.stdout.endswith("fine\n")
    assert_clean(result)


def test_network_is_unreachable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        accepted: list[object] = []
        server.settimeout(3.0)
        threading.Thread(target=lambda: _accept(server, accepted), daemon=True).start()
        code = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('CONNECTED')"
        )
        for namespaces in (True, False):
            result = run(code, namespaces=namespaces, allow_root=True)
            assert "CONNECTED" not in result.stdout and result.exit_code == 1
            assert "Error" in result.stderr
        assert accepted == []
    assert_next_run_works()


def _accept(server: socket.socket, accepted: list[object]) -> None:
    with contextlib.suppress(OSError):
        accepted.append(server.accept())


def test_background_processes_are_killed() -> None:
    code = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('main done')\n"
    )
    result = run(code)
    assert result.exit_code == 0 and result.stdout == "main done\n"
    assert result.killed_reason == "leftover_processes" and result.leftover_processes >= 2
    assert result.duration_s < 5
    assert_clean(result)


def test_huge_output_is_truncated() -> None:
    once = run("print('x' * 100000)", max_output_chars=50)
    assert once.ok and once.truncated and once.stdout == "x" * 50
    flood = run("while True:\n    print('y' * 1000)", max_output_chars=50, flood_bytes=200_000)
    assert flood.killed_reason == "output_limit" and flood.truncated
    assert len(flood.stdout) == 50
    assert_clean(flood)
    assert_next_run_works()


def test_file_size_and_disk_limits() -> None:
    big = run("open('f', 'w').write('x' * (3 << 20))", file_size_mb=1)
    assert big.killed_reason == "file_size_limit"
    if IS_ROOT:
        many = run(
            "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * (1 << 19))\n    i += 1",
            disk_mb=4,
        )
        assert many.killed_reason == "disk_limit"


def test_bad_limits_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="wall_s"):
        run("pass", wall_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run("pass", memory_mb=1)
