"""Clear errors for bad model inputs, and the atomic model cache."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import ResNetConfig

from sao.models import (
    ModelLoadError,
    atomic_dir,
    build_cached,
    build_tiny_policy,
    cached_model_dir,
    load_policy,
    load_tokenizer,
    recipe_hash,
    require_chat_template,
    sao_home,
)


def test_missing_path_says_hub_is_not_used(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=r"does not exist.*hub is never used.*Fix"):
        load_policy(missing)
    with pytest.raises(ValueError, match=r"nope.*does not exist"):
        load_tokenizer(missing)
    with pytest.raises(ModelLoadError, match=r"Qwen/Qwen3-0.6B' does not exist.*local-dir"):
        load_policy("Qwen/Qwen3-0.6B")  # a hub id is not a local directory


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is a file, not a directory"):
        load_policy(f)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config.json.*save_pretrained"):
        load_policy(tmp_path)


def test_not_a_causal_lm(tmp_path):
    ResNetConfig().save_pretrained(tmp_path)  # an image model: no causal-LM class
    with pytest.raises(ModelLoadError, match=r"'resnet' model.*not a causal language model"):
        load_policy(tmp_path)


def test_directory_without_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match=r"none of the tokenizer files.*save_pretrained"):
        load_tokenizer(tmp_path)


def test_unreadable_tokenizer(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(ModelLoadError, match=r"(?s)holds no loadable tokenizer.*Fix"):
        load_tokenizer(tmp_path)


def test_tokenizer_without_chat_template(char_tok):
    tok = char_tok.__class__(tokenizer_object=char_tok.backend_tokenizer)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"my_step: the tokenizer .* has no chat template"):
        require_chat_template(tok, what="my_step")


def test_sao_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_HOME", str(tmp_path))
    assert sao_home() == tmp_path
    monkeypatch.delenv("SAO_HOME")
    assert sao_home().parts[-2:] == (".cache", "sao")


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=6))
def test_recipe_hash_ignores_key_order(recipe):
    reordered = dict(reversed(list(recipe.items())))
    assert recipe_hash(recipe) == recipe_hash(reordered)
    assert len(recipe_hash(recipe)) == 16


def test_recipe_hash_distinguishes_and_rejects():
    assert recipe_hash({"size": "1m"}) != recipe_hash({"size": "2m"})
    assert recipe_hash({"a": 1}) != recipe_hash({"a": "1"})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        recipe_hash({"a": object()})
    with pytest.raises(ValueError, match="kind must be a simple name"):
        cached_model_dir("../evil", {})


def test_build_cached_builds_once(monkeypatch, tmp_path, char_tok):
    monkeypatch.setenv("SAO_HOME", str(tmp_path))
    calls = []

    def build(d):
        calls.append(d)
        build_tiny_policy(char_tok, size="0.1m").save_pretrained(d)

    recipe = {"arch": "llama", "size": "0.1m", "seed": 0}
    first = build_cached("policy", recipe, build)
    second = build_cached("policy", recipe, build)
    assert first == second == cached_model_dir("policy", recipe)
    assert len(calls) == 1 and calls[0] != first  # built under a temporary name
    assert json.loads((first / "recipe.json").read_text()) == recipe
    assert load_policy(first).config.vocab_size == len(char_tok)


def test_crash_leaves_no_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_HOME", str(tmp_path))

    def crash(d):
        (d / "config.json").write_text("{}")
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        build_cached("policy", {"x": 1}, crash)
    parent = cached_model_dir("policy", {"x": 1}).parent
    assert list(parent.iterdir()) == []  # neither the final nor a temp directory


def test_atomic_dir_overwrite_and_keep(tmp_path):
    final = tmp_path / "m"
    with atomic_dir(final) as d:
        (d / "a").write_text("1")
    with atomic_dir(final) as d:
        (d / "a").write_text("2")
    assert (final / "a").read_text() == "2"
    with atomic_dir(final, overwrite=False) as d:
        (d / "a").write_text("3")
    assert (final / "a").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
