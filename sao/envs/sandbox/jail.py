"""Namespaces and the minimal root of the sandbox, standard library only
(imported by ``supervisor.py`` as a sibling module).

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
import stat

__all__ = ["TooManyFiles", "build_root", "copy_tree", "enter_namespaces", "enter_root"]

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


class TooManyFiles(OSError):
    """A tree holds more entries than :func:`copy_tree` was allowed to copy."""


def _copy_file(name: str, src_dir: int, dst_dir: int, owner: int | None) -> os.stat_result | None:
    """Copy the regular file ``name`` between two directory descriptors, never
    following a link; None (nothing copied) for anything else, and with
    ``owner`` for a file not owned by that uid or with more than one link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_dir)
    except OSError:
        return None  # a link, a vanished or unreadable file
    try:
        st = os.fstat(fd)
        foreign = owner is not None and (st.st_uid != owner or st.st_nlink != 1)
        if not stat.S_ISREG(st.st_mode) or foreign:
            return None
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dst_dir)
        try:
            while chunk := os.read(fd, 1 << 16):
                os.write(out, chunk)
            os.fchmod(out, (st.st_mode & 0o777) | 0o600)
        finally:
            os.close(out)
        return st
    finally:
        os.close(fd)


def copy_tree(
    src: str,
    dst: str,
    *,
    chown: int | None = None,
    links: bool = True,
    owner: int | None = None,
    max_entries: int | None = None,
) -> int:
    """Copy the contents of directory ``src`` into the existing directory ``dst``.

    Copies directories, regular files (permission bits kept, set-id bits
    dropped) and, with ``links``, symbolic links as links; never follows a
    link and skips everything else (fifos, sockets, devices). ``chown``: the
    copies belong to that uid. ``owner``: only entries owned by that uid (and
    files with a single link) are copied, so a hard link to a file the
    program could not otherwise read is never read on its behalf. Raises
    :class:`TooManyFiles` past ``max_entries`` entries; returns the number copied.
    """
    count = 0
    todo = [("", os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))]
    while todo:
        rel, src_fd = todo.pop()
        dst_fd = os.open(os.path.join(dst, rel), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for entry in os.scandir(src_fd):
                count += 1
                if max_entries is not None and count > max_entries:
                    raise TooManyFiles(f"more than {max_entries} files and directories")
                st = entry.stat(follow_symlinks=False)
                if owner is not None and st.st_uid != owner:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(entry.name, 0o755, dir_fd=dst_fd)
                    child = os.open(
                        entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src_fd
                    )
                    todo.append((os.path.join(rel, entry.name), child))
                elif stat.S_ISLNK(st.st_mode):
                    if links:
                        os.symlink(
                            os.readlink(entry.name, dir_fd=src_fd), entry.name, dir_fd=dst_fd
                        )
                elif _copy_file(entry.name, src_fd, dst_fd, owner) is None:
                    continue
                if chown is not None:
                    os.chown(entry.name, chown, chown, dir_fd=dst_fd, follow_symlinks=False)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
    for _, fd in todo:  # left over after an error
        os.close(fd)
    return count


def build_root(cfg: dict) -> None:
    """Assemble the program's file system under ``cfg["root"]``.

    Read-only: the paths in ``cfg["needed_paths"]`` (interpreter, standard
    library, site-packages, system libraries), everything else in the root.
    Writable: the working directory ``cfg["work"]`` (a tmpfs of
    ``cfg["disk_mb"]`` MiB, with at most ``cfg["max_files"]`` entries when
    set, owned by the sandbox uid, holding a copy of the host's
    ``cfg["work"]``: ``main.py``, or the files of a shell command's working
    copy) and ``/dev/shm`` (a tmpfs of the same size). Mounts made here never
    reach the host: the mount namespace is made private first.
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
    if cfg.get("max_files"):
        opts += f",nr_inodes={cfg['max_files'] + 1}"  # + the directory itself
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    copy_tree(cfg["work"], work, chown=cfg["uid"])
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
