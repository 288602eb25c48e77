"""The expected peak memory printed before training (sao.app.memory): its
arithmetic by owner, the activation count on the meta device against real
tensors, and the refusal that names the keys to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sao.app.memory import (
    MemoryEstimate,
    check_memory,
    estimate_peak,
    longest_episode,
    saved_activation_bytes,
)
from sao.app.parts import build_parts
from sao.config import ConfigError, load_config

GIB = 2**30


def _cfg(*sets: str):  # type: ignore[no-untyped-def]
    return load_config(overrides=list(sets))


def test_longest_episode() -> None:
    one_turn = _cfg("rollout.max_turns=1", "rollout.max_new_tokens=16")
    # a 136-token prompt and one reply of 16: 152, within the 320-token budget
    assert longest_episode(one_turn, 136, context=2048) == 152
    multi = _cfg("rollout.max_turns=7", "rollout.max_new_tokens=12")
    # 50 + 7 x 12 + 6 observations of up to 4096 tokens: the budget (320) binds
    assert longest_episode(multi, 50, context=2048) == 320
    capped = _cfg(
        "rollout.max_turns=3", "rollout.max_new_tokens=10", "rollout.max_observation_tokens=20"
    )
    assert longest_episode(capped, 40, context=2048) == 40 + 30 + 40  # 110
    assert longest_episode(one_turn, None, context=2048) == 320  # prompt unknown: the budget
    assert longest_episode(one_turn, None, context=100) == 100  # the model's window binds


def test_refusal_names_the_keys_of_the_largest_owners() -> None:
    est = MemoryEstimate({"runtime": 0.5 * GIB, "activations": 6 * GIB, "kv_cache": 1 * GIB}, 4, 2)
    with pytest.raises(ConfigError) as e:
        check_memory(est, 4 * GIB, enforce=True)
    msg = str(e.value)
    assert "7.5 GiB" in msg and "4.0 GiB available" in msg
    # the largest owner's keys come first, then the next one's; the runtime has none
    assert msg.index("train.token_budget") < msg.index("rollout.max_batch_size")
    assert "train.memory_check=false" in msg
    line = check_memory(est, 4 * GIB, enforce=False)  # only printed
    assert line.startswith("memory: expected peak 7.5 GiB") and "4.0 GiB available" in line
    assert "available" not in check_memory(est, None, enforce=True)  # unknown: no verdict


def _real_saved_bytes(model: torch.nn.Module, rows: int, tokens: int) -> int:
    """What autograd saves on real tensors, storages counted once, weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        s = x.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return x

    ids = torch.randint(
        0, model.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.base_model(input_ids=ids)
    return sum(seen.values())


def test_meta_activation_count_matches_real_tensors(tiny_policy: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32)
    for rows, tokens in [(1, 16), (4, 48)]:
        meta = saved_activation_bytes(model, rows, tokens)
        real = _real_saved_bytes(model, rows, tokens)
        assert 0.85 * real <= meta <= 1.25 * real, (rows, tokens, meta, real)


def _small_cfg(tiny_policy: Path, *sets: str):  # type: ignore[no-untyped-def]
    """SAO on the tiny policy: 8 decode slots of 64 tokens, 16 one-turn episodes of
    at most 4 reply tokens a batch, micro-batches of at most 256 tokens."""
    return _cfg(
        f"model.path={tiny_policy}",
        "algo=sao",
        "rollout.max_batch_size=8",
        "rollout.max_total_tokens=64",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=4",
        "train.batch_size=16",
        "train.token_budget=256",
        *sets,
    )


def test_estimate_by_owner(tiny_policy: Path) -> None:
    cfg = _small_cfg(tiny_policy)
    p = build_parts(cfg, quiet=True)
    est = estimate_peak(p, prompt_tokens=12, runtime=123)
    assert p.critic is not None
    policy = {id(x): x for x in p.policy.parameters()}.values()  # tied weights once
    n_policy = sum(x.numel() for x in policy)
    n_critic = sum(x.numel() for x in p.critic.parameters())
    trained = sum(x.numel() for x in policy if x.requires_grad)
    trained_critic = sum(x.numel() for x in p.critic.parameters() if x.requires_grad)
    assert trained_critic < n_critic  # its attention is frozen: no optimizer state there
    parts = est.parts
    assert parts["runtime"] == 123
    assert parts["policy"] == 4 * n_policy and parts["engine"] == 4 * n_policy
    assert parts["critic"] == 4 * n_critic
    assert parts["optimizer"] == 8 * (trained + trained_critic)  # AdamW m and v, float32
    assert parts["gradients"] == 4 * max(trained, trained_critic)
    c = p.policy.config
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * 8 * c.num_key_value_heads * 64 * head_dim * 4
    assert parts["kv_cache"] == kv
    # episodes of 12 + 4 = 16 tokens; 256 // 16 = 16 rows fit the token budget
    assert (est.rows, est.episode_tokens) == (16, 16)
    logits = 3 * 256 * c.vocab_size * 4  # three float32 chunks of the 256 positions
    assert parts["activations"] == saved_activation_bytes(p.policy, 16, 16) + logits
    assert est.total == sum(parts.values())


def test_a_run_that_will_not_fit_stops_before_training(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sao train` refuses before anything trains, and leaves no run directory."""
    from sao.app import run

    monkeypatch.setattr(run, "available_bytes", lambda device: 2**20)  # 1 MiB free
    run_dir = tmp_path / "run"
    cfg = load_config(overrides=[f"model.path={tiny_policy}", f"log.run_dir={run_dir}"])
    with pytest.raises(ConfigError, match=r"GiB at its peak, more than the 0.0 GiB available") as e:
        run.train(cfg)
    assert "train.memory_check=false" in str(e.value)
    assert not run_dir.exists()


def test_a_meta_load_reads_no_weights(tiny_policy: Path, tmp_path: Path) -> None:
    """On the meta device a policy is its shell: a checkpoint without its weight
    file still gives every shape and dtype."""
    import shutil

    from sao.models.loading import load_policy

    shell_dir = tmp_path / "shell"
    shell_dir.mkdir()
    shutil.copy(tiny_policy / "config.json", shell_dir)
    shell = load_policy(shell_dir, dtype=torch.bfloat16, device="meta")
    real = load_policy(tiny_policy)
    assert {p.device.type for p in shell.parameters()} == {"meta"}
    assert {p.dtype for p in shell.parameters()} == {torch.bfloat16}
    shapes = {n: p.shape for n, p in real.named_parameters()}
    assert {n: p.shape for n, p in shell.named_parameters()} == shapes


def _ray_cfg(tiny_policy: Path, *sets: str):  # type: ignore[no-untyped-def]
    return _small_cfg(tiny_policy, "runtime.backend=ray", "runtime.rollout_workers=3", *sets)


def test_ray_estimate_by_process(tiny_policy: Path) -> None:
    """A Ray run's estimate, worked by hand on the tiny policy: 1 driver, 3 workers
    and 2 trainer ranks (6 processes)."""
    from sao.app.memory import RAY_ACTOR, RAY_DAEMONS, estimate_ray_peak
    from sao.app.parts import model_shells

    cfg = _ray_cfg(tiny_policy, "runtime.trainer_ranks=2")
    policy, critic = model_shells(cfg)
    assert critic is not None and {p.device.type for p in critic.parameters()} == {"meta"}
    est = estimate_ray_peak(cfg, policy, critic, prompt_tokens=12, runtime=100)
    unique = {id(x): x for x in policy.parameters()}.values()  # tied weights once
    n_policy = sum(x.numel() for x in unique)
    n_critic = sum(x.numel() for x in critic.parameters())
    trained_critic = sum(x.numel() for x in critic.parameters() if x.requires_grad)
    assert trained_critic < n_critic  # frozen attention, as on the ranks
    parts = est.parts
    assert est.processes == 6
    assert parts["runtime"] == 100
    assert parts["processes"] == RAY_DAEMONS + 5 * RAY_ACTOR  # 3 workers, 2 ranks
    # the ranks' shards (one copy), rank 0's gathered copy and the update in the
    # object store (the whole policy)
    assert parts["policy"] == 3 * 4 * n_policy
    assert parts["critic"] == 4 * n_critic
    assert parts["optimizer"] == 8 * (n_policy + trained_critic)
    assert parts["gradients"] == 4 * max(n_policy, trained_critic)  # one model at a time
    assert parts["engine"] == 3 * 4 * n_policy  # each copy (the update: read in the store)
    c = policy.config
    head_dim = c.hidden_size // c.num_attention_heads
    assert parts["kv_cache"] == 3 * 2 * c.num_hidden_layers * 8 * c.num_key_value_heads * 64 * (
        head_dim * 4
    )
    # each rank trains 16 / 2 = 8 rows of 16 tokens: 128 positions, one logits chunk
    assert (est.rows, est.episode_tokens) == (8, 16)
    one_rank = saved_activation_bytes(policy, 8, 16) + 3 * 128 * c.vocab_size * 4
    assert parts["activations"] == 2 * one_rank
    assert "over 6 processes" in est.describe()


def test_ray_estimate_critic_ranks_train_at_once(tiny_policy: Path) -> None:
    """With the critic on ranks of its own, both models' gradients and micro-batches
    are alive at once: the critic's 16 rows on its one rank, no logits."""
    from sao.app.memory import estimate_ray_peak
    from sao.app.parts import model_shells

    cfg = _ray_cfg(tiny_policy, "runtime.critic_ranks=1")
    policy, critic = model_shells(cfg)
    assert critic is not None
    est = estimate_ray_peak(cfg, policy, critic, prompt_tokens=12, runtime=100)
    n_policy = sum(x.numel() for x in {id(x): x for x in policy.parameters()}.values())
    trained_critic = sum(x.numel() for x in critic.parameters() if x.requires_grad)
    assert est.processes == 1 + 3 + 1 + 1
    assert est.parts["gradients"] == 4 * (n_policy + trained_critic)
    c = policy.config
    actor = saved_activation_bytes(policy, 16, 16) + 3 * 256 * c.vocab_size * 4
    assert est.parts["activations"] == actor + saved_activation_bytes(policy, 16, 16)


def test_a_ray_run_prints_its_estimate_and_refuses_what_will_not_fit(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs for Ray runs too, before Ray starts: a run whose processes
    would not fit stops with the keys that lower it, the worker count among them."""
    from sao.app import run

    monkeypatch.setattr(run, "available_bytes", lambda device: 2**20)
    run_dir = tmp_path / "run"
    cfg = _ray_cfg(tiny_policy, f"log.run_dir={run_dir}")
    with pytest.raises(ConfigError, match=r"over 5 processes") as e:
        run.train(cfg)
    assert "runtime.rollout_workers" in str(e.value)
    assert not run_dir.exists()


def test_ray_estimate_of_a_lora_policy_moves_its_adapted_modules(tiny_policy: Path) -> None:
    """With LoRA on q and v an update carries their merged weights only: the object
    store and each worker hold those, not a whole policy."""
    from sao.app.memory import estimate_ray_peak
    from sao.app.parts import model_shells

    cfg = _ray_cfg(tiny_policy, "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]")
    policy, critic = model_shells(cfg)
    est = estimate_ray_peak(cfg, policy, critic, prompt_tokens=12, runtime=100)
    plain = load_config(overrides=[f"model.path={tiny_policy}"])
    base = {id(x): x for x in model_shells(plain)[0].parameters()}.values()
    n_base = sum(x.numel() for x in base)
    c = policy.config
    head_dim = c.hidden_size // c.num_attention_heads
    q = c.hidden_size * c.num_attention_heads * head_dim
    v = c.hidden_size * c.num_key_value_heads * head_dim
    update = 4 * c.num_hidden_layers * (q + v)
    n_policy = sum(x.numel() for x in {id(x): x for x in policy.parameters()}.values())
    assert n_policy > n_base  # the adapters on top of the base
    assert est.parts["policy"] == 2 * 4 * n_policy + update
    assert est.parts["engine"] == 3 * 4 * n_base  # each engine: a plain copy
