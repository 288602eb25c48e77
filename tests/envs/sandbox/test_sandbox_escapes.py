"""Escapes from the code sandbox, one test per class: each runs the escape
inside the sandbox and asserts that it fails, with the observation a policy
would see. A test is skipped only where this machine lacks what the
protection needs, and says which."""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sao.envs.sandbox import SandboxResult, describe_isolation
from sao.envs.sandbox import config as _sandbox_config
from sao.envs.sandbox.limits import memory_cgroup_parent, seccomp_program
from sao.envs.tiny.python_tool import PythonToolTask, tool_observation
from tests.envs.conftest import play
from tests.envs.sandbox.test_sandbox import IS_ROOT, assert_clean, assert_next_run_works, run

REPO = Path(__file__).resolve().parents[2]
CGROUP_PARENT = memory_cgroup_parent()
NO_CGROUP = "this machine lets no memory cgroup be made (needs cgroup v2 with the memory \
controller delegated, or a writable cgroup v1 memory hierarchy)"
NO_SECCOMP = f"no seccomp filter for this architecture ({platform.machine()})"
HAS_SECCOMP = seccomp_program(platform.machine(), deny_memory=True) is not None
MEMORY_MB, CHUNK_MB, DISK_MB = 64, 8, 16
TARGET_MB = 4 * MEMORY_MB
HOLD = {
    "memfd": f"""\
import os
held, fds = 0, []
while held < {TARGET_MB}:
    fd = os.memfd_create("hold")
    os.write(fd, b"x" * ({CHUNK_MB} << 20))
    fds.append(fd)
    held += {CHUNK_MB}
    print("held", held, flush=True)
print("HELD ALL")
""",
    "sysv_shm": f"""\
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
while held < {TARGET_MB}:
    seg = libc.shmget(0, {CHUNK_MB} << 20, 0o1600)
    if seg < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    addr = libc.shmat(seg, None, 0)
    ctypes.memset(addr, 1, {CHUNK_MB} << 20)
    libc.shmdt(ctypes.c_void_p(addr))  # unmapped: the segment keeps the memory
    held += {CHUNK_MB}
    print("held", held, flush=True)
print("HELD ALL")
""",
}
"""Programs that hold 4 * memory_mb in memory no address-space limit counts."""


def held_mb(result: SandboxResult) -> int:
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("held ")]
    return int(lines[-1].split()[1]) if lines else 0


def cgroup_gone(result: SandboxResult) -> bool:
    assert CGROUP_PARENT is not None and result.isolation.uid is not None
    return not Path(CGROUP_PARENT, f"sao-sandbox-{result.isolation.uid}").exists()


@pytest.mark.parametrize("how", sorted(HOLD))
def test_memory_outside_the_address_space_hits_the_cgroup(how: str) -> None:
    if CGROUP_PARENT is None:
        pytest.skip(NO_CGROUP)
    result = run(HOLD[how], memory_mb=MEMORY_MB, file_size_mb=CHUNK_MB, disk_mb=DISK_MB)
    assert result.isolation.cgroup and "HELD ALL" not in result.stdout
    assert result.killed_reason == "memory_limit" and result.exit_code == -9
    assert held_mb(result) <= MEMORY_MB + 2 * DISK_MB  # the cgroup's limit
    assert tool_observation(result, 200).endswith("(stopped: memory_limit)")
    assert cgroup_gone(result)
    assert_clean(result)
    assert_next_run_works()


@pytest.mark.parametrize("how", sorted(HOLD))
def test_memory_outside_the_address_space_is_refused_without_a_cgroup(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not HAS_SECCOMP:
        pytest.skip(NO_SECCOMP)
    monkeypatch.setattr(_sandbox_config, "memory_cgroup_parent", lambda: None)
    result = run(HOLD[how], memory_mb=MEMORY_MB, file_size_mb=CHUNK_MB, disk_mb=DISK_MB)
    assert not result.isolation.cgroup and result.isolation.seccomp
    assert result.exit_code == 1 and held_mb(result) == 0
    assert "[Errno 1] Operation not permitted" in tool_observation(result, 200)
    assert_clean(result)


def namespaces_or_skip() -> None:
    if not IS_ROOT:
        pytest.skip("pid, mount and network namespaces need root")
    if not run("pass").isolation.namespaces:
        pytest.skip("the kernel refuses new namespaces here")


SHM_PREFIX = f"sao-test-{secrets.token_hex(4)}-"
SHM_HOLD = f"""\
held = 0
while held < {TARGET_MB}:
    with open(f"/dev/shm/{SHM_PREFIX}{{held}}", "wb") as f:
        f.write(b"x" * (1 << 20))
    held += 1
    print("held", held, flush=True)
print("HELD ALL")
"""


@pytest.fixture
def host_shm() -> Iterator[None]:
    """Removes what a fallback-mode run left in the host's /dev/shm."""
    yield
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if name.startswith(SHM_PREFIX):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.mark.parametrize("namespaces", [True, False])
def test_dev_shm_is_bounded(namespaces: bool, host_shm: None) -> None:
    if namespaces:
        namespaces_or_skip()
    elif CGROUP_PARENT is None:
        pytest.skip(f"in fallback mode only a memory cgroup bounds /dev/shm: {NO_CGROUP}")
    limits = {"memory_mb": MEMORY_MB, "disk_mb": DISK_MB}
    result = run(SHM_HOLD, namespaces=namespaces, allow_root=True, **limits)
    assert "HELD ALL" not in result.stdout
    if namespaces:  # its own /dev/shm: a tmpfs of disk_mb
        assert result.killed_reason == "disk_limit" and held_mb(result) <= DISK_MB
        assert "No space left on device" in tool_observation(result, 200)
    else:  # the host's /dev/shm, charged to the cgroup
        assert result.killed_reason == "memory_limit"
        assert held_mb(result) <= MEMORY_MB + 2 * DISK_MB
    assert_clean(result)


def test_host_unix_sockets_are_unreachable() -> None:
    namespaces_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="sao-sock-"))
    folder.chmod(0o755)
    path_name, abstract_name = str(folder / "host.sock"), f"\0sao-test-{secrets.token_hex(4)}"
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    try:
        servers[0].bind(path_name)
        os.chmod(path_name, 0o777)
        servers[1].bind(abstract_name)
        for s in servers:
            s.listen(1)
            s.setblocking(False)
        code = (
            "import socket\n"
            f"for name in ({path_name!r}, {abstract_name!r}):\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(name)\n"
            "        s.send(b'hello')\n"
            "        print('CONNECTED')\n"
            "    except OSError as e:\n"
            "        print('refused', type(e).__name__)\n"
        )
        result = run(code)
        assert result.stdout == "refused FileNotFoundError\nrefused ConnectionRefusedError\n"
        for s in servers:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(folder)


def host_allows_user_namespaces() -> bool:
    """Whether an unprivileged process on this machine may create a user namespace."""
    probe = (
        "import ctypes, os\n"
        "if os.geteuid() == 0:\n    os.setgroups([]); os.setresgid(*[65534] * 3);"
        " os.setresuid(*[65534] * 3)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "raise SystemExit(0 if libc.unshare(0x10000000) == 0 else 1)\n"
    )
    return subprocess.run([sys.executable, "-I", "-c", probe], check=False).returncode == 0


def test_new_user_namespaces_are_refused() -> None:
    if not HAS_SECCOMP:
        pytest.skip(NO_SECCOMP)
    if not host_allows_user_namespaces():
        pytest.skip("this machine refuses unprivileged user namespaces anyway")
    code = (
        "import ctypes, os, platform, shutil, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "if platform.machine() == 'x86_64':\n"
        "    r = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER|SIGCHLD)\n"
        "    if r == 0:\n"
        "        os._exit(0)\n"
        "    print('clone', r, ctypes.get_errno())\n"
        "if shutil.which('unshare'):\n"
        "    print('tool', subprocess.run(['unshare', '-U', 'true']).returncode != 0)\n"
    )
    for namespaces in (True, False):
        result = run(code, namespaces=namespaces, allow_root=True)
        assert result.isolation.seccomp and result.ok, result
        lines = result.stdout.splitlines()
        assert lines[0] == "unshare -1 1"
        assert all(ln in ("clone -1 1", "tool True") for ln in lines[1:]), lines


def test_host_processes_are_invisible() -> None:
    namespaces_or_skip()
    marker = f"sao-marker-{secrets.token_hex(4)}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        code = (
            "import os\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "seen = []\n"
            "for p in pids:\n"
            "    try:\n"
            "        seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            f"print(pids == [os.getpid()], any({marker.encode()!r} in c for c in seen))\n"
            "try:\n"
            f"    os.kill({host.pid}, 0)\n"
            "    print('reached')\n"
            "except ProcessLookupError:\n"
            "    print('no such process')\n"
        )
        result = run(code)
        assert result.stdout == "True False\nno such process\n", result
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()


def test_host_files_are_invisible() -> None:
    namespaces_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="sao-secret-"))
    folder.chmod(0o755)
    secret = folder / "data.txt"
    secret.write_text("secret")
    secret.chmod(0o644)
    targets = [str(secret), str(REPO / "pyproject.toml"), "/etc/passwd", "/etc/hostname"]
    code = (
        "import json, os\n"
        f"for t in {targets!r}:\n"
        "    try:\n"
        "        open(t).read()\n"
        "        print('READ', t)\n"
        "    except OSError as e:\n"
        "        print('hidden', type(e).__name__)\n"
        f"repo = {str(REPO)!r}\n"
        "print(json.dumps(sorted(os.listdir(repo)) if os.path.isdir(repo) else None))\n"
        "print(json.dumps(sorted(os.listdir('/'))))\n"
    )
    try:
        result = run(code)
    finally:
        shutil.rmtree(folder)
    lines = result.stdout.splitlines()
    assert lines[: len(targets)] == ["hidden FileNotFoundError"] * len(targets), result
    shown = json.loads(lines[len(targets)])
    assert shown is None or not {"sao", "tests", "pyproject.toml"} & set(shown)
    top = set(json.loads(lines[-1]))
    allowed = {p.split("/")[1] for p in _sandbox_config.needed_paths()} | {"dev", "proc", "tmp"}
    assert top <= allowed and "home" not in top, top


def test_fallback_refuses_to_run_as_root_unless_allowed() -> None:
    code = "import os\nprint(os.getuid())"
    blocked = IS_ROOT and not run(code, namespaces=False, allow_root=True).isolation.uid
    if not blocked:  # an unprivileged uid (fresh, or the caller's) was available
        result = run(code, namespaces=False)
        assert not result.isolation.as_root and result.stdout != "0\n"
        return
    with pytest.raises(PermissionError, match="allow_root=True"):
        run(code, namespaces=False)
    result = run(code, namespaces=False, allow_root=True)
    assert result.isolation.as_root and result.stdout == "0\n"
    assert result.isolation.level.startswith("fallback") and result.isolation.level.endswith(
        "+as-root"
    )


def test_isolation_level_is_reported() -> None:
    level = run("pass").isolation.level
    line = describe_isolation()
    assert "\n" not in line and line.startswith(f"sandbox isolation: {level} (")
    assert ("+seccomp" in level) == HAS_SECCOMP
    assert level.endswith("+cgroup") == (CGROUP_PARENT is not None)
    env = PythonToolTask(kinds=("mul",)).make_env("train", 0)
    ep = play(env, [f"run {env.problem.code}", f"answer {env.problem.answer}"])
    assert ep.results[0].info["sandbox"] == level and ep.score == 1.0


def test_ordinary_programs_still_work() -> None:
    """The filter leaves ordinary programs alone: threads (clone3 falls back
    to clone), subprocesses, a shell and multiprocessing still work."""
    code = (
        "import ctypes, multiprocessing, subprocess, sys, threading\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True).stdout)\n"
        "print(subprocess.run('echo sh', shell=True, capture_output=True).stdout)\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2]))\n"
    )
    result = run(code, wall_s=10.0, cpu_s=10)
    assert result.ok and result.stdout == "thread\nb'1\\n'\nb'sh\\n'\n[1, 2]\n", result
