"""The sandbox supervisor: a small standard-library-only program that
:func:`sao.envs.sandbox.run_python` starts as ``python -I -S
_sandbox_supervisor.py CONFIG_JSON``.

It isolates itself (network namespace; mount namespace with every mount
read-only and a size-limited tmpfs as the working directory), then forks the
user's program, which drops to the sandbox uid, applies resource limits and
execs ``python -I -u main.py``. The supervisor is a child subreaper, so every
process the program starts stays in its subtree: when the program exits, or
when the parent sends ``SIGUSR1`` (deadline) or dies, the supervisor kills the
whole subtree, reaps it and writes a JSON report (isolation achieved, the
program's wait status, processes killed) to ``config["report"]``.

Each isolation step degrades gracefully where the kernel refuses it; the
report says what was achieved.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_KEEP_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
_NO_NETWORK_BOOT = """\
import socket as _s, sys as _y
class _Blocked(_s.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and family in (-1, _s.AF_INET, _s.AF_INET6):
            raise PermissionError("network access is disabled in the sandbox")
        super().__init__(family, type, proto, fileno)
_s.socket = _Blocked
_y.argv = ["main.py"]
_src = open("main.py", encoding="utf-8").read()
try:
    exec(compile(_src, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
except SystemExit:
    raise
except BaseException as _e:
    import traceback as _t
    _t.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    _y.exit(1)
"""

_libc = ctypes.CDLL(None, use_errno=True)


class _Stop(Exception):
    """Raised by the SIGUSR1/SIGTERM handler: stop the program now."""


def _on_stop(signum: int, frame: object) -> None:
    raise _Stop


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype)]
    ret = _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), data.encode() or None)
    _check(ret, f"mount {target}")


def _blocked_ancestor(path: str) -> str | None:
    """Highest ancestor of ``path`` that other users cannot traverse, if any."""
    parts = os.path.abspath(path).split("/")[1:]
    current = ""
    for part in parts:
        current += "/" + part
        try:
            st = os.stat(current)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return current
    return None


def _expose(paths: list[str], stash: str) -> bool:
    """Make ``paths`` reachable by other users inside this mount namespace:
    hide each blocking ancestor under a tmpfs and bind the paths back."""
    groups: dict[str, list[str]] = {}
    dirs = {os.path.realpath(p) for p in paths if os.path.exists(p)}
    for p in sorted(d if os.path.isdir(d) else os.path.dirname(d) for d in dirs):
        top = _blocked_ancestor(p)
        if top is not None and not any(p.startswith(q + "/") for q in groups.get(top, [])):
            groups.setdefault(top, []).append(p)
    if not groups:
        return True
    if any(stash.startswith(top + "/") for top in groups):
        return False
    os.makedirs(stash, mode=0o700, exist_ok=True)
    for top, subs in groups.items():
        holders = []
        for sub in subs:
            holder = os.path.join(stash, str(len(os.listdir(stash))))
            os.mkdir(holder, 0o700)
            _mount(sub, holder, None, MS_BIND | MS_REC)
            holders.append(holder)
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for sub, holder in zip(subs, holders, strict=True):
            os.makedirs(sub, mode=0o755, exist_ok=True)
            _mount(holder, sub, None, MS_MOVE)
    return True


def _remount_read_only() -> int:
    """Bind-remount every mount of this namespace read-only; returns failures."""
    failures = 0
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = fields[4].encode().decode("unicode_escape")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _KEEP_FLAGS.get(opt, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            failures += 1
    return failures


def _isolate(cfg: dict, report: dict) -> None:
    """Enter new network and mount namespaces where the kernel allows it."""
    report["drop_uid"] = os.geteuid() == 0 and all(
        _blocked_ancestor(p) is None for p in cfg["needed_paths"]
    )
    if os.geteuid() != 0 or not cfg["namespaces"]:
        return
    for flags, fs in ((CLONE_NEWNS | CLONE_NEWNET, True), (CLONE_NEWNET, False)):
        if _libc.unshare(ctypes.c_int(flags)) == 0:
            report["network"], mount_ns = True, fs
            break
    else:
        return
    with open(os.path.join(cfg["work"], "main.py"), "rb") as f:
        code = f.read()
    if mount_ns:
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            report["drop_uid"] = _expose(cfg["needed_paths"], cfg["stash"])
            report["mount_failures"] = _remount_read_only()
            opts = f"size={cfg['disk_mb']}m,mode=0700,uid={cfg['uid']},gid={cfg['uid']}"
            _mount("tmpfs", cfg["work"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
            with open(os.path.join(cfg["work"], "main.py"), "wb") as f:
                f.write(code)
            report["filesystem"] = True
        except OSError as e:
            report["isolation_error"] = str(e)


def _exec_program(cfg: dict, report: dict) -> None:
    """In the forked child: drop privileges, apply limits, exec the program."""
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        uid = cfg["uid"]
        if report.get("drop_uid") and os.geteuid() == 0:
            if not report["filesystem"]:
                for name in ("", "main.py"):
                    os.chown(os.path.join(cfg["work"], name), uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the uid change cleared it
        os.chdir(cfg["work"])
        lim = cfg["limits"]
        for res, value in (
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NPROC, lim["nproc"]),
            (resource.RLIMIT_FSIZE, lim["fsize"]),
            (resource.RLIMIT_CPU, lim["cpu"]),
            (resource.RLIMIT_AS, lim["as"]),
        ):
            hard = value + 1 if res == resource.RLIMIT_CPU else value
            resource.setrlimit(res, (value, hard))
        argv = [cfg["python"], "-I", "-u"]
        argv += ["main.py"] if report["network"] else ["-c", _NO_NETWORK_BOOT]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:  # report and never return into the supervisor
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(126)


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) for every process visible in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(rest[1]), rest[0])
    return table


def _descendants(root: int) -> dict[int, str]:
    """Every descendant of ``root`` (pid -> state), zombies included."""
    children: dict[int, list[int]] = {}
    table = _process_table()
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


def _reap(statuses: dict[int, int]) -> None:
    """Collect every exited child without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = status


def _kill_subtree(statuses: dict[int, int], timeout_s: float = 5.0) -> set[int]:
    """SIGKILL every descendant until none is left; returns the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(statuses)
        alive = _descendants(os.getpid())
        if not alive:
            break
        for pid, state in alive.items():
            if state != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
        time.sleep(0.002)
    return killed


def _wait_program(pid: int, statuses: dict[int, int]) -> bool:
    """Wait until the program exits (True) or a stop is requested (False)."""
    try:
        while pid not in statuses:
            done, status = os.waitpid(-1, 0)
            statuses[done] = status
    except _Stop:
        return False
    except ChildProcessError:
        pass
    return True


def main() -> None:
    """Isolate, run the program, clean up every process, write the report."""
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGUSR1, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(125)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    report: dict = {"network": False, "filesystem": False, "drop_uid": False}
    report_fd = os.open(cfg["report"], os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    statuses: dict[int, int] = {}
    pid = -1
    finished = False
    try:
        _isolate(cfg, report)
        pid = os.fork()
        if pid == 0:
            _exec_program(cfg, report)
        finished = _wait_program(pid, statuses)
    except _Stop:
        pass
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed = _kill_subtree(statuses)
    report["stopped"] = not finished
    report["leftovers"] = len(killed - {pid}) if finished else 0
    report["status"] = statuses.get(pid)
    os.write(report_fd, json.dumps(report).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
