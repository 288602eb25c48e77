"""Namespaces and the minimal root of the sandbox, standard library only
(imported by ``_sandbox_supervisor.py`` as a sibling module).

The supervisor calls :func:`enter_namespaces` (new mount, network, IPC, UTS
and pid namespaces; the pid namespace takes effect for its children) and
:func:`build_root`, which assembles the program's whole file system under one
directory: read-only bind mounts of the paths the interpreter needs, a
size-limited tmpfs working directory, a few ``/dev`` nodes and a small
``/dev/shm``. The first child (pid 1 of the new pid namespace) calls
:func:`enter_root`: a mount namespace of its own, ``/proc`` of the new pid
namespace, and ``pivot_root`` into the new root with the old one detached,
so no path leads back to the host's files, sockets or processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import socket

__all__ = ["build_root", "enter_namespaces", "enter_root"]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "fd/0", "stdout": "fd/1", "stderr": "fd/2"}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """``mount(2)``; raises ``OSError`` naming the target."""
    enc = [None if s is None else s.encode() for s in (src, target, fstype)]
    ret = _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), data.encode() or None)
    _check(ret, f"mount {target}")


def enter_namespaces() -> bool:
    """Unshare mount, network, IPC, UTS and pid namespaces at once; False
    (nothing changed) where the kernel or the caller's privileges refuse."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        return False
    with contextlib.suppress(OSError):  # cosmetic: the host's name is no secret
        socket.sethostname("sandbox")
    return True


def _drop_nested(paths: list[str]) -> list[str]:
    """Real paths of ``paths`` that exist, without any inside another."""
    kept: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths if os.path.exists(p)}):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def _bind(root: str, source: str, flags: int) -> None:
    """Bind ``source`` at the same path under ``root``, then remount it with
    ``flags`` (a bind mount takes its flags only from a remount)."""
    target = root + source
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "ab"):
            pass
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def _link_chain(root: str, path: str) -> None:
    """Recreate under ``root`` the symlinks met on the way to ``path`` (such
    as ``/lib -> usr/lib``), so the path also resolves there as written."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        step = os.path.join(current, part)
        if os.path.islink(step):
            here = root + step
            if not os.path.lexists(here):
                os.makedirs(os.path.dirname(here), mode=0o755, exist_ok=True)
                os.symlink(os.readlink(step), here)
            current = os.path.realpath(step)
        else:
            current = step


def _make_dev(root: str, shm_mb: int) -> None:
    """``/dev`` with the harmless character devices, the usual links and a
    ``/dev/shm`` tmpfs of ``shm_mb`` MiB."""
    dev = root + "/dev"
    os.makedirs(dev, mode=0o755)
    for name in _DEV_NODES:
        if os.path.exists("/dev/" + name):
            _bind(root, "/dev/" + name, MS_NOSUID | MS_NOEXEC)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(dev + "/shm")
    opts = f"size={shm_mb}m,mode=1777"
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)


def build_root(cfg: dict, code: bytes) -> None:
    """Assemble the program's file system under ``cfg["root"]``.

    Read-only: the paths in ``cfg["needed_paths"]`` (interpreter, standard
    library, site-packages, system libraries), everything else in the root.
    Writable: the working directory ``cfg["work"]`` (a tmpfs of
    ``cfg["disk_mb"]`` MiB owned by the sandbox uid, holding ``main.py`` =
    ``code``) and ``/dev/shm`` (a tmpfs of the same size). Mounts made here
    never reach the host: the mount namespace is made private first.
    """
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    needed = cfg["needed_paths"]
    for path in _drop_nested(needed):
        _bind(root, path, MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in needed:
        _link_chain(root, path)
    _make_dev(root, cfg["disk_mb"])
    for name in ("proc", "tmp"):
        os.makedirs(root + "/" + name, mode=0o755, exist_ok=True)
    work = root + cfg["work"]
    os.makedirs(work, mode=0o755, exist_ok=True)
    opts = f"size={cfg['disk_mb']}m,mode=0700,uid={cfg['uid']},gid={cfg['uid']}"
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    with open(os.path.join(work, "main.py"), "wb") as f:
        f.write(code)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_root(root: str) -> None:
    """In pid 1 of the new pid namespace: take a mount namespace of its own,
    mount that namespace's ``/proc`` (other users' processes hidden), and make
    ``root`` the root directory with the old root detached."""
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare")
    proc, flags = root + "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        mount("proc", proc, "proc", flags, "hidepid=2")
    except OSError:
        mount("proc", proc, "proc", flags)
    os.chdir(root)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is not None and _libc.syscall(nr, b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    else:  # pivot_root refused (e.g. the root is an initramfs): a chroot holds
        os.chroot(".")  # once the program has no CAP_SYS_CHROOT
    os.chdir("/")
