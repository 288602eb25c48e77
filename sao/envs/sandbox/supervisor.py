"""The sandbox supervisor: a small standard-library-only program that
:func:`sao.envs.sandbox.run_python` starts as ``python -I -S
supervisor.py CONFIG_JSON``.

It makes the program's memory cgroup, enters new mount, network, IPC, UTS
and pid namespaces and builds a minimal read-only root (``jail``),
then forks an init process (pid 1 of the new pid namespace) that pivots into
that root and forks the user's program. The program joins the cgroup, drops
to the sandbox uid, applies resource limits and a seccomp filter
(``limits``) and execs ``python -I -u main.py`` (``config["program"]``
kind ``python``) or ``/bin/sh -c COMMAND`` (kind ``shell``) in its working
directory, a copy of the host's ``config["work"]``. Without namespaces
(refused, or not asked for) the supervisor forks the program directly.

The supervisor is a child subreaper, so every process the program starts
stays in its subtree: when the program exits, or when the parent sends
``SIGUSR1`` (deadline) or dies, it kills the whole subtree, reaps it, copies
the working directory's final files to ``config["export"]`` when that is set
(directories and regular files only), removes the cgroup and writes a JSON
report (isolation achieved, the program's wait status, processes killed,
memory-limit kills, whether the export succeeded) to ``config["report"]``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # -I leaves it out; last, so
# that nothing in this directory can shadow the standard library
from jail import TooManyFiles, build_root, copy_tree, enter_namespaces, enter_root
from limits import MemoryCgroup, apply_rlimits, install_seccomp

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
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


def _open_cgroup(cfg: dict, report: dict) -> MemoryCgroup | None:
    """The program's memory cgroup, where ``cfg["cgroup"]`` names a parent."""
    spec = cfg["cgroup"]
    if not spec["parent"]:
        return None
    try:
        cgroup = MemoryCgroup(spec["parent"], f"sao-sandbox-{cfg['uid']}", spec["limit"])
    except OSError as e:
        report["cgroup_error"] = str(e)
        return None
    report["cgroup"] = True
    return cgroup


def _isolate(cfg: dict, report: dict) -> None:
    """Enter namespaces and build the root where allowed; decide the uid."""
    root = os.geteuid() == 0
    if root and cfg["namespaces"] and enter_namespaces():
        try:
            build_root(cfg)
            report["namespaces"] = report["drop_uid"] = True
            return
        except OSError as e:  # the namespaces hold; the program is not started
            report["refused"] = f"could not build the sandbox root: {e}"
            return
    report["drop_uid"] = root and all(_blocked_ancestor(p) is None for p in cfg["needed_paths"])
    if root and not report["drop_uid"] and not cfg["allow_root"]:
        report["refused"] = (
            "without namespaces (not asked for, or refused by the kernel) the program "
            "would run as root, as its interpreter lies under a directory other users "
            "cannot enter; pass allow_root=True to accept that"
        )
    report["as_root"] = root and not report["drop_uid"]


def _exec_program(cfg: dict, report: dict, cgroup: MemoryCgroup | None) -> None:
    """In the forked child: join the cgroup, drop privileges, apply limits and
    the seccomp filter, exec the program."""
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if cgroup is not None:
            cgroup.join()
        uid = cfg["uid"]
        if report["drop_uid"] and os.geteuid() == 0:
            if not report["namespaces"]:
                _chown_tree(cfg["work"], uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the uid change cleared it
        os.chdir(cfg["work"])
        apply_rlimits(cfg["limits"])
        if report["seccomp"] and not install_seccomp(deny_memory=cgroup is None):
            raise OSError("the seccomp filter was refused")
        program = cfg["program"]
        if program["kind"] == "shell":
            os.execve("/bin/sh", ["/bin/sh", "-c", program["command"]], cfg["env"])
        argv = [cfg["python"], "-I", "-u"]
        argv += ["main.py"] if report["namespaces"] else ["-c", _NO_NETWORK_BOOT]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:  # report and never return into the supervisor
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(126)


def _chown_tree(path: str, uid: int) -> None:
    """Give ``path`` and everything under it (links themselves, not their
    targets) to ``uid``."""
    os.chown(path, uid, uid)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(top, name), uid, uid, follow_symlinks=False)


def _export(cfg: dict, report: dict) -> None:
    """Copy the program's final working directory to ``cfg["export"]``
    (every process of the program is gone by now): directories and regular
    files only, and with a dropped uid only those the sandbox uid owns."""
    source = cfg["root"] + cfg["work"] if report["namespaces"] else cfg["work"]
    owner = cfg["uid"] if report["drop_uid"] else None
    try:
        copy_tree(source, cfg["export"], links=False, owner=owner, max_entries=cfg["max_files"])
        report["exported"] = True
    except TooManyFiles as e:
        report["export_error"] = str(e)
    except OSError as e:
        report["export_error"] = f"could not copy the files back: {e}"


def _start_init(cfg: dict, report: dict, cgroup: MemoryCgroup | None) -> tuple[int, int]:
    """Fork pid 1 of the new pid namespace; returns its pid and the read end
    of the pipe on which it reports the program's status."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(write_fd)
        return pid, read_fd
    try:
        os.close(read_fd)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        enter_root(cfg["root"])
        program = os.fork()
        if program == 0:
            _exec_program(cfg, report, cgroup)
        statuses: dict[int, int] = {}
        _wait_program(program, statuses)
        _reap(statuses)
        leftovers = sum(state != "Z" for pid, (_, state) in _process_table().items() if pid != 1)
        status = {"status": statuses.get(program), "leftovers": leftovers}
        os.write(write_fd, json.dumps(status).encode())
    except BaseException as e:
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
        os._exit(126)
    os._exit(0)  # the kernel now kills whatever is left in the pid namespace


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


def _run(cfg: dict, report: dict, cgroup: MemoryCgroup | None) -> None:
    """Isolate, start the program and wait for it; fills ``report``."""
    statuses: dict[int, int] = {}
    pid, channel, finished = -1, -1, False
    try:
        _isolate(cfg, report)
        if "refused" in report:
            return
        report["seccomp"] = cfg["seccomp"]
        if report["namespaces"]:
            pid, channel = _start_init(cfg, report, cgroup)
        else:
            pid = os.fork()
            if pid == 0:
                _exec_program(cfg, report, cgroup)
        finished = _wait_program(pid, statuses)
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed = _kill_subtree(statuses)
    if cfg.get("export") and pid > 0:
        _export(cfg, report)
    report["stopped"] = not finished
    report["leftovers"] = len(killed - {pid}) if finished else 0
    report["status"] = statuses.get(pid)
    if channel >= 0:
        os.set_blocking(channel, False)
        try:
            from_init = json.loads(os.read(channel, 1 << 16) or b"{}")
        except (OSError, ValueError):
            from_init = {}
        if finished and from_init.get("status") is not None:
            report.update(from_init)


def main() -> None:
    """Isolate, run the program, clean up every process, write the report."""
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGUSR1, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(125)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    report: dict = {"namespaces": False, "seccomp": False, "cgroup": False, "drop_uid": False}
    report_fd = os.open(cfg["report"], os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    cgroup = None
    try:
        cgroup = _open_cgroup(cfg, report)
        _run(cfg, report, cgroup)
    except _Stop:
        pass
    if cgroup is not None:
        report["oom_kills"] = cgroup.oom_kills()
        report["cgroup_removed"] = cgroup.remove()
    os.write(report_fd, json.dumps(report).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
