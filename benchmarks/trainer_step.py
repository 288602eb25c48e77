"""Where a trainer step's time goes: one SAO step and one GRPO step on the
same trajectories, each pass timed on its own, against a floating-point model.

Both arms train the same batch (same trajectories, same tokens): ``--batch``
episodes in groups of 8 (GRPO's groups; SAO ignores them), multi-turn, of
one of two length mixes. ``longtail``: turns per episode drawn from a Pareto
law (alpha 1.1, at most 30; median 2) as in ``benchmarks/longtail.py``, each
turn 9 action tokens and 39 observation tokens after a 40-token prompt
(up to ~1,500 tokens). ``calc``: calc-tiny's episodes, 1-3 turns of ~70-160
tokens. The arms alternate for ``--repeats`` rounds after a warm-up step.

Passes are timed by wrapping, for the duration of a measured step, the
functions the step calls (nothing in ``sao.train`` changes): the collation,
each model's forward (SAO: the values forward and each of the K critic
updates' forwards) and backward, the optimizer (gradient load and clipping,
AdamW, the weight write-back), GAE and advantages, the losses, the NaN/inf and
AdamW-update-bound checks, the micro-batch selection and the metrics. Each
pass's time is exclusive (a nested pass is not counted twice). The sum of
the passes is printed against the step's wall time; their difference is the
step's own glue.

Floating-point work (counted, not measured). With ``P_b`` the transformer
blocks' GEMM weights (q/k/v/o, MLP), ``P_h = V * d`` the LM head, ``P_t``
the critic's trainable GEMM weights (the MLP: frozen attention's q/k/v/o get
no weight gradient), ``N`` real tokens, ``L`` layers, ``d`` hidden size,
and ``S = sum over rows of len^2 / 2`` (causal attention's score pairs):

- a forward: ``2 * P * N + 4 * L * d * S`` (GEMMs, then ``QK^T`` and ``AV``);
- its backward: ``2 * P * N + 8 * L * d * S`` (activation gradients, and
  attention's two gradients per product) plus ``2 * P_w * N`` for the weight
  gradients (``P_w = P`` for the actor, ``P_t`` for the critic);
- actor forward+backward (``P = P_b + P_h``): ``6 * (P_b + P_h) * N + 12 L d S``;
- one critic update (``P = P_b``, no head): ``(4 P_b + 2 P_t) N + 12 L d S``;
- SAO needs the actor's forward+backward and K = 2 critic updates (the values
  for GAE are the first update's forward); GRPO needs the actor's
  forward+backward. The work ratio SAO/GRPO is printed beside the measured
  time ratio. The LM head's recomputation under activation checkpointing
  (``2 P_h N``) and GRPO's old-policy forward are performed but not needed, so
  they count as overhead.

MFU: the needed work divided by the step's wall time and by this CPU's
measured float32 GEMM rate (a ``--gemm``-sized ``torch.mm``).

    PYTHONPATH=. python benchmarks/trainer_step.py [--model tiny|PATH] [--mix longtail|calc]
        [--batch 32] [--repeats 3] [--packing] [--budget 8192]
        [--critic-train-layers N --arms sao,grpo,sao_whole]
"""

from __future__ import annotations

import argparse
import copy
import random
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

import sao.train.sharded as sharded_mod
import sao.train.trainer as trainer_mod
from sao.algo.presets import get_preset
from sao.app.cpu import cpu_model
from sao.models.freeze import freeze_attention, freeze_below
from sao.models.loading import load_policy
from sao.models.tiny import tiny_config
from sao.models.value import ValueModel
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory, Turn

GROUP = 8


# ------------------------------------------------------------------ the batch


def episode_turns(mix: str, rng: random.Random) -> tuple[int, list[tuple[int, int]]]:
    """(prompt length, [(action tokens, observation tokens)] per turn) of one episode."""
    if mix == "longtail":
        turns = min(30, 1 + int(rng.random() ** (-1 / 1.1)))
        return 40, [(9, 39)] * turns
    turns = rng.choice((1, 1, 2, 2, 3))  # calc-tiny: a call or two, then the answer
    return rng.randint(30, 50), [(rng.randint(12, 24), rng.randint(8, 20))] * turns


def make_batch(mix: str, batch: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """``batch`` trajectories in groups of :data:`GROUP` (one prompt each)."""
    rng = random.Random(seed)
    trajs = []
    for b in range(batch):
        prompt, turns = episode_turns(mix, rng)
        mask = [False] * prompt
        spans = []
        for k, (act, obs) in enumerate(turns):
            start = len(mask)
            mask += [True] * act
            end = len(mask)
            if k < len(turns) - 1:
                mask += [False] * obs
            spans.append(Turn(start, end, len(mask)))
        n = len(mask)
        trajs.append(
            Trajectory(
                prompt_id=f"p{b // GROUP}",
                tokens=tuple(rng.randrange(1, vocab) for _ in range(n)),
                action_mask=tuple(mask),
                rollout_logp=tuple(-rng.uniform(0.5, 3.0) if a else 0.0 for a in mask),
                versions=tuple(0 if a else -1 for a in mask),
                turns=tuple(spans),
                reward=float(rng.random() < 0.5),
                finish_reason="stop",
                group_id=f"g{b // GROUP}",
            )
        )
    return trajs


# ------------------------------------------------------------------ the models


def build_policy(model: str) -> PreTrainedModel:
    """calc-tiny's policy shape (1m Llama, a character vocabulary) or a checkpoint."""
    if model == "tiny":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("llama", "1m", vocab_size=128))
    return load_policy(model)


def trainers(
    policy: PreTrainedModel, settings: OptimSettings, train_layers: int | None = None
) -> tuple[Trainer, Trainer, ValueModel]:
    """(SAO trainer, GRPO trainer, SAO's critic), each on its own copy of ``policy``;
    ``train_layers``: the critic trains its top layers only (``algo.critic_train_layers``)."""
    critic = ValueModel.from_policy(copy.deepcopy(policy))
    freeze_attention(critic)  # as sao.app.parts.load_critic does for SAO
    if train_layers is not None:
        freeze_below(critic, train_layers)
    sao = Trainer(copy.deepcopy(policy), critic, get_preset("sao"), settings)
    grpo = Trainer(policy, None, get_preset("grpo"), settings)
    return sao, grpo, critic


def without_trunk_cache(sao: Trainer) -> Trainer:
    """A copy of the SAO trainer whose critic runs every forward whole (no
    :meth:`ValueModel.trunk_cache`): what a frozen trunk cost before it was cached."""
    assert sao.policy is not None and sao.critic is not None
    critic = copy.deepcopy(sao.critic)
    critic.frozen_trunk = lambda: 0  # type: ignore[method-assign]
    return Trainer(copy.deepcopy(sao.policy), critic, sao.algo, sao.opt)


# ------------------------------------------------------------------ work model


def gemm_weights(module: nn.Module, *, trainable: bool = False) -> int:
    """Weights of the transformer blocks' ``nn.Linear`` layers (LM/value heads excluded)."""
    return sum(
        m.weight.numel()
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear)
        and ".layers." in f".{name}"
        and (m.weight.requires_grad or not trainable)
    )


def work(
    policy: PreTrainedModel, critic: ValueModel, lengths: list[int], K: int
) -> dict[str, float]:
    """FLOPs of each needed pass (the module docstring's formulas)."""
    cfg = policy.config
    N, L, d = sum(lengths), cfg.num_hidden_layers, cfg.hidden_size
    S = sum(n * n for n in lengths) / 2
    P_b, P_h = gemm_weights(policy), cfg.vocab_size * d
    P_t = gemm_weights(critic, trainable=True)
    attn = 4 * L * d * S
    actor = 6 * (P_b + P_h) * N + 3 * attn
    update = (4 * P_b + 2 * P_t) * N + 3 * attn
    return {
        "actor fwd+bwd": actor,
        "critic update": update,
        "values fwd": 2 * P_b * N + attn,
        "sao": actor + K * update,
        "grpo": actor,
    }


def gemm_rate(n: int, repeats: int = 5) -> float:
    """Float32 FLOP/s of an ``n x n @ n x n`` ``torch.mm`` (median of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


# ------------------------------------------------------------------ pass timing


def usage() -> tuple[float, float]:
    """(system CPU seconds, minor page faults) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_stime, float(r.ru_minflt)


class Passes:
    """Exclusive wall time per pass label while :meth:`measuring` is active,
    and with it the system CPU time and minor page faults (the kernel's share:
    freshly mapped memory is zeroed on first touch, one fault a page)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.sys: dict[str, float] = defaultdict(float)
        self.faults: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[float, float, float]] = []
        self.critic_applied = 0  # critic optimizer updates so far in this step
        self.in_update = False  # inside update_critic
        self.owner = "actor"  # whose forward ran last (its backward follows)

    def timed(self, label: Callable[[], str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start, (sys0, flt0) = time.perf_counter(), usage()
            self._stack.append((0.0, 0.0, 0.0))
            try:
                return fn(*args, **kwargs)
            finally:
                spent, (sys1, flt1) = time.perf_counter() - start, usage()
                own = (spent, sys1 - sys0, flt1 - flt0)
                inner = self._stack.pop()
                name = label() if callable(label) else label
                self.t[name] += own[0] - inner[0]
                self.sys[name] += own[1] - inner[1]
                self.faults[name] += own[2] - inner[2]
                if self._stack:
                    w, c, f = self._stack[-1]
                    self._stack[-1] = (w + own[0], c + own[1], f + own[2])

        return run

    def critic_pass(self) -> str:
        if torch.is_grad_enabled():
            self.owner = f"critic update {self.critic_applied + 1}"
            return f"{self.owner} forward"
        return "values fwd (after update, metrics)" if self.in_update else "values fwd (for GAE)"

    def actor_pass(self) -> str:
        self.owner = "actor"
        return "actor forward" if torch.is_grad_enabled() else "actor forward (old policy)"

    @contextmanager
    def measuring(self, trainer: Trainer) -> Iterator[None]:
        """Wrap the functions ``trainer.step`` calls; restore them on exit."""
        self.critic_applied, self.in_update = 0, False
        saved: list[tuple[object, str, object, bool]] = []

        def patch(obj: object, name: str, label: Callable[[], str] | str) -> None:
            saved.append((obj, name, getattr(obj, name), name in vars(obj)))
            setattr(obj, name, self.timed(label, getattr(obj, name)))

        def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(model: str, *args: Any) -> Any:
                out = fn(model, *args)
                self.critic_applied += model == "critic"
                return out

            return run

        def update_critic(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                self.in_update = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.in_update = False

            return run

        checks = "NaN/inf + update-bound checks"
        optim = lambda: f"optimizer ({self.owner})"  # noqa: E731
        patch(trainer_mod, "collate", "collation")
        patch(trainer, "prepare", "collation")
        patch(trainer_mod, "compute_targets", "GAE and advantages")
        patch(trainer_mod, "value_loss", "losses")
        patch(trainer_mod, "policy_loss", "losses")
        patch(trainer_mod, "nonfinite", checks)
        patch(trainer_mod, "adamw_step_bound", checks)
        patch(trainer_mod.Guard, "usable", checks)
        patch(trainer_mod.Guard, "loss", checks)
        patch(trainer, "_apply", checks)  # its own body: the counts, the host sync
        patch(trainer_mod, "clip_grad_norm", optim)
        patch(sharded_mod, "select_rows", "micro-batch selection")
        patch(trainer, "batch_stats", "metrics")
        patch(trainer_mod, "to_cpu", "metrics")
        patch(torch.Tensor, "backward", lambda: f"{self.owner} backward")
        for weights, opt in (
            (trainer.actor_weights, trainer.actor_optim),
            (trainer.critic_weights, trainer.critic_optim),
        ):
            if weights is not None and opt is not None:
                patch(weights, "load_grads", optim)
                patch(weights, "store", optim)
                patch(opt, "step", optim)
        if trainer.actor is not None:
            patch(trainer.actor, "forward", self.actor_pass)
        if trainer.critic is not None:
            patch(trainer.critic, "forward", self.critic_pass)
        # bookkeeping wrappers (no time of their own)
        saved.append((trainer, "_apply", trainer._apply, True))  # (the timed one)
        trainer._apply = apply(trainer._apply)  # type: ignore[method-assign]
        saved.append((trainer, "update_critic", trainer.update_critic, False))
        trainer.update_critic = update_critic(trainer.update_critic)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for obj, name, old, own in reversed(saved):
                if own:
                    setattr(obj, name, old)
                else:
                    delattr(obj, name)


Step = tuple[float, float, float, Passes]
"""(wall seconds, system CPU seconds, minor page faults, its passes) of one step."""


def timed_step(trainer: Trainer, trajs: list[Trajectory]) -> Step:
    """One measured ``trainer.step``."""
    passes = Passes()
    with passes.measuring(trainer):
        t0, (sys0, flt0) = time.perf_counter(), usage()
        trainer.step(trajs)
        wall, (sys1, flt1) = time.perf_counter() - t0, usage()
    return wall, sys1 - sys0, flt1 - flt0, passes


# ------------------------------------------------------------------ report

NEEDED = ("actor forward", "actor backward", "critic update", "optimizer", "GAE", "losses")
"""Passes a step needs (the rest is overhead: checks, metrics, extra forwards, glue)."""


def needed(label: str) -> bool:
    return label.startswith(NEEDED) and "old policy" not in label


def report(name: str, steps: list[Step], flops: float) -> float:
    """Print one arm's per-pass medians; return its median wall time."""
    wall = statistics.median(s[0] for s in steps)
    runs = [s[3] for s in steps]
    labels = sorted(
        {k for r in runs for k in r.t},
        key=lambda k: -statistics.median([r.t.get(k, 0.0) for r in runs]),
    )

    def med(table: str, k: str) -> float:
        return statistics.median([getattr(r, table).get(k, 0.0) for r in runs])

    total = sum(med("t", k) for k in labels)
    need = sum(med("t", k) for k in labels if needed(k))
    print(f"\n{name}: step {wall:.3f} s (median of {len(steps)})")
    print(f"  {'pass':42s} {'s':>8s} {'share':>6s} {'sys s':>7s} {'faults':>8s}")
    for k in labels:
        mark = "" if needed(k) else "  (overhead)"
        t, sys, flt = med("t", k), med("sys", k), med("faults", k)
        print(f"  {k:42s} {t:8.3f} {t / wall:6.1%} {sys:7.2f} {flt:8.0f}{mark}")
    print(f"  {'sum of passes':42s} {total:8.3f} {total / wall:6.1%}")
    print(f"  {'passes the step needs':42s} {need:8.3f}   step / needed = {wall / need:.2f}x")
    sys, flt = statistics.median(s[1] for s in steps), statistics.median(s[2] for s in steps)
    print(
        f"  system CPU {sys:.2f} s ({sys / wall:.0%} of the step), {flt:,.0f} minor page "
        f"faults ({flt * resource.getpagesize() / 2**30:.1f} GiB first touched)"
    )
    print(f"  needed work {flops / 1e9:,.1f} GFLOP, {flops / wall / 1e9:,.2f} GFLOP/s")
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' (calc-tiny's 1m Llama) or a HF dir")
    p.add_argument("--mix", choices=("longtail", "calc"), default="longtail")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=8192, help="train.token_budget")
    p.add_argument("--packing", action="store_true", help="train.packing=true")
    p.add_argument("--gemm", type=int, default=2048, help="side of the torch.mm rate test")
    p.add_argument("--arms", default="sao,grpo", help="of sao, grpo, sao_whole")
    p.add_argument(
        "--critic-train-layers",
        type=int,
        help="SAO's critic trains its top N layers only; arm sao_whole runs its frozen "
        "trunk in every forward (no trunk cache)",
    )
    args = p.parse_args()
    policy = build_policy(args.model)
    trajs = make_batch(args.mix, args.batch, policy.config.vocab_size)
    lengths = [len(t.tokens) for t in trajs]
    settings = OptimSettings(token_budget=args.budget, packing=args.packing)
    sao, grpo, critic = trainers(policy, settings, args.critic_train_layers)
    K = sao.algo.critic_steps
    w = work(policy, critic, lengths, K)
    names = args.arms.split(",")
    arms = {"sao": sao, "grpo": grpo}
    if "sao_whole" in names:
        arms["sao_whole"], w["sao_whole"] = without_trunk_cache(sao), w["sao"]
    print(
        f"model {args.model}: {sum(q.numel() for q in policy.parameters()):,} parameters; "
        f"mix {args.mix}: {len(lengths)} episodes, {sum(lengths):,} tokens "
        f"(median {statistics.median(lengths):.0f}, max {max(lengths)}), "
        f"{sum(sum(t.action_mask) for t in trajs):,} action tokens; "
        f"token_budget={args.budget}, packing={args.packing}, "
        f"torch threads={torch.get_num_threads()}"
    )
    rate = gemm_rate(args.gemm)
    print(f"float32 GEMM rate (torch.mm {args.gemm}^3): {rate / 1e9:.1f} GFLOP/s; {cpu_model()}")
    for n in names:  # warm-up: first-call checks (head, packing), allocator
        arms[n].step(trajs)
    steps: dict[str, list[Step]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            steps[n].append(timed_step(arms[n], trajs))
    med = {n: report(n.upper(), steps[n], w[n]) for n in names}
    rate2 = gemm_rate(args.gemm)
    print(f"\nfloat32 GEMM rate after: {rate2 / 1e9:.1f} GFLOP/s")
    for n in names:
        print(f"  {n.upper()} MFU: {w[n] / med[n] / max(rate, rate2):.1%} of the GEMM rate")
    if "sao_whole" in names and "sao" in names:
        print(f"SAO with the trunk cache / without: time {med['sao'] / med['sao_whole']:.2f}x")
    if "sao" in names and "grpo" in names:
        print(
            f"SAO/GRPO: time {med['sao'] / med['grpo']:.2f}x, "
            f"work {w['sao'] / w['grpo']:.2f}x "
            f"(actor fwd+bwd {w['actor fwd+bwd'] / 1e9:.1f} GFLOP, "
            f"critic update {w['critic update'] / 1e9:.1f}, values fwd {w['values fwd'] / 1e9:.1f})"
        )


if __name__ == "__main__":
    main()
