"""A run over real `sao serve` processes survives one of them dying mid-run,
and stops with a clear message when none is left."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sao.rollout.remote.launch import free_port
from sao.rollout.remote.router import NoLiveEngineError
from tests.train.test_learning import run


def _serve(policy: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sao.cli", "serve", str(policy), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _kill_after(metrics: Path, step: int, procs: list[subprocess.Popen[bytes]]) -> threading.Thread:
    """Kill ``procs`` once ``metrics`` shows ``step``."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.is_file():
                steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines()]
                if steps and max(steps) >= step:
                    break
            time.sleep(0.05)
        for p in procs:
            p.kill()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 2])
def test_servers_dying_mid_run(tmp_path: Path, tiny_policy: Path, killed: int) -> None:
    servers = [_serve(tiny_policy, tmp_path / f"server-{i}.log") for i in range(2)]
    urls = json.dumps([u for _, u in servers])
    try:
        watcher = _kill_after(
            tmp_path / "run" / "metrics.jsonl", 3, [p for p, _ in servers][:killed]
        )
        overrides = (
            "algo=grpo",
            "algo.group_size=4",
            "rollout.engine=http",
            f"rollout.servers={urls}",
        )
        if killed == 1:
            history = run(tmp_path, tiny_policy, *overrides)
            assert max(r["step"] for r in history) == 16  # the run went on with one server
        else:
            with pytest.raises(NoLiveEngineError, match="no live rollout engine is left"):
                run(tmp_path, tiny_policy, *overrides)
        watcher.join()
    finally:
        for p, _ in servers:
            p.kill()
            p.wait()
