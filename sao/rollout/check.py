"""The log-probability check: does the trainer's forward pass reproduce the
rollout engine's log-probabilities?

The DIS ratio ``r = exp(logp - rollout_logp)`` (ALGORITHMS.md section 1)
assumes both sides score the same distribution. This check runs a few
episodes through the engine, recomputes every action token's log-probability
with :func:`sao.models.logprobs.sequence_logprobs` at the sampling
temperature, and reports how far apart they are. On a tiny fp32 model with
the same weights the gap is rounding noise (``<= 1e-4``); bf16, top-p/top-k
sampling or a stale weight version make it larger, and the report's notes say
which of those applies.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sao.models.logprobs import sequence_logprobs
from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.engine import Engine
from sao.types import Env, SamplingParams, Trajectory, collate

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "LOGPROB_BUDGETS",
    "LogprobBudget",
    "LogprobReport",
    "check_logprobs",
    "compare_logprobs",
    "logprob_budget",
    "score_trajectories",
]


@dataclass(frozen=True)
class LogprobBudget:
    """What the check allows: ``max_abs_delta`` bounds every token's
    ``|logp_train - logp_engine|``; ``k3_kl`` (None: unchecked) bounds the mean k3
    estimate of the KL, a statistic that does not grow with the number of tokens."""

    max_abs_delta: float
    k3_kl: float | None = None

    def __str__(self) -> str:
        kl = "" if self.k3_kl is None else f", k3 KL {self.k3_kl:g}"
        return f"max {self.max_abs_delta:g}{kl}"


LOGPROB_BUDGETS = {
    # measured ~1e-6 (rounding of batched against unbatched matmuls): any outlier is a bug
    "float32": (LogprobBudget(1e-4), LogprobBudget(1e-3)),
    # bfloat16's max over a few hundred tokens depends on the CPU's kernels (SmolLM2-135M,
    # 8 episodes: 0.22 on an Intel Xeon with AMX, 0.72 on the CI machine's CPU), its k3 KL
    # much less (1.3e-3 and 2.3e-3): the KL is the gate, the max only catches a gross
    # mismatch (a token scored at another position or with another template)
    "bfloat16": (LogprobBudget(2.0, 0.01), LogprobBudget(2.0, 0.01)),
}
"""The budget by the lowest precision of trainer and engine: (``sao check``, the
pre-training check of ``sao train``). The training check keeps headroom for episodes the
short ``sao check`` run does not meet."""


def logprob_budget(*dtypes: torch.dtype, training: bool = False) -> LogprobBudget:
    """The budget of :data:`LOGPROB_BUDGETS` for weights held in ``dtypes``."""
    low = "bfloat16" if any(d in (torch.bfloat16, torch.float16) for d in dtypes) else "float32"
    return LOGPROB_BUDGETS[low][int(training)]


@dataclass(frozen=True)
class LogprobReport:
    """How far the trainer's log-probabilities are from the engine's, over
    action tokens.

    ``max_abs_delta`` / ``mean_abs_delta``: max and mean of
    ``|logp_train - logp_engine|``. ``k3_kl``: mean of ``(r - 1) - log r`` with
    ``r = p_train / p_engine``, an unbiased, non-negative estimate of
    ``KL(engine || trainer)`` from the engine's samples (Schulman 2020,
    "Approximating KL Divergence", k3). ``notes``: known reasons the two may
    differ (sampling filters, dtypes, weight versions, ...).
    """

    max_abs_delta: float
    mean_abs_delta: float
    k3_kl: float
    num_tokens: int
    num_episodes: int
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line with every number of the report."""
        return (
            f"max |delta logp| = {self.max_abs_delta:.3g}, mean = {self.mean_abs_delta:.3g}, "
            f"k3 KL = {self.k3_kl:.3g} over {self.num_tokens} action tokens in "
            f"{self.num_episodes} episodes"
        )

    def check(self, budget: float | LogprobBudget) -> LogprobReport:
        """Return ``self`` if it is within ``budget`` (a number: the max |delta logp|),
        else raise a RuntimeError that says what differs between engine and trainer."""
        if not isinstance(budget, LogprobBudget):
            budget = LogprobBudget(budget)
        for x in (budget.max_abs_delta, budget.k3_kl):
            if x is not None and not (isinstance(x, (int, float)) and 0 <= x < float("inf")):
                raise ValueError(f"budget must be a finite number >= 0, got {x!r}")
        if self.num_tokens == 0:
            raise RuntimeError(
                "log-probability check compared no action token: every episode ended before "
                "the engine generated anything; "
                + ("; ".join(self.notes) or "check the environments and limits")
            )
        kl_ok = budget.k3_kl is None or self.k3_kl <= budget.k3_kl
        if self.max_abs_delta <= budget.max_abs_delta and kl_ok:
            return self
        causes = "; ".join(self.notes) or (
            "no known cause: check that engine and trainer hold the same weights, dtype, "
            "attention implementation and sampling temperature"
        )
        raise RuntimeError(
            f"engine and trainer log-probabilities differ: {self.summary()}, beyond the budget "
            f"({budget}). What differs: {causes}"
        )


def compare_logprobs(
    train_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    num_episodes: int,
    notes: Sequence[str] = (),
) -> LogprobReport:
    """A :class:`LogprobReport` from trainer and engine log-probabilities.

    Shapes: every argument ``[B, T]``; only positions where ``action_mask_BT``
    is true count. ``log r = train - rollout``; k3 = ``(r - 1) - log r``.
    """
    if not (train_logp_BT.shape == rollout_logp_BT.shape == action_mask_BT.shape):
        raise ValueError(
            f"shapes differ: train_logp_BT {tuple(train_logp_BT.shape)}, rollout_logp_BT "
            f"{tuple(rollout_logp_BT.shape)}, action_mask_BT {tuple(action_mask_BT.shape)}"
        )
    mask_BT = action_mask_BT.bool()
    log_r_N = (train_logp_BT.double() - rollout_logp_BT.double())[mask_BT]
    n = int(log_r_N.numel())
    if n == 0:
        return LogprobReport(0.0, 0.0, 0.0, 0, num_episodes, tuple(notes))
    k3_N = torch.expm1(log_r_N) - log_r_N
    return LogprobReport(
        max_abs_delta=float(log_r_N.abs().max()),
        mean_abs_delta=float(log_r_N.abs().mean()),
        k3_kl=float(k3_N.mean()),
        num_tokens=n,
        num_episodes=num_episodes,
        notes=tuple(notes),
    )


def _diagnose(
    engine: Engine | None,
    model: PreTrainedModel,
    sampling: SamplingParams,
    trajectories: Sequence[Trajectory],
    model_version: int | None,
) -> list[str]:
    """Known reasons the engine and the trainer may disagree, as sentences."""
    notes = []
    if not sampling.trainer_reproducible:
        notes.append(
            f"sampling uses top_p={sampling.top_p}, top_k={sampling.top_k}, a truncated "
            "distribution the trainer's temperature-scaled forward pass does not reproduce; "
            "check with top_p=1.0 and top_k=0"
        )
    if getattr(engine, "kind", None) == "vllm" and sampling.temperature != 1.0:
        notes.append(
            f"a vLLM server returns log-probabilities before temperature unless started with "
            f"--logprobs-mode processed_logprobs; at temperature {sampling.temperature} the "
            "DIS ratio needs the processed ones"
        )
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != ["torch.float32"]:
        notes.append(f"trainer model dtype {'/'.join(dtypes)}: a 1e-4 budget needs float32")
    engine_dtype = getattr(engine, "dtype", None)  # (None when the engine is remote)
    if isinstance(engine_dtype, torch.dtype) and [str(engine_dtype)] != dtypes:
        notes.append(f"engine dtype {engine_dtype} differs from trainer dtype {'/'.join(dtypes)}")
    if model.training:
        notes.append("trainer model is in training mode (dropout may be active); call .eval()")
    seen = sorted(
        {v for t in trajectories for v, m in zip(t.versions, t.action_mask, strict=True) if m}
    )
    stale = any(v != model_version for v in seen)
    engine_version = model_version if engine is None else engine.version
    if model_version is not None and (engine_version != model_version or stale):
        notes.append(
            f"weight version mismatch: trainer model is version {model_version}, engine is "
            f"version {engine_version}, action tokens were sampled by versions {seen}"
        )
    elif len(seen) > 1:
        notes.append(f"weights changed during the check: action tokens carry versions {seen}")
    ended = Counter(t.finish_reason for t in trajectories if t.error is not None)
    if ended:
        first = next(t.error for t in trajectories if t.error is not None)
        notes.append(f"episodes ended with errors {dict(ended)} (first: {first})")
    return notes


async def check_logprobs(
    engine: Engine,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    envs: Sequence[Env],
    sampling: SamplingParams,
    limits: EpisodeLimits,
    *,
    model_version: int | None = None,
    seed: int = 0,
) -> LogprobReport:
    """Run one episode per env (concurrently) and compare the engine's
    log-probabilities with the trainer's forward pass on ``model``.

    ``model`` should hold the weights the engine samples with;
    ``model_version`` (optional) is their version, compared with
    ``engine.version`` and the per-token versions. Env ``i`` is reset with
    seed ``seed + i``. Use ``report.check(budget)`` to fail on a gap.
    """
    if not envs:
        raise ValueError("check_logprobs needs at least one environment in envs, got none")
    trajectories = await asyncio.gather(
        *(
            run_episode(
                env, engine, tokenizer, sampling, limits, seed=seed + i, prompt_id=f"check-{i}"
            )
            for i, env in enumerate(envs)
        )
    )
    return score_trajectories(
        model, tokenizer, trajectories, sampling, engine=engine, model_version=model_version
    )


def score_trajectories(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trajectories: Sequence[Trajectory],
    sampling: SamplingParams,
    *,
    engine: Engine | None = None,
    model_version: int | None = None,
) -> LogprobReport:
    """Compare the engine's log-probabilities recorded in ``trajectories``
    with ``model``'s forward pass (wherever the episodes ran); ``engine``, when
    at hand, adds what it knows to the notes."""
    notes = _diagnose(engine, model, sampling, trajectories, model_version)
    scored = [t for t in trajectories if t.num_action_tokens > 0]
    if not scored:
        return LogprobReport(0.0, 0.0, 0.0, 0, len(trajectories), tuple(notes))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = collate(scored, pad_id=int(pad_id))
    device = next(model.parameters()).device
    with torch.no_grad():
        train_logp_BT = sequence_logprobs(
            model,
            batch.tokens_BT.to(device),
            batch.attention_mask_BT.to(device),
            temperature=sampling.temperature,
        ).cpu()
    return compare_logprobs(
        train_logp_BT,
        batch.rollout_logp_BT,
        batch.action_mask_BT,
        num_episodes=len(trajectories),
        notes=notes,
    )
