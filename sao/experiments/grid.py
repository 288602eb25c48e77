"""Experiments are data: ``sao experiment`` runs a grid of arms x seeds, each
run a ``sao train`` subprocess in its own run directory, and reports it.

An :class:`Experiment` is a name, the paper claim it tests, a base preset with
overrides, and arms (arm name -> ``--set`` overrides). The named ones
(:data:`sao.experiments.named.EXPERIMENTS`) reproduce the paper's comparisons at tiny scale; a TOML
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
    DIR/runs.jsonl                    the report's runs, curves included
    DIR/earlier.jsonl                 runs carried from another copy (sao.experiments.earlier)

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


def closest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.4)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} Valid: {', '.join(valid)}."


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{where} must be a list of 'key=value' strings, got {value!r}")
    return tuple(value)


def _known(table: Mapping[str, object], keys: Sequence[str], where: str) -> None:
    for k in table:
        if k not in keys:
            raise ConfigError(f"unknown key {k!r} in {where}.{closest(k, keys)}")


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
                f"unknown arm {arm!r} of experiment {exp.name!r}.{closest(arm, list(exp.arms))}"
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
        if what := made_otherwise(old, exp, overrides):
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


def made_otherwise(
    meta: Mapping[str, object], exp: Experiment, overrides: Sequence[str]
) -> list[str]:
    """What of an ``experiment.json``'s ``meta`` says its runs were made otherwise
    than ``exp``'s with ``overrides`` would be: ``preset``, ``base``, ``overrides``,
    ``arm 'NAME'`` (each arm both define); [] when they were made alike."""
    was, now = meta.get("definition", {}), exp.to_dict()
    assert isinstance(was, dict)
    what = [k for k in ("preset", "base") if was.get(k) != now[k]]
    what += [
        f"arm {arm!r}"
        for arm, sets in was.get("arms", {}).items()
        if arm in exp.arms and list(exp.arms[arm]) != sets
    ]
    return what + (["overrides"] if meta.get("overrides") != list(overrides) else [])


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
    if exp.claims:
        lines.append(f"  judged claims: {'; '.join(exp.claims)}")
    return "\n".join(lines)
