"""The CPU's model and flags, and the warning a bfloat16 run gets where the CPU
has no bfloat16 arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sao.app import cpu

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f {extra}

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f {extra}
"""


READ = cpu.cpu_flags


def fake_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: str) -> None:
    """This CPU, as far as sao.app.cpu can tell, is CPUINFO's with ``extra`` flags."""
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra=extra))
    monkeypatch.setattr(cpu, "cpu_flags", lambda: READ(info))


def test_cpu_model_names_the_gemm_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_cpu(monkeypatch, tmp_path, "avx512_bf16 amx_bf16 amx_tile")
    assert cpu.cpu_model() == "Intel(R) Xeon(R) Processor (avx2, avx512f, avx512_bf16, amx_bf16)"
    fake_cpu(monkeypatch, tmp_path, "")
    assert cpu.cpu_model() == "Intel(R) Xeon(R) Processor (avx2, avx512f)"


def test_bfloat16_without_bfloat16_arithmetic_is_warned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    fake_cpu(monkeypatch, tmp_path, "")
    model = cpu.bfloat16_warning(host, bf16, bf16)  # (the engine's copy follows the model)
    assert model is not None and "warning: model.dtype bfloat16 on a CPU" in model
    assert "Intel(R) Xeon(R) Processor" in model and "float32 is the faster choice" in model
    engine = cpu.bfloat16_warning(host, fp32, bf16)
    assert engine is not None and "warning: rollout.engine_dtype bfloat16 on a CPU" in engine
    assert cpu.bfloat16_warning(host, fp32, fp32) is None  # float32: nothing to say
    assert cpu.bfloat16_warning(torch.device("meta"), bf16, bf16) is None  # not this CPU
    for extra in ("avx512_bf16", "amx_bf16"):  # either one multiplies bfloat16 natively
        fake_cpu(monkeypatch, tmp_path, extra)
        assert cpu.bfloat16_warning(host, bf16, bf16) is None


def test_no_cpuinfo_no_flags_no_warning(tmp_path: Path) -> None:
    name, flags = cpu.cpu_flags(tmp_path / "absent")
    assert flags == frozenset() and name
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra="avx512_bf16"))
    assert cpu.cpu_flags(info) == (
        "Intel(R) Xeon(R) Processor",
        frozenset({"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}),
    )
