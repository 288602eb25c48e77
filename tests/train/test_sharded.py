"""The sharded trainer (FSDP2, gloo, 2 ranks spawned on the CPU) computes what
the single-process trainer computes: the same metrics and the same updated
actor and critic weights (float32, 1e-5), with several micro-batches per rank;
and its DCP checkpoints resume on another number of ranks.

One spawn runs every scenario (two ranks cost ~10 s to start on busy cores).
"""

from __future__ import annotations

import math
import re
import socket
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.train.sharded import RankContext
from sao.train.split import micro_batch_rows, split_rows
from tests.train.sharded_worker import ALGOS, make_batch, rank_main, run_bf16, run_scenario

TOL = 1e-5
NAMES = sorted(ALGOS)
RESUMED = ["sao"]  # the DCP round trips (critic, K=2, LR warm-up: the most state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Runs = dict[str, Any]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """``one``: the single-process reference (writing DCP checkpoints);
    ``two`` / ``rank1``: what ranks 0 and 1 of the 2-rank spawn returned
    (including resuming those checkpoints, a bf16 step, the HF export under
    ``tmp/hf``); ``one_resumed``: the single process resuming the 2-rank
    checkpoints; ``bf16``: the single-process bf16 step."""
    tmp = tmp_path_factory.mktemp("sharded")
    one = {}
    for name in NAMES:
        save = tmp / "one" / name if name in RESUMED else None
        one[name] = run_scenario(name, RankContext(), save=save)
    bf16 = run_bf16(RankContext())
    start = time.perf_counter()
    mp.spawn(rank_main, args=(2, _free_port(), str(tmp), NAMES), nprocs=2, join=True)
    print(f"2-rank spawn: {time.perf_counter() - start:.1f} s")
    two = torch.load(tmp / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp / "rank1.pt", weights_only=False)
    one_resumed = {n: run_scenario(n, RankContext(), load=tmp / "two" / n) for n in RESUMED}
    return {
        "one": one,
        "two": two,
        "rank1": rank1,
        "one_resumed": one_resumed,
        "bf16": bf16,
        "tmp": tmp,
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


RANKS = re.compile(r"^critic/heldout_auc(_turn\d+)?$")
"""Rank statistics (at the prompt and at each turn's start): a value that differs in
its last bits across ranks can swap two episodes' order, so one pair of 128 flips
(1/110 apart seen); compared loosely."""


def assert_stats_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = float(a[k]), float(b[k])
        if RANKS.match(k):
            assert abs(x - y) <= 0.05, (k, x, y)
            continue
        if k.startswith("time/"):  # (seconds differ)
            continue
        if math.isnan(x) or math.isnan(y):
            assert math.isnan(x) and math.isnan(y), k
        else:
            assert abs(x - y) <= TOL * max(1.0, abs(x)), (k, x, y)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_process(runs: Runs, name: str) -> None:
    one, two = runs["one"][name], runs["two"][name]
    for step in ("1", "2"):
        assert_stats_equal(one[f"stats{step}"], two[f"stats{step}"])
        assert_stats_equal(two[f"stats{step}"], runs["rank1"][name][f"stats{step}"])
        diff = max_diff(one[f"weights{step}"], two[f"weights{step}"])
        print(f"{name} step {step}: max |weight difference| 1 vs 2 ranks = {diff:.2e}")
        assert diff < TOL, (name, step, diff)
    moved = max_diff(one["weights1"], one["weights2"])
    assert moved > 100 * TOL  # the comparison is not vacuous: the weights moved
    assert runs["rank1"][name]["weights2"] == {}  # gathered on rank 0 only
    if ALGOS[name].use_critic:
        assert any(k.startswith("critic.") for k in two["weights2"])
        assert "critic/explained_variance" in two["stats2"]


@pytest.mark.slow
def test_checkpoints_resume_on_another_number_of_ranks(
    runs: Runs,
) -> None:
    for name in RESUMED:
        one, two = runs["one"][name], runs["two"][name]
        # 1 rank wrote, 2 ranks resumed: their second step is the uninterrupted one
        resumed_on_two = runs["two"][f"{name}/resumed"]
        for restored in (resumed_on_two["restored"], runs["one_resumed"][name]["restored"]):
            # K=2 critic steps after one step, so the LR is (2 + 1) / 3 of 1e-3 (fresh: 1/3)
            assert float(restored["critic_sched_epoch"]) == 2
            assert float(restored["critic_lr"]) == pytest.approx(1e-3)
            assert float(restored["actor_adam_step"]) == 1
        assert_stats_equal(one["stats2"], resumed_on_two["stats2"])
        assert max_diff(one["weights2"], resumed_on_two["weights2"]) < TOL
        # 2 ranks wrote, 1 resumed
        resumed_on_one = runs["one_resumed"][name]
        assert_stats_equal(two["stats2"], resumed_on_one["stats2"])
        assert max_diff(two["weights2"], resumed_on_one["weights2"]) < TOL


@pytest.mark.slow
def test_export_is_gathered_to_one_hugging_face_directory(runs: Runs) -> None:
    trained = runs["two"]["sao"]["weights2"]
    policy = load_policy(runs["tmp"] / "hf" / "policy")
    critic = ValueModel.from_pretrained(runs["tmp"] / "hf" / "critic")
    loaded = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    loaded |= {f"critic.{k}": v for k, v in critic.state_dict().items()}
    assert max_diff(trained, loaded) == 0.0


@pytest.mark.slow
def test_bfloat16_models_train_sharded_in_float32_shards(runs: Runs) -> None:
    """FSDP2 keeps float32 shards (they are the masters: no copies) and
    computes in bf16; the step lands close to the single-process bf16 one
    (float32 masters of bf16 weights), not bit-equal: gradients accumulate
    over micro-batches in float32 there, in bf16 here."""
    one, two = runs["bf16"], runs["two"]["sao/bf16"]
    assert set(two["dtypes"]) == {"param:torch.float32", "master:torch.float32"}
    assert set(one["dtypes"]) == {"param:torch.bfloat16", "master:torch.float32"}
    assert all(math.isfinite(float(v)) for k, v in two["stats1"].items() if "explained" not in k)
    for k in ("actor/grad_norm", "critic/loss", "train/reward_mean"):
        assert (
            abs(float(one["stats1"][k]) - float(two["stats1"][k]))
            < 0.05 * abs(float(one["stats1"][k])) + 1e-3
        ), k
    assert max_diff(one["weights1"], two["weights1"]) < 1e-2


# ---------------------------------------------------------------- the split (no spawn)


def test_split_keeps_groups_whole_and_balances_tokens() -> None:
    lengths = [10, 10, 2, 2, 7, 7, 1, 1]
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    plan = split_rows(lengths, groups, 2)
    assert sorted(r for rows in plan for r in rows) == list(range(8))
    for rows in plan:  # no group is cut
        assert {groups[i] for i in rows}.isdisjoint({groups[i] for i in range(8) if i not in rows})
    # LPT: a (20) -> rank 0, c (14) -> rank 1, b (4) -> rank 1, d (2) -> rank 1: 20 vs 20
    assert [sum(lengths[i] for i in rows) for rows in plan] == [20, 20]
    # empty group ids are singletons
    assert split_rows([3, 3, 3], ["", "", ""], 3) == [[0], [1], [2]]
    # more ranks than units: a rank may be empty (it runs padding micro-batches)
    assert split_rows([5], ["x"], 2) == [[0], []]


def test_micro_batch_rows_respect_the_token_budget() -> None:
    lengths = [5, 9, 3, 20, 4]
    mbs = micro_batch_rows(lengths, [0, 1, 2, 3, 4], token_budget=12)
    assert sorted(r for mb in mbs for r in mb) == [0, 1, 2, 3, 4]
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 12


def test_ranks_run_the_same_number_of_micro_batches() -> None:
    from sao.types import collate

    batch = collate(make_batch(1, rows=6, group_size=3))
    counts = []
    rows_seen: list[int] = []
    for rank in range(2):
        ctx = RankContext(rank=rank, world_size=2)
        mbs = list(ctx.micro_batches(batch, token_budget=30))
        counts.append(len(mbs))
        rows_seen += [int(r) for _, rows in mbs for r in rows]
    assert counts[0] == counts[1]
    assert sorted(rows_seen) == list(range(6))  # every row trained once, padding writes nowhere


def test_one_process_context_is_the_identity() -> None:
    ctx = RankContext()
    x = torch.arange(6.0).view(2, 3)
    assert ctx.sum_rows(x) is x
    module = torch.nn.Linear(2, 2)
    assert ctx.shard(module) is module
    assert ctx.is_main
