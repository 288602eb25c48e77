"""Named algorithm presets: SAO and the baselines it is compared against.

A preset is plain typed data: which advantage estimator, which policy loss,
the group size, and the critic settings, with the paper's defaults
(ALGORITHMS.md sections 1-5). The mapping from these names to the functions in
``sao.algo`` lives at the config edge (``sao.train``), never inside a loss.

Every field is documented by the string literal under it (an attribute
docstring); :func:`field_docs` reads them, so the configuration reference is
generated from here and cannot drift.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from dataclasses import dataclass, replace
from typing import Literal

AdvantageName = Literal[
    "gae", "step_average", "step_last_token", "group", "rloo", "reinforce_pp", "running_mean"
]
LossName = Literal["dis", "ppo_clip", "gspo", "cispo"]
Reduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Correction = Literal["none", "tis", "icepop"]
Truncation = Literal["bootstrap", "drop", "zero"]


@dataclass(frozen=True)
class AlgoPreset:
    """Everything that distinguishes one RL algorithm from another."""

    name: str = "sao"
    """Preset name (for logs)."""

    advantage: AdvantageName = "gae"
    """Advantage estimator: 'gae' (critic + skip-observation token GAE), 'step_average' /
    'step_last_token' (step-level GAE), 'group' (GRPO / Dr.GRPO), 'rloo', 'reinforce_pp',
    'running_mean'.
    """

    loss: LossName = "dis"
    """Policy loss: 'dis' (ratio vs the rollout engine, strict double-sided token mask), 'ppo_clip'
    (vs the trainer's pre-update policy), 'gspo', 'cispo'.
    """

    eps_low: float = 0.3
    """Lower band / clip width (DIS keeps r > 1 - eps_low)."""

    eps_high: float = 5.0
    """Upper band / clip width (DIS keeps r < 1 + eps_high)."""

    reduction: Reduction = "token_mean"
    """Loss aggregation: 'token_mean' (all action tokens of the batch, masked tokens kept in the
    denominator), 'seq_mean_token_mean', 'seq_mean_token_sum_norm' (Dr.GRPO).
    """

    correction: Correction = "none"
    """Train/inference mismatch correction for PPO-family losses: 'tis' (truncated IS weight, cap
    2) or 'icepop' (mask tokens whose train/infer ratio leaves [0.5, 2]).
    """

    group_size: int = 1
    """Rollouts per prompt. 1 = single rollout (SAO); a group is released when complete."""

    normalize_std: bool = True
    """Group advantages divide by the group std (GRPO)."""

    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO)."""

    overlong_penalty: bool = False
    """DAPO overlong reward shaping (soft length penalty)."""

    running_mean_window: int = 8
    """Window of past rewards for the running-mean baseline."""

    running_mean_per_prompt: bool = True
    """Running mean over the same prompt's rewards (False: one global window)."""

    use_critic: bool = True
    """Train a value model (needed by 'gae' and step-level GAE)."""

    critic_steps: int = 2
    """K: critic optimizer steps per actor step (paper: 2)."""

    freeze_critic_attention: bool = True
    """Freeze the critic's attention parameters during RL (paper)."""

    critic_pretrain_steps: int = 10
    """Critic-only warm-up steps before RL, sampling with the frozen initial policy."""

    value_clip: float | None = None
    """PPO-style value clipping width for the critic loss (None: plain squared error, paper)."""

    value_head_init: Literal["random", "zero"] = "random"
    """The new critic's value head: 'random' (small normal weight, bias 0: gradient reaches
    the trunk from the first update) or 'zero' (weight and bias 0: the critic starts as the
    constant 0, so its first advantages hold no token-to-token noise) [choice, not the paper's].
    """

    critic_train_layers: int | None = None
    """Train only the critic's top N decoder layers (with frozen attention: their MLPs), its
    final norm and its value head; the layers below and the embeddings are frozen, so the
    critic's backward stops at layer L - N and a step runs them once, not in each of its
    critic forwards (a cheaper critic). None: every layer (paper)
    [choice, not the paper's].
    """

    critic_pretrain_patience: int | None = None
    """End the critic-only warm-up once the critic's held-out gain over the running mean
    (``critic/heldout_gain``, its predictions at the prompt before it trained on each
    episode) has not risen for this many warm-up batches in a row: value pretraining until
    the held-out value stops improving (VC-PPO, VAPO). ``critic_pretrain_steps`` is then the
    most warm-up batches, and those left over train the actor: a run still takes
    ``train.steps + critic_pretrain_steps`` batches. None: exactly ``critic_pretrain_steps``
    (paper) [choice, not the paper's].
    """

    critic_ready_gain: float | None = None
    """Give the actor Monte-Carlo advantages (lambda 1) until the critic predicts the return
    better than the running mean of earlier returns, on episodes it has not trained on:
    ``critic/heldout_gain`` (``1 - MSE(critic) / MSE(running mean)`` over the last 128
    episodes' values at the prompt, each taken before the critic saw its episode) >= this;
    then ``lam_actor`` (or the length-adaptive lambda). None: always the configured lambda
    (paper). Keeps a young critic's token-to-token noise out of the actor's advantages
    [choice, not the paper's].
    """
    ev_gate: bool = False
    """EVPO's gate (Pan et al. 2026, arXiv 2604.19485): on each batch, the actor's advantages
    come from the critic only when its explained variance of the critic's targets over the
    batch's action tokens (``1 - Var(R - V) / Var(R)``, the values before this step's update)
    is above 0; otherwise from the batch mean (``R - mean R`` on every token of an episode),
    whose variance is then the lower. The critic trains either way. False: always the critic
    (paper) [choice, not the paper's].
    """
    gamma: float = 1.0
    """Discount factor."""

    lam_actor: float | None = None
    """Actor GAE lambda; None = length-adaptive 1 - 1/(alpha * l) (VAPO)."""

    lam_alpha: float = 1.5
    """alpha of the length-adaptive lambda (paper: 1.5; VAPO: 0.05)."""

    lam_critic: float = 1.0
    """Critic-target GAE lambda (1 = Monte-Carlo returns)."""

    truncation: Truncation = "zero"
    """Episodes cut by the length limit: 'zero' (terminal: the environment's score is final),
    'bootstrap' from the value at the cut (for tasks whose reward continues past the limit), or
    'drop' (not trained on). Bootstrapping an episodic task pays a policy for running out of
    budget (the value at the cut exceeds the score of a wrong answer), a reward hack.
    """

    whiten_advantages: bool = False
    """Normalise advantages over the batch's action tokens."""

    advantages_after_critic_update: bool = False
    """Compute actor advantages with the critic after this step's K updates (default: before, so
    actor and critic could run in parallel).
    """

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        needs_group = self.advantage in ("group", "rloo") or self.dynamic_sampling
        if needs_group and self.group_size < 2:
            raise ValueError(
                f"advantage={self.advantage!r} / dynamic_sampling needs group_size >= 2, "
                f"got {self.group_size}"
            )
        needs_critic = self.advantage in ("gae", "step_average", "step_last_token")
        if needs_critic and not self.use_critic:
            raise ValueError(f"advantage={self.advantage!r} needs use_critic=True")
        if not 0.0 < self.eps_low <= 1.0:
            raise ValueError(f"eps_low must be in (0, 1], got {self.eps_low}")
        if not self.eps_high > 0.0:
            raise ValueError(f"eps_high must be > 0, got {self.eps_high}")
        if self.critic_steps < 1:
            raise ValueError(f"critic_steps must be >= 1, got {self.critic_steps}")
        if self.lam_actor is not None and not 0.0 <= self.lam_actor <= 1.0:
            raise ValueError(f"lam_actor must be in [0, 1] or None, got {self.lam_actor}")
        if not 0.0 <= self.lam_critic <= 1.0:
            raise ValueError(f"lam_critic must be in [0, 1], got {self.lam_critic}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.lam_alpha <= 0:
            raise ValueError(f"lam_alpha must be > 0, got {self.lam_alpha}")
        if self.value_head_init not in ("random", "zero"):
            raise ValueError(
                f"value_head_init must be random or zero, got {self.value_head_init!r}"
            )
        if self.critic_train_layers is not None and self.critic_train_layers < 1:
            raise ValueError(
                f"critic_train_layers must be >= 1 or None, got {self.critic_train_layers}"
            )
        patience = self.critic_pretrain_patience
        if patience is not None and patience < 1:
            raise ValueError(f"critic_pretrain_patience must be >= 1 or None, got {patience}")
        if self.critic_ready_gain is not None and not self.critic_ready_gain <= 1.0:
            raise ValueError(
                f"critic_ready_gain must be <= 1 or None, got {self.critic_ready_gain}"
            )

    def with_(self, **changes: object) -> AlgoPreset:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


def field_docs() -> dict[str, str]:
    """Each preset field's documentation, for generated references."""
    (cls_node,) = ast.parse(inspect.getsource(AlgoPreset)).body
    assert isinstance(cls_node, ast.ClassDef)
    docs: dict[str, str] = {}
    body = cls_node.body
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


_SAO = AlgoPreset()
_GROUP = AlgoPreset(
    name="group", advantage="group", group_size=8, use_critic=False, critic_pretrain_steps=0
)
_GROUP_PPO = _GROUP.with_(loss="ppo_clip", eps_low=0.2, eps_high=0.28)
_NO_CRITIC = dict(use_critic=False, critic_pretrain_steps=0)
_PLAIN_CRITIC = dict(critic_steps=1, freeze_critic_attention=False, critic_pretrain_steps=0)

PRESETS: dict[str, AlgoPreset] = {
    # SAO: DIS + critic (K=2, frozen attention, warm-up) + skip-obs GAE, single rollout.
    "sao": _SAO,
    # GRPO: group-normalised advantages, PPO clip with clip-higher (paper: 16 prompts x 8).
    "grpo": _GROUP_PPO.with_(name="grpo"),
    # GRPO advantages with the DIS loss.
    "grpo_dis": _GROUP.with_(name="grpo_dis"),
    # SAO's critic + GAE + DIS, without K=2, frozen attention and value pretraining.
    "sao_dis_only": _SAO.with_(name="sao_dis_only", **_PLAIN_CRITIC),
    # VAPO: critic + length-adaptive GAE (alpha 0.05), PPO clip, no DIS.
    "vapo": _SAO.with_(
        name="vapo", lam_alpha=0.05, loss="ppo_clip", eps_low=0.2, eps_high=0.28, **_PLAIN_CRITIC
    ),
    # R - mean(last 8 rewards of the same prompt), DIS loss, no critic.
    "running_mean": _SAO.with_(name="running_mean", advantage="running_mean", **_NO_CRITIC),
    # Step-level GAE variants (paper App. A.1) with the DIS loss.
    "step_average": _SAO.with_(name="step_average", advantage="step_average"),
    "step_last_token": _SAO.with_(name="step_last_token", advantage="step_last_token"),
    # DAPO: clip-higher, dynamic sampling, token-level loss, overlong shaping.
    "dapo": _GROUP_PPO.with_(name="dapo", dynamic_sampling=True, overlong_penalty=True),
    # Dr.GRPO: no std division, no length normalisation.
    "dr_grpo": _GROUP_PPO.with_(
        name="dr_grpo", normalize_std=False, reduction="seq_mean_token_sum_norm"
    ),
    # GSPO: sequence-level geometric-mean ratio, eps 3e-4 / 4e-4.
    "gspo": _GROUP.with_(name="gspo", loss="gspo", eps_low=3e-4, eps_high=4e-4),
    # CISPO: clipped, detached IS weight; never drops a token.
    "cispo": _GROUP.with_(name="cispo", loss="cispo", eps_low=1.0, eps_high=0.28),
    # RLOO: leave-one-out mean baseline.
    "rloo": _GROUP_PPO.with_(name="rloo", advantage="rloo"),
    # REINFORCE++: global-batch-normalised returns, single rollout.
    "reinforce_pp": _GROUP_PPO.with_(name="reinforce_pp", advantage="reinforce_pp", group_size=1),
    # PPO: critic + GAE (fixed lambda 0.95) + PPO clip.
    "ppo": _SAO.with_(
        name="ppo", lam_actor=0.95, loss="ppo_clip", eps_low=0.2, eps_high=0.2, **_PLAIN_CRITIC
    ),
}


def get_preset(name: str) -> AlgoPreset:
    """The preset called ``name``; a ``ValueError`` lists the valid names."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
