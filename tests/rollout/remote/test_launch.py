"""``rollout.launch``: real ``sao serve`` processes started, health-checked
and stopped; a server that exits or never answers is a clear error."""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path

import pytest

from sao.rollout.remote.http_engine import EngineSetupError
from sao.rollout.remote.launch import _inherited, launch_servers, server_command, vllm_lora_rank
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.types import SamplingParams

KW = dict(max_seq_len=128, max_batch_size=4, dtype="float32", device="cpu")


def test_launched_sao_serve_generates_and_is_stopped(tiny_policy: Path, tmp_path: Path) -> None:
    async def go() -> list:
        async with launch_servers(
            "http", str(tiny_policy), 1, log_dir=tmp_path, timeout_s=120, **KW
        ) as servers:
            client = VLLMEngine(servers[0].url)
            await client.connect(None, timeout_s=10)
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
            await client.aclose()
            assert len(c.token_ids) <= 3 and c.versions == (0,) * len(c.token_ids)
            return servers

    (server,) = asyncio.run(go())
    assert server.process.poll() is not None  # stopped with the context


def test_a_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    async def go() -> None:
        async with launch_servers(
            "http", str(tmp_path / "no-model"), 1, log_dir=tmp_path, timeout_s=60, **KW
        ):
            pass

    with pytest.raises(EngineSetupError, match=r"(?s)exited with code .*does not exist"):
        asyncio.run(go())


def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport time\nprint('loading...', flush=True)\ntime.sleep(60)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)

    async def go() -> None:
        async with launch_servers(
            "http", "m", 1, log_dir=tmp_path, timeout_s=2, python=str(fake), **KW
        ):
            pass

    with pytest.raises(EngineSetupError, match=r"(?s)did not answer /health within 2 s.*loading"):
        asyncio.run(go())


def test_vllm_command_enables_rl_routes_and_processed_logprobs() -> None:
    cmd, env = server_command("vllm", "/m", 8000, python="py", **KW)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert "processed_logprobs" in cmd and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_command_for_lora_adapters() -> None:
    cmd, env = server_command("vllm", "/m", 8000, python="py", **KW)
    assert "--enable-lora" not in cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    cmd, env = server_command("vllm", "/m", 8000, python="py", lora_rank=12, **KW)
    i = cmd.index("--max-lora-rank")
    assert "--enable-lora" in cmd and cmd[i + 1] == "16"  # the next rank vLLM takes
    assert cmd[cmd.index("--max-loras") + 1] == "2"  # the new version's and the previous
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        vllm_lora_rank(513)


def test_only_sao_servers_inherit_saos_spin_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """sao's GOMP_SPINCOUNT default is for sao's processes: a vLLM or SGLang
    server gets its own, unless the user set one."""
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setattr("sao.SPIN_SET_BY_SAO", True)
    assert _inherited("http")["GOMP_SPINCOUNT"] == "10000"
    assert "GOMP_SPINCOUNT" not in _inherited("vllm")
    assert "GOMP_SPINCOUNT" not in _inherited("sglang")
    monkeypatch.setattr("sao.SPIN_SET_BY_SAO", False)  # the user's choice reaches every server
    assert _inherited("vllm")["GOMP_SPINCOUNT"] == "10000"


def test_only_sao_servers_inherit_saos_huge_page_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setattr("sao.THP_SET_BY_SAO", True)
    assert _inherited("http")["THP_MEM_ALLOC_ENABLE"] == "1"
    assert "THP_MEM_ALLOC_ENABLE" not in _inherited("vllm")
    monkeypatch.setattr("sao.THP_SET_BY_SAO", False)  # the user's choice reaches every server
    assert _inherited("sglang")["THP_MEM_ALLOC_ENABLE"] == "1"
