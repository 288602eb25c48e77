"""The critic judged on what it has not seen: the out-of-sample window
(``critic/heldout_*``), the held-out evaluation's ``eval/critic_*``, the
lambda-1 gate (``algo.critic_ready_gain``), a zero value head and a critic
trained in its top layers only."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algo import binary_auc, explained_variance_n
from sao.algo.presets import PRESETS
from sao.models import classify_parameter, freeze_attention, freeze_below
from sao.models.tiny import build_tiny_policy
from sao.models.value import ValueModel
from sao.train.critic_fit import (
    CriticFit,
    first_action_values,
    heldout_fit,
    heldout_fit_by_turn,
    turn_start_values,
    turn_values,
)
from sao.train.trainer import OptimSettings, Trainer
from tests.models.conftest import make_arch_model
from tests.train.test_presets_step import TOK
from tests.train.test_shared_values import episode


def test_auc_worked_by_hand() -> None:
    # positives score 0.35 and 0.8, negatives 0.1 and 0.4: pairs (0.35>0.1) (0.35<0.4)
    # (0.8>0.1) (0.8>0.4) -> 3 of 4 ordered right
    s = torch.tensor([0.1, 0.4, 0.35, 0.8])
    y = torch.tensor([False, False, True, True])
    assert binary_auc(s, y).item() == pytest.approx(0.75)
    # a tie counts one half: positive 0.5 vs negatives 0.5 and 0.2 -> (0.5 + 1) / 2
    assert binary_auc(torch.tensor([0.5, 0.5, 0.2]), torch.tensor([1, 0, 0])).item() == 0.75
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])).item())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.booleans()), min_size=2, max_size=30))
def test_auc_is_one_minus_the_auc_of_the_negated_scores(pairs: list[tuple[float, bool]]) -> None:
    s = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pairs])
    a, b = binary_auc(s, y), binary_auc(-s, y)
    if y.all() or not y.any():
        assert a.isnan() and b.isnan()
    else:
        assert 0.0 <= a.item() <= 1.0
        assert (a + b).item() == pytest.approx(1.0)


def test_explained_variance_of_flat_vectors() -> None:
    # R = (0, 1, 1, 0): Var 0.25; V = (0, 1, 0.5, 0.5): R - V = (0, 0, 0.5, -0.5), Var 0.125
    r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    v = torch.tensor([0.0, 1.0, 0.5, 0.5])
    assert explained_variance_n(v, r).item() == pytest.approx(0.5)
    assert math.isnan(explained_variance_n(v, torch.ones(4)).item())


def test_window_gain_worked_by_hand() -> None:
    fit = CriticFit(window=4)
    # first batch: no running mean before it, so it is not scored for the gain
    fit.record(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))
    assert math.isnan(fit.gain()) and "critic/heldout_gain" not in fit.stats()
    # second batch: the running mean before it is 0.5; the critic says 0.9 and 0.1
    fit.record(torch.tensor([0.9, 0.1]), torch.tensor([1.0, 0.0]))
    # scored: (0.9, 1, 0.5), (0.1, 0, 0.5): critic SSE 0.01 + 0.01 = 0.02, mean's 0.5
    assert fit.gain() == pytest.approx(1 - 0.02 / 0.5)
    assert fit.full and fit.ready(0.9) and not fit.ready(0.97)
    stats = fit.stats()
    # EV over the four pairs: R - V = (0.5, -0.5, 0.1, -0.1), Var 0.13; Var R 0.25
    assert stats["critic/heldout_ev"] == pytest.approx(1 - 0.13 / 0.25)
    # ranks: positives (0.5, 0.9) vs negatives (0.5, 0.1): 1/2 + 1 + 1 + 1 of 4
    assert stats["critic/heldout_auc"] == pytest.approx(3.5 / 4)
    # the window forgets the oldest: a third batch leaves only the last four
    fit.record(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert len(fit.pairs) == 4 and fit.pairs[0] == pytest.approx((0.9, 1.0, 0.5))
    again = CriticFit(window=4)
    again.load_state_dict(fit.state_dict())
    assert again.stats() == fit.stats() and again.count == 6


def test_not_ready_until_the_window_is_full() -> None:
    fit = CriticFit(window=8)
    fit.record(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    fit.record(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert fit.gain() == pytest.approx(1.0) and not fit.ready(0.0)


def test_first_action_values_reads_the_state_after_the_prompt() -> None:
    values = torch.tensor([[0.0, 0.0, 0.3, 0.4], [0.0, 0.7, 0.8, 0.0], [0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    v, r = first_action_values(values, returns, mask)
    assert v.tolist() == pytest.approx([0.3, 0.7]) and r.tolist() == [1.0, 0.5]


def _trainer(algo_name: str = "sao", **changes: object) -> Trainer:
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    algo = PRESETS[algo_name].with_(**changes)
    head = algo.value_head_init
    critic = ValueModel.from_policy(policy, seed=1, head_init=head) if algo.use_critic else None
    settings = OptimSettings(actor_lr=1e-3, critic_lr=1e-2, critic_lr_warmup_steps=1)
    return Trainer(policy, critic, algo, settings)


def test_actor_lambda_is_1_until_the_critic_beats_the_running_mean() -> None:
    rng = random.Random(0)
    trainer = _trainer(critic_ready_gain=0.5)
    assert trainer.actor_algo().lam_actor == 1.0
    stats = trainer.step([episode(rng, 2, f"g{i}") for i in range(8)])
    assert stats["critic/actor_lambda_1"].item() == 1.0
    # (no running mean before the first batch: the gain is undefined and left out)
    assert "critic/heldout_ev" in stats and "critic/heldout_gain" not in stats
    # a window that says the critic is good: the preset's own (adaptive) lambda
    for _ in range(16):
        trainer.fit.record(torch.tensor([0.0] * 8 + [1.0] * 8), torch.tensor([0.0] * 8 + [1.0] * 8))
    assert trainer.actor_algo() is trainer.algo and trainer.algo.lam_actor is None
    stats = trainer.step([episode(rng, 2, f"h{i}") for i in range(8)])
    assert stats["critic/actor_lambda_1"].item() == 0.0
    # without the option the gate is off from the start (paper)
    assert _trainer().actor_algo() is not None and _trainer().actor_algo().lam_actor is None


def test_the_window_holds_values_from_before_each_update() -> None:
    rng = random.Random(1)
    trainer = _trainer()
    trajs = [episode(rng, 1, f"g{i}") for i in range(6)]
    batch = trainer.prepare(trajs)
    before = trainer.values(batch)
    assert before is not None
    trainer.step(trajs)
    v, _ = first_action_values(before, before, batch.action_mask_BT)
    assert [p[0] for p in trainer.fit.pairs] == pytest.approx(v.tolist())
    assert [p[1] for p in trainer.fit.pairs] == pytest.approx([t.reward for t in trajs], abs=1e-6)
    # the held-out readings: one value per trajectory, NaN for one without an action
    by_turn = turn_values(trainer, trajs)
    after = trainer.values(batch)
    assert after is not None
    v_after, _ = first_action_values(after, after, batch.action_mask_BT)
    values = [v[0] for v in by_turn]
    assert values == pytest.approx(v_after.tolist(), abs=1e-5)  # turn 1: the first action
    for b, (t, vs) in enumerate(zip(trajs, by_turn, strict=True)):  # each turn's first token
        assert vs == pytest.approx([after[b, turn.start].item() for turn in t.turns], abs=1e-5)
    assert all(math.isfinite(x) for x in values)
    fit = heldout_fit(values, [t.reward for t in trajs])
    assert set(fit) == {"eval/critic_ev", "eval/critic_auc"}
    assert all(math.isnan(x) for v in turn_values(_trainer("grpo"), trajs) for x in v)


def test_a_zero_head_starts_every_value_at_zero() -> None:
    rng = random.Random(2)
    trainer = _trainer(value_head_init="zero")
    batch = trainer.prepare([episode(rng, 2, f"g{i}") for i in range(4)])
    values = trainer.values(batch)
    assert values is not None and torch.count_nonzero(values) == 0
    trainer.step([episode(rng, 2, f"g{i}") for i in range(4)])  # and it learns from there
    values = trainer.values(batch)
    assert values is not None and torch.count_nonzero(values) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_freeze_below_trains_only_the_top_layers(arch: str) -> None:
    critic = ValueModel.from_policy(make_arch_model(arch))
    freeze_attention(critic)
    report = freeze_below(critic, 1)
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    n_layers = max(int(part) for n in trainable for part in n.split(".") if part.isdigit()) + 1
    assert trainable, arch
    for name in trainable:  # the last layer's non-attention parts, final norm, head
        digits = [int(p) for p in name.split(".") if p.isdigit()]
        assert digits == [n_layers - 1] or not digits, name
        assert classify_parameter(name) not in ("attention", "attention_norm"), name
    assert "value_head.weight" in trainable
    assert report.frozen["embeddings"] > 0 and report.trainable["embeddings"] == 0
    assert report.trainable["final_norm"] > 0
    with pytest.raises(ValueError, match="layers"):
        freeze_below(critic, 1000)


def test_a_top_layer_critic_step_leaves_the_lower_layers_bitwise() -> None:
    rng = random.Random(3)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(policy, seed=1)
    freeze_below(critic, 1)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    settings = OptimSettings(actor_lr=1e-3, critic_lr=1e-2, critic_lr_warmup_steps=1)
    trainer = Trainer(policy, critic, PRESETS["sao"], settings)
    trainer.step([episode(rng, 2, f"g{i}") for i in range(8)], train_actor=False)
    for n, p in critic.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n


@pytest.mark.parametrize("packed", [False, True])
def test_a_frozen_trunk_runs_once_per_batch_with_the_same_values(packed: bool) -> None:
    """Inside ``trunk_cache`` a forward on tokens it already ran replays the frozen
    bottom layers' output: layer 0 runs once for three forwards of one batch and
    again for another batch; the values and the top layer's gradients are bitwise
    those of whole forwards."""
    critic = ValueModel.from_policy(make_arch_model("llama"), seed=1)
    freeze_below(critic, 1)
    n = len(critic.backbone.layers)
    assert critic.frozen_trunk() == n - 1
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 60, (3, 9), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 6:] = 0  # a shorter row: padding
    other = torch.randint(3, 60, (3, 9), generator=g)
    critic(tokens, mask, packed=packed)  # (a first packed forward checks packing first)
    runs = []
    critic.backbone.layers[0].register_forward_hook(lambda *_: runs.append(1))

    def values_and_grads(t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        critic.zero_grad(set_to_none=True)
        v = critic(t, mask, packed=packed)
        (v**2).sum().backward()
        return v.detach(), [p.grad.clone() for p in critic.parameters() if p.requires_grad]

    whole = [values_and_grads(t) for t in (tokens, tokens, other)]
    assert len(runs) == 3
    runs.clear()
    with critic.trunk_cache():
        cached = [values_and_grads(t) for t in (tokens, tokens, other, tokens)]
        with torch.no_grad():
            again = critic(other, mask, packed=packed)
    assert len(runs) == 2  # once for each batch
    for (v, grads), (w, wgrads) in zip([*whole, whole[0]], cached, strict=True):
        assert torch.equal(v, w)
        assert all(torch.equal(a, b) for a, b in zip(grads, wgrads, strict=True))
    assert torch.equal(again, whole[2][0])
    assert critic._trunks is None  # the cache ends with the context
    runs.clear()
    critic(tokens, mask)
    assert len(runs) == 1


def test_no_trunk_is_cached_when_every_layer_trains() -> None:
    critic = ValueModel.from_policy(make_arch_model("llama"), seed=1)
    freeze_attention(critic)  # the paper's critic: every layer's MLP trains
    assert critic.frozen_trunk() == 0
    runs = []
    critic.backbone.layers[0].register_forward_hook(lambda *_: runs.append(1))
    tokens = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    with critic.trunk_cache():
        for _ in range(2):
            critic(tokens, torch.ones_like(tokens))
    assert len(runs) == 2


def test_a_top_layer_critic_step_is_the_same_with_the_trunk_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SAO step (K=2 critic updates, values for GAE, the actor) with the trunk
    cache leaves every weight of the actor and the critic bitwise where the same
    step with whole forwards leaves them."""

    runs: dict[bool, list[int]] = {True: [], False: []}

    def run(cache: bool) -> dict[str, torch.Tensor]:
        rng = random.Random(5)
        policy = build_tiny_policy(TOK, size="0.1m", seed=0)
        critic = ValueModel.from_policy(policy, seed=1)
        freeze_below(critic, 1)
        critic.backbone.layers[0].register_forward_hook(lambda *_: runs[cache].append(1))
        if not cache:
            monkeypatch.setattr(ValueModel, "frozen_trunk", lambda self: 0)
        settings = OptimSettings(actor_lr=1e-3, critic_lr=1e-2, critic_lr_warmup_steps=1)
        trainer = Trainer(policy, critic, PRESETS["sao"], settings)
        for _ in range(2):
            trainer.step([episode(rng, 2, f"g{i}") for i in range(8)])
        monkeypatch.undo()
        named = [*policy.named_parameters(), *critic.named_parameters(prefix="critic")]
        return {n: p.detach().clone() for n, p in named}

    with_cache, without = run(True), run(False)
    # per step: the values and K=2 updates run the trunk 2 times whole, once cached
    assert len(runs[False]) == 2 * len(runs[True]) > 0
    assert with_cache.keys() == without.keys()
    assert all(torch.equal(with_cache[n], without[n]) for n in with_cache)


def test_calibration_by_turn_counts_the_episodes_that_reached_each_turn() -> None:
    # turn 1: values 0.2, 0.4, 0.6 for rewards 0, 1, 1 -> AUC 1 (both successes above
    # the failure); EV = 1 - Var(R - V) / Var(R): R - V = -0.2, 0.6, 0.4, mean 0.2667,
    # Var = (0.2178 + 0.1111 + 0.0178) / 3 = 0.1156; Var(R) = 2/9 = 0.2222 -> EV 0.48.
    # turn 2: only the two longer episodes (values 0.9 for reward 0, 0.1 for reward 1):
    # AUC 0. Turn 3: one episode -> left out. A NaN value and a failed episode ([]) are
    # left out too.
    values = [[0.2, 0.9, 0.5], [0.4, 0.1], [0.6], [], [math.nan]]
    fit = heldout_fit_by_turn(values, [0.0, 1.0, 1.0, 0.0, 1.0])
    assert set(fit) == {
        "eval/critic_ev_turn1",
        "eval/critic_auc_turn1",
        "eval/critic_auc_turn2",
        "eval/critic_ev_turn2",
    }
    assert fit["eval/critic_auc_turn1"] == pytest.approx(1.0)
    assert fit["eval/critic_ev_turn1"] == pytest.approx(1 - 0.1156 / (2 / 9), abs=1e-3)
    assert fit["eval/critic_auc_turn2"] == pytest.approx(0.0)


def test_plateaued_counts_batches_since_the_best_gain() -> None:
    fit = CriticFit(window=8)
    fit.record(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))  # no running mean yet
    assert not fit.plateaued(2) and fit.best == -math.inf  # gain undefined: not counted
    # running mean before 0.5; values 0.9/0.1 for 1/0: errors 0.01 each against 0.25
    # each: gain 1 - 0.02 / 0.5 = 0.96 (the first batch has no running mean: left out)
    fit.record(torch.tensor([0.9, 0.1]), torch.tensor([1.0, 0.0]))
    assert not fit.plateaued(2) and fit.best == pytest.approx(0.96)
    # a worse batch (0.1 for 1, 0.9 for 0: errors 0.81 each): gain 1 - 1.64 / 1.0 = -0.64
    fit.record(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 0.0]))
    assert not fit.plateaued(2) and fit.since_best == 1
    fit.record(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))  # no better
    assert fit.plateaued(2) and fit.since_best == 2
    state = fit.state_dict()
    again = CriticFit(window=8)
    again.load_state_dict(state)
    assert (again.best, again.since_best) == (fit.best, 2)


def test_turn_start_values_read_each_turns_first_action_token() -> None:
    # row 0: prompt, turn 0 at 1-2, observation, turn 1 at 4; row 1: one turn at 1
    turn_id = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, -1, -1, -1]])
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 0.4], [9.0, 0.6, 9.0, 9.0, 9.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    items = turn_start_values(values, returns, turn_id)
    assert [(k, r) for k, _, r in items] == [(0, 1.0), (1, 1.0), (0, 0.0)]
    assert [v for _, v, _ in items] == pytest.approx([0.1, 0.4, 0.6])
    fit = CriticFit(window=4)
    fit.record_turns(items)
    fit.record_turns([(1, 0.1, 0.0)])
    stats = fit.stats()  # no prompt pairs: only the turns' readings
    # turn 1 (index 0): values 0.1 (R 1), 0.6 (R 0): AUC 0; turn 2: 0.4 (R 1), 0.1 (R 0): AUC 1
    assert stats["critic/heldout_auc_turn1"] == 0.0 and stats["critic/heldout_auc_turn2"] == 1.0
    again = CriticFit(window=4)
    again.load_state_dict(fit.state_dict())
    assert {k: list(v) for k, v in again.by_turn.items()} == {
        k: list(v) for k, v in fit.by_turn.items()
    }
