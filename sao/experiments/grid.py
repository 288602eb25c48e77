"""Experiments are data: ``sao experiment`` runs a grid of arms x seeds, each
run a ``sao train`` subprocess in its own run directory, and reports it.

An :class:`Experiment` is a name, the paper claim it tests, a base preset with
overrides, and arms (arm name -> ``--set`` overrides). The named ones
(:data:`EXPERIMENTS`) reproduce the paper's comparisons at tiny scale; a TOML
file defines others (:func:`load_grid`)::

    [experiment]
    name = "lr"
    claim = "A lower actor LR trains more stably."
    preset = "calc-tiny"
    base = ["train.steps=50"]

    [arms.lr3e-4]
    set = ["train.actor_lr=3e-4"]
    [arms.lr1e-4]
    set = ["train.actor_lr=1e-4"]

Layout of a results directory ``DIR`` (default ``experiments/NAME``)::

    DIR/experiment.json               the name and definition (one experiment per DIR)
    DIR/runs/ARM/seed-S/              `sao train --set seed=S --set log.run_dir=...`
    DIR/logs/ARM/seed-S.log           its stdout and stderr
    DIR/results.csv results.md *.png  the report (sao.experiments.report)

Running (:mod:`sao.experiments.runner`) resumes: a run whose ``summary.json``
exists is kept, one with a checkpoint is continued (``sao train --resume``),
any other is started afresh. The report is :mod:`sao.experiments.report`'s.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sao.config import ConfigError, load_config, read_file

EXPERIMENT_BASE = ("log.checkpoint_every=50", "eval.every=10")
"""Overrides every named experiment starts from: a checkpoint every 50 steps (an
interrupted run loses at most that many), held-out success every 10."""

RESERVED = ("seed", "log.run_dir", "log.live")
"""Keys the runner sets for each run; ``--set`` may not."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Experiment:
    """A grid of arms (each a list of ``--set`` overrides) over one base config."""

    name: str
    claim: str
    """The paper's claim this tests, with the paper's numbers, and what stands in for it here."""
    preset: str
    """The config preset every arm starts from (``calc-tiny``, ...)."""
    arms: Mapping[str, tuple[str, ...]]
    base: tuple[str, ...] = ()
    """Overrides of every arm (applied before the arm's own)."""
    cost: str = ""
    """Estimated wall-clock cost, with how it was estimated."""
    marks: tuple[int, ...] = ()
    """Actor steps drawn as vertical lines in the plots (e.g. preference switches)."""
    claims: tuple[str, ...] = ()
    """The comparisons the claim makes, stated before the runs (:mod:`sao.experiments.claims`:
    ``"sao > grpo"``, ``"collapse: grpo > sao"``); the report judges each."""

    def __post_init__(self) -> None:
        for what, name in [("experiment", self.name), *(("arm", a) for a in self.arms)]:
            if not _NAME.match(name):
                raise ConfigError(
                    f"{what} name {name!r} must be letters, digits, '.', '_' or '-' "
                    "(it names a directory)"
                )
        if not self.arms:
            raise ConfigError(f"experiment {self.name!r} has no arms")
        from sao.experiments.claims import Claim, ClaimError

        for text in self.claims:
            try:
                Claim.parse(text, list(self.arms))
            except ClaimError as e:
                raise ConfigError(f"experiment {self.name!r}: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Experiment:
        """Inverse of :meth:`to_dict`."""
        arms, base, marks = d["arms"], d.get("base", []), d.get("marks", [])
        claims = d.get("claims", [])
        assert isinstance(arms, Mapping) and isinstance(base, list) and isinstance(marks, list)
        assert isinstance(claims, list)
        return cls(
            name=str(d["name"]),
            claim=str(d["claim"]),
            preset=str(d["preset"]),
            arms={str(a): tuple(map(str, s)) for a, s in arms.items()},
            base=tuple(map(str, base)),
            cost=str(d.get("cost", "")),
            marks=tuple(map(int, marks)),
            claims=tuple(map(str, claims)),
        )

    def to_dict(self) -> dict[str, object]:
        """Plain data (written to ``experiment.json``)."""
        return {
            "name": self.name,
            "claim": self.claim,
            "preset": self.preset,
            "base": list(self.base),
            "arms": {a: list(s) for a, s in self.arms.items()},
            "cost": self.cost,
            "marks": list(self.marks),
            "claims": list(self.claims),
        }


def _steps(n: int) -> tuple[str, ...]:
    return (*EXPERIMENT_BASE, f"train.steps={n}")


_SAO = ("algo=sao",)
_COMPARED = "All arms train 32 trajectories per actor step for the same number of actor steps."

# Costs: measured with two `sao train` runs at once on the reference machine's 2 CPU
# cores (one torch thread each, load ~3 from other work): metrics.jsonl's wall_s over
# 20-30 steps per preset, `sao eval --episodes 200` minus `--episodes 1` for an eval,
# ~15 s per run of start-up; on a quiet machine steps are ~1/3 faster (BENCHMARKS.md:
# 110 calc-tiny SAO steps in 179 s alone on 2 threads).
EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in [
        Experiment(
            name="table1",
            claim=(
                "Paper Table 1 (Qwen3-30B-A3B, asynchronous RL): SAO 97.3 on AIME25; SAO with "
                "the DIS loss only (no K=2 critic steps, frozen critic attention or value "
                "warm-up) 94.2; GRPO with DIS 93.5; GRPO with the PPO clip 84.2, and vanilla "
                "GRPO collapses around step 160 (VAPO around 90). Here: calc-tiny (the "
                "project's task where RL works), asynchronous with the default staleness "
                "bound (runtime.max_lag=4), greedy held-out success in place of AIME25. "
                + _COMPARED
                + " The GRPO arms take 4 prompts x 8 rollouts a step, the SAO arms 32 prompts."
            ),
            preset="calc-tiny",
            base=_steps(250),
            arms={
                "sao": _SAO,
                "sao_dis_only": ("algo=sao_dis_only",),
                "grpo_dis": ("algo=grpo_dis",),
                "grpo": ("algo=grpo",),
            },
            claims=(
                "sao > sao_dis_only",
                "sao_dis_only > grpo_dis",
                "grpo_dis > grpo",
                "collapse: grpo > sao",
            ),
            cost=(
                "~55 min: 12 runs x 250 steps at ~2.2 s (SAO arms) / ~1.4 s (GRPO arms) a step, "
                "2 at a time; the first time, ~5 min more for the seed-1 and seed-2 warm starts"
            ),
        ),
        Experiment(
            name="staleness",
            claim=(
                "Paper Table 1 and sections 5-6, with staleness controlled: group sampling and "
                "the PPO clip break down when the trainer learns from trajectories sampled "
                "several policy versions ago, and SAO's design holds up there. Here: the "
                "table1 arms on calc-tiny, each trained on batches exactly k policy versions "
                "old (runtime.admission=fixed, runtime.max_lag=k; the first k steps less), at "
                "k=0 (synchronous) and k=4 (the paper's bound here), and sao and grpo under "
                "today's default (just-in-time admission, max_lag 4, ~1 version stale). 250 "
                "actor steps (collapses came at step 170 and later); greedy held-out success "
                "on 200 episodes. Pre-stated: at k=4 the table1 order holds pair by pair and "
                "GRPO collapses more often than SAO; GRPO's gap to SAO is wider at k=4 than "
                "at k=0; staleness costs GRPO; SAO beats GRPO at k=0 and under jit. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(250),
            arms={
                f"{arm}_{cond}": (f"algo={algo}", *sets)
                for cond, sets in (
                    ("k0", ("runtime.admission=fixed", "runtime.max_lag=0")),
                    ("k4", ("runtime.admission=fixed", "runtime.max_lag=4")),
                    ("jit", ("runtime.admission=jit", "runtime.max_lag=4")),
                )
                for arm, algo in (
                    ("sao", "sao"),
                    ("sao_dis_only", "sao_dis_only"),
                    ("grpo_dis", "grpo_dis"),
                    ("grpo", "grpo"),
                )
                if cond != "jit" or arm in ("sao", "grpo")
            },
            claims=(
                "sao_k4 > sao_dis_only_k4",
                "sao_dis_only_k4 > grpo_dis_k4",
                "grpo_dis_k4 > grpo_k4",
                "sao_k4 > grpo_k4",
                "collapse: grpo_k4 > sao_k4",
                "sao_k4 - grpo_k4 > sao_k0 - grpo_k0",
                "grpo_k0 > grpo_k4",
                "sao_k0 > grpo_k0",
                "sao_jit > grpo_jit",
            ),
            cost=(
                "~2 min per 100 steps alone (GRPO), ~2x with 2 at a time; 80 runs for 8 seeds: "
                "run --arms sao_k0,grpo_k0,sao_k4,grpo_k4 first (the staleness question), "
                "then the rest; the grid resumes"
            ),
        ),
        Experiment(
            name="critic",
            claim=(
                "Paper Tables 3-4 and Fig. 4 (AIME25 / BeyondAIME): SAO 97.3 / 74.8; one "
                "critic step per actor step (K=1) 95.0 / 69.75; a full-parameter critic "
                "(attention not frozen) 90.62 / 74.50; the running-mean baseline instead of "
                "a critic 79.8 / 55.3; and the value warm-up matters. Here: calc-tiny, "
                "greedy held-out success; the explained-variance plot is Fig. 4's. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(200),
            arms={
                "sao": _SAO,
                "k1": (*_SAO, "algo.critic_steps=1"),
                "full_critic": (*_SAO, "algo.freeze_critic_attention=false"),
                "no_warmup": (*_SAO, "algo.critic_pretrain_steps=0"),
                "running_mean": ("algo=running_mean",),
            },
            claims=("sao > k1", "sao > full_critic", "sao > no_warmup", "sao > running_mean"),
            cost=(
                "~55 min: 15 runs x 200 steps at ~2.2 s (critic arms) / ~1.4 s (running mean) a "
                "step, 2 at a time (+~5 min of warm starts the first time, shared with table1)"
            ),
        ),
        Experiment(
            name="gae",
            claim=(
                "Paper Table 5 and Fig. 6 (multi-turn agentic task, 400 steps): token-level "
                "GAE (SAO) 89.8 vs step-level GAE 85.8 (turn average) / 87.3 (turn last "
                "token), and a higher training reward. Here: calc-tiny, a multi-turn tool "
                "task where RL helps: each episode calls the calculator (its observation is "
                "the result the answer needs) one or more times, then answers; reward at the "
                "end. (guess-tiny, 7 turns, does not learn under RL: BENCHMARKS.md.) " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(150),
            arms={
                "sao": _SAO,
                "step_average": ("algo=step_average",),
                "step_last_token": ("algo=step_last_token",),
            },
            claims=("sao > step_average", "sao > step_last_token"),
            cost=(
                "~35 min: 9 runs x 150 steps at ~2.2 s a step, 2 at a time (+~5 min of warm "
                "starts the first time, shared with table1)"
            ),
        ),
        Experiment(
            name="online",
            claim=(
                "Paper Fig. 5 (online learning under preference shifts): when the preferred "
                "writing style switches, SAO re-aligns faster than the running-mean baseline "
                "with a 128-reward window, and its training reward recovers sooner. Here: "
                "style-shift-tiny, preferred style cute, then chuunibyou from actor step "
                "133, classical from 266 (dashed lines); held-out success is judged with the "
                "style preferred at the time of each eval, and by every style (eval/style_*); "
                "results.md gives the steps each arm needs to recover after each switch. "
                "The reward gives partial credit (task.options.credit=partial: quality x the "
                "preferred style's share of the text's style votes) where the paper's is "
                "binary: with a binary reward, once RL has concentrated the tiny policy on "
                "cute, no sampled text is judged in the new style and there is nothing to "
                "follow (docs/reproduction.md). " + _COMPARED
            ),
            preset="style-shift-tiny",
            base=(*_steps(400), "task.options.credit=partial"),
            arms={
                "sao": _SAO,
                "running_mean": (
                    "algo=running_mean",
                    "algo.running_mean_window=128",
                    "algo.running_mean_per_prompt=false",
                ),
            },
            cost=(
                "~35 min: 6 runs x 400 steps at ~1.6 s a step, 2 at a time; the first time, "
                "~5 min more for the seed-1 and seed-2 warm starts"
            ),
            marks=(133, 266),  # the default schedule of the style_shift task
        ),
        Experiment(
            name="admission",
            claim=(
                "Not a paper claim; the runtime's: starting episodes just in time "
                "(runtime.admission=jit) trains a trainer-bound run on ~1-version-stale data "
                "instead of max_lag-stale data at the same speed, and fresher data collapses "
                "less often. Here: SAO on calc-tiny for 200 actor steps, runtime.max_lag=4 in "
                "both arms. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(200),
            arms={
                "static": (*_SAO, "runtime.admission=static"),
                "jit": (*_SAO, "runtime.admission=jit"),
            },
            claims=("jit > static", "collapse: static > jit"),
            cost="~1 h for 3 seeds: 6 runs of 200 steps at ~2-3 s a step, 1 at a time",
        ),
        Experiment(
            name="stability",
            claim=(
                "Paper sections 5-6: SAO trains stably for about 1000 steps, while under "
                "asynchronous staleness vanilla GRPO (PPO clip, no DIS) collapses around step "
                "160 and VAPO (PPO clip with a critic, no DIS) around step 90. Here: calc-tiny "
                "for 1000 actor steps, asynchronous with the default staleness bound "
                "(runtime.max_lag=4); the collapse step is the first eval after which held-out "
                "success stays below half its initial value. " + _COMPARED
            ),
            preset="calc-tiny",
            base=("log.checkpoint_every=100", "eval.every=20", "train.steps=1000"),
            arms={"sao": _SAO, "grpo": ("algo=grpo",), "vapo": ("algo=vapo",)},
            claims=("collapse: grpo > sao", "collapse: vapo > sao", "sao > grpo", "sao > vapo"),
            cost=(
                "~2.5 h for 3 seeds, ~50 min with --seeds 1: runs of 1000 steps at ~2.2 s "
                "(sao, vapo) / ~1.4 s (grpo) a step, 2 at a time"
            ),
        ),
        Experiment(
            name="smollm2",
            claim=(
                "Not a paper table: the paper's limitations section warns that its results "
                "may not carry over to small models. Here: SmolLM2-135M-Instruct (a real "
                "pretrained checkpoint: `sao models fetch smollm2-135m` first) on one-digit "
                "sums and differences with three fixed `answer X` shots (smollm2-arith-sao), "
                "greedy held-out success on 100 questions. SAO (single rollouts, the "
                "critic as baseline, Monte-Carlo actor advantages) against GRPO in groups of "
                "4 and the running-mean baseline (DIS loss, no critic), at equal trajectories: "
                "30 batches of 16 each, SAO's 4 critic warm-up batches among them (26 actor "
                "steps against 30); every arm at actor LR 2e-5 after a 5-step linear warm-up. "
                "The claim tested: SAO's gain is at least GRPO's."
            ),
            preset="smollm2-arith-sao",
            base=(
                "log.checkpoint_every=50",
                "eval.every=10",
                "train.actor_lr=2e-5",
                "train.actor_lr_warmup_steps=5",
            ),
            arms={
                "sao": ("algo=sao", "train.steps=26"),
                "grpo": ("algo=grpo", "algo.group_size=4", "train.steps=30"),
                "running_mean": ("algo=running_mean", "train.steps=30"),
            },
            claims=("sao > grpo", "sao > running_mean"),
            cost=(
                "~1 h 30 min for 3 seeds, 1 at a time (a run holds 12-14 GB; two at once were "
                "killed for memory on 24 GB): a run of 30 batches takes ~14 min (SAO) / ~7.5 min "
                "(GRPO, running mean) on the 2 quiet cores, model load and 4 evaluations included"
            ),
        ),
    ]
}
"""The named experiments; ``sao experiment --list`` prints them."""


def _closest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.4)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} Valid: {', '.join(valid)}."


def get_experiment(name: str) -> Experiment:
    """The named experiment; an error names the closest one."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}.{_closest(name, list(EXPERIMENTS))}")
    return EXPERIMENTS[name]


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{where} must be a list of 'key=value' strings, got {value!r}")
    return tuple(value)


def _known(table: Mapping[str, object], keys: Sequence[str], where: str) -> None:
    for k in table:
        if k not in keys:
            raise ConfigError(f"unknown key {k!r} in {where}.{_closest(k, keys)}")


def load_grid(path: str | Path) -> Experiment:
    """A custom experiment from a TOML file (see the module docstring)."""
    data = read_file(path)
    _known(data, ["experiment", "arms"], str(path))
    head = data.get("experiment")
    arms = data.get("arms")
    if not isinstance(head, dict) or not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{path}: needs an [experiment] table and at least one [arms.NAME]")
    _known(head, ["name", "claim", "preset", "base", "cost", "marks", "claims"], "[experiment]")
    for key in ("name", "claim"):
        if not isinstance(head.get(key), str):
            raise ConfigError(f'{path}: [experiment] needs {key} = "..."')
    parsed: dict[str, tuple[str, ...]] = {}
    for arm, table in arms.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [arms.{arm}] must be a table with set = [...]")
        _known(table, ["set"], f"[arms.{arm}]")
        parsed[arm] = _strings(table.get("set", []), f"[arms.{arm}] set")
    marks = head.get("marks", [])
    if not isinstance(marks, list) or not all(isinstance(m, int) for m in marks):
        raise ConfigError(f"{path}: [experiment] marks must be a list of steps")
    return Experiment(
        name=head["name"],
        claim=head["claim"],
        preset=str(head.get("preset", "calc-tiny")),
        arms=parsed,
        base=_strings(head.get("base", []), "[experiment] base"),
        cost=str(head.get("cost", "")),
        marks=tuple(marks),
        claims=_strings(head.get("claims", []), "[experiment] claims"),
    )


# ---------------------------------------------------------------------- planning


def _key(item: str) -> str:
    """The dotted key an override sets; ``algo=NAME`` sets ``algo.preset``."""
    key, _, value = item.partition("=")
    key = key.strip()
    return "algo.preset" if key == "algo" and not value.lstrip().startswith("{") else key


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@dataclass(frozen=True)
class Run:
    """One arm x seed: the overrides of its ``sao train`` and where it runs."""

    arm: str
    seed: int
    overrides: tuple[str, ...]
    run_dir: Path
    log: Path

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"


def plan(
    exp: Experiment,
    exp_dir: Path,
    *,
    seeds: int,
    overrides: Sequence[str] = (),
    arms: Sequence[str] | None = None,
) -> list[Run]:
    """The runs of ``exp``, seed by seed (seed 0 of every arm in definition order,
    then seed 1, ...: a grid stopped early leaves whole seeds to pair),
    every config validated first. Errors: an unknown arm, a ``--set`` that sets a
    key one of the arms sets (or a runner key), arms that would not train equal
    trajectories per step and equal actor steps."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    chosen = list(exp.arms) if arms is None else list(arms)
    for arm in chosen:
        if arm not in exp.arms:
            raise ConfigError(
                f"unknown arm {arm!r} of experiment {exp.name!r}.{_closest(arm, list(exp.arms))}"
            )
    _check_overrides(exp, overrides)
    _check_sizes(exp, overrides)
    root = exp_dir.resolve()
    return [
        Run(
            arm,
            seed,
            (*exp.base, *overrides, *exp.arms[arm]),
            root / "runs" / arm / f"seed-{seed}",
            root / "logs" / arm / f"seed-{seed}.log",
        )
        for seed in range(seeds)
        for arm in chosen
    ]


def _check_overrides(exp: Experiment, overrides: Sequence[str]) -> None:
    """Refuse a ``--set`` that sets a runner key or a key one of the arms sets."""
    for item in overrides:
        key = _key(item)
        for reserved in RESERVED:
            if _overlaps(key, reserved):
                raise ConfigError(
                    f"--set {item!r}: the experiment sets {reserved} itself "
                    "(seeds with --seeds, run directories under --dir)"
                )
        for arm, sets in exp.arms.items():
            for own in sets:
                if _overlaps(key, _key(own)):
                    raise ConfigError(
                        f"--set {item!r} conflicts with arm {arm!r}'s own {own!r}; an override "
                        "applies to every arm, so it may not set what an arm sets (define a "
                        "grid with --file instead)"
                    )


def _check_sizes(exp: Experiment, overrides: Sequence[str]) -> None:
    """Validate every arm's config; refuse arms that would not train equal
    trajectories per step and either equal actor steps (a critic's warm-up
    batches on top) or equal batches in all, warm-up included (equal
    trajectories sampled)."""
    sizes: dict[str, tuple[int, int, int]] = {}
    for arm in exp.arms:
        try:
            cfg = load_config(exp.preset, None, [*exp.base, *overrides, *exp.arms[arm]])
        except ConfigError as e:
            raise ConfigError(f"arm {arm!r} of experiment {exp.name!r}: {e}") from None
        warm = cfg.algo.resolve().critic_pretrain_steps
        sizes[arm] = (cfg.train.batch_size, cfg.train.steps, cfg.train.steps + warm)
    steps = {(b, s) for b, s, _ in sizes.values()}
    batches = {(b, n) for b, _, n in sizes.values()}
    if len(steps) > 1 and len(batches) > 1:
        table = ", ".join(f"{a}: {b} x {s} (+{n - s})" for a, (b, s, n) in sizes.items())
        raise ConfigError(
            "arms must train equal trajectories per step, and equal actor steps or equal "
            f"batches warm-up included (train.batch_size x train.steps (+warm-up): {table})"
        )


def claim_dir(exp: Experiment, exp_dir: Path, overrides: Sequence[str]) -> None:
    """Record ``exp`` in ``exp_dir/experiment.json``, or check that the directory
    already holds this experiment with runs made the same way (preset, base,
    overrides, and each arm it shares), then record the current definition: its
    wording, claims and new arms may change; how an existing run was made may not."""
    meta = {"name": exp.name, "definition": exp.to_dict(), "overrides": list(overrides)}
    path = exp_dir / "experiment.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("name") != exp.name:
            raise ConfigError(
                f"{str(exp_dir)!r} holds experiment {old.get('name')!r}, not {exp.name!r}; "
                "pick another --dir"
            )
        was, now = old.get("definition", {}), exp.to_dict()
        what = [k for k in ("preset", "base") if was.get(k) != now[k]]
        what += [
            f"arm {arm!r}"
            for arm, sets in was.get("arms", {}).items()
            if arm in exp.arms and list(exp.arms[arm]) != sets
        ]
        what += ["overrides"] if old.get("overrides") != list(overrides) else []
        if what:
            raise ConfigError(
                f"{str(exp_dir)!r} holds experiment {exp.name!r} run with another "
                f"{', '.join(what)} (overrides there: {old.get('overrides')}); its runs "
                "would not be comparable: pick another --dir"
            )
        if old != meta:
            path.write_text(json.dumps(meta, indent=2) + "\n")
        return
    if exp_dir.exists() and any(exp_dir.iterdir()):
        raise ConfigError(
            f"{str(exp_dir)!r} is not empty and holds no experiment.json; pick another --dir"
        )
    exp_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")


def load_meta(exp_dir: Path) -> dict[str, object]:
    """``exp_dir/experiment.json``; a clear error when ``exp_dir`` holds no experiment."""
    path = exp_dir / "experiment.json"
    if not path.is_file():
        raise ConfigError(
            f"{str(exp_dir)!r} holds no experiment.json, so it is not an experiment directory "
            "(pass the --dir of an earlier `sao experiment`)"
        )
    meta: dict[str, object] = json.loads(path.read_text())
    return meta


def describe(exp: Experiment) -> str:
    """A few lines for ``sao experiment --list``."""
    arms = ", ".join(f"{a} [{' '.join(s)}]" for a, s in exp.arms.items())
    lines = [
        f"{exp.name}  (preset {exp.preset}; {' '.join(exp.base)})",
        f"  arms: {arms}",
        f"  cost: {exp.cost}",
        f"  claim: {exp.claim}",
    ]
    return "\n".join(lines)
