"""Start and stop local inference servers (``rollout.launch = N``).

Each server is a child process in its own process group, logging to a file;
:func:`launch_servers` waits until every one answers ``/health`` and stops
them all (SIGTERM, then SIGKILL) when its context ends, also on errors. A
server that exits or stays unhealthy past the timeout raises
:class:`~sao.rollout.remote.http_engine.EngineSetupError` with the end of its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

import sao
from sao.models.cache import sao_home
from sao.rollout.remote.http_engine import EngineSetupError

__all__ = ["VLLM_WORKER_EXTENSION", "LaunchedServer", "launch_servers", "server_command"]

ServerKind = str  # "http" (sao serve) | "vllm" | "sglang"
VLLM_WORKER_EXTENSION = "sao.rollout.remote.vllm_worker.SaoWorkerExtension"
"""The worker extension launched vLLM servers load (``--worker-extension-cls``)."""


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sao_import_root() -> str:
    """A directory that makes this ``sao`` importable from another Python (the
    vLLM server's, for its worker extension): the one holding the package, or,
    when that is a ``site-packages`` whose torch and transformers would shadow
    the server's own, a directory under ``$SAO_HOME`` with only a link to it."""
    package = Path(sao.__file__).resolve().parent
    root = package.parent
    if not root.name.endswith("-packages"):  # a source checkout (editable install)
        return str(root)
    shim = sao_home() / "pythonpath"
    link = shim / "sao"
    if not (link.is_symlink() and link.resolve() == package):
        shim.mkdir(parents=True, exist_ok=True)
        tmp = shim / f".sao-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(package, target_is_directory=True)
        tmp.replace(link)  # atomic: a server starting meanwhile sees the old or new link
    return str(shim)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` takes (vLLM 0.32, ``MaxLoRARanks``)."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that holds ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, not {rank}")


def server_command(
    kind: ServerKind,
    model_dir: str,
    port: int,
    *,
    python: str | None = None,
    max_seq_len: int,
    max_batch_size: int,
    dtype: str,
    device: str,
    extra: Sequence[str] = (),
    lora_rank: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one server. ``lora_rank``: a vLLM
    server takes LoRA adapters up to that rank, loaded at run time
    (``/v1/load_lora_adapter``); two at once, the new version's and the previous
    one's, which a request sent just before an update may still name."""
    py = python or sys.executable
    env: dict[str, str] = {}
    if kind == "http":
        cmd = [py, "-m", "sao.cli", "serve", model_dir, "--port", str(port)]
        cmd += ["--max-seq-len", str(max_seq_len), "--max-batch-size", str(max_batch_size)]
        cmd += ["--dtype", dtype, "--device", device]
    elif kind == "vllm":
        cmd = [py, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
        cmd += ["--max-model-len", str(max_seq_len), "--max-num-seqs", str(max_batch_size)]
        # log-probs after temperature: the DIS ratio divides by the sampled distribution
        cmd += ["--logprobs-mode", "processed_logprobs", "--enforce-eager"]
        # reload_weights_and_refresh: re-packs a tied LM head after a reload (vllm_worker.py)
        cmd += ["--worker-extension-cls", VLLM_WORKER_EXTENSION]
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL routes (/pause, /collective_rpc, ...)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), sao_import_root()) if p
        )
        if device == "cpu":
            env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if lora_rank is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank))]
            cmd += ["--max-loras", "2"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    elif kind == "sglang":
        cmd = [py, "-m", "sglang.launch_server", "--model-path", model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
        cmd += ["--context-length", str(max_seq_len), "--max-running-requests", str(max_batch_size)]
    else:
        raise ValueError(f"cannot launch a {kind!r} server; kinds: http, vllm, sglang")
    return cmd + list(extra), env


def _inherited(kind: str) -> dict[str, str]:
    """This process's environment for a server: a vLLM or SGLang server keeps
    its own OpenMP spin and allocator settings unless the user chose them (sao's
    defaults are for sao)."""
    env = dict(os.environ)
    if kind != "http" and sao.SPIN_SET_BY_SAO:
        env.pop("GOMP_SPINCOUNT", None)
    if kind != "http" and sao.THP_SET_BY_SAO:
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    return env


async def _healthy(server: LaunchedServer, kind: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            code = server.process.poll()
            if code is not None:
                raise EngineSetupError(
                    f"the {kind} server for {server.url} exited with code {code} before it "
                    f"was healthy; the end of its log ({server.log_path}):\n{server.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(server.url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise EngineSetupError(
        f"the {kind} server for {server.url} did not answer /health within {timeout_s:.0f} s "
        f"(raise rollout.server_timeout_s if it is still loading); the end of its log "
        f"({server.log_path}):\n{server.log_tail()}"
    )


def _stop(server: LaunchedServer) -> None:
    if server.process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


@contextlib.asynccontextmanager
async def launch_servers(
    kind: ServerKind,
    model_dir: str,
    n: int,
    *,
    log_dir: Path,
    timeout_s: float,
    python: str | None = None,
    max_seq_len: int,
    max_batch_size: int,
    dtype: str,
    device: str,
    extra: Sequence[str] = (),
    lora_rank: int | None = None,
) -> AsyncIterator[list[LaunchedServer]]:
    """Start ``n`` servers of ``kind`` on free loopback ports; yields them once healthy
    (``lora_rank``: see :func:`server_command`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[LaunchedServer] = []
    try:
        for i in range(n):
            port = free_port()
            cmd, env = server_command(
                kind,
                model_dir,
                port,
                python=python,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                dtype=dtype,
                device=device,
                extra=extra,
                lora_rank=lora_rank,
            )
            log_path = log_dir / f"{kind}-server-{i}.log"
            with log_path.open("wb") as log:
                log.write((" ".join(cmd) + "\n").encode())
                log.flush()
                try:
                    proc = subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_inherited(kind) | env,
                        start_new_session=True,
                    )
                except OSError as err:
                    raise EngineSetupError(
                        f"cannot start the {kind} server ({cmd[0]}): {err}; set "
                        "rollout.server_python to the Python that has it installed"
                    ) from err
            servers.append(LaunchedServer(f"http://127.0.0.1:{port}", proc, log_path))
        await asyncio.gather(*(_healthy(s, kind, timeout_s) for s in servers))
        yield servers
    finally:
        await asyncio.gather(*(asyncio.to_thread(_stop, s) for s in servers))
