"""Resolving a config: preset -> file -> ``--set`` overrides merged into one
mapping (:func:`load_config`), then validated into a :class:`Config` with the
checks that span sections (:func:`validate`); unknown keys are rejected with
the closest valid key suggested."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from sao.config.presets import PRESETS
from sao.config.schema import AlgoConfig, Config
from sao.config.sources import ConfigError, parse_override, read_file


def _suggest(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else f" Valid keys: {', '.join(valid)}."


def _check_critic_ranks(cfg: Config, groups: int) -> None:
    n = cfg.runtime.critic_ranks
    if not n:
        return
    if cfg.runtime.backend != "ray":
        raise ConfigError(
            "runtime.critic_ranks > 0 needs runtime.backend=ray (ranks are Ray actors)"
        )
    if not cfg.algo.resolve().use_critic:
        raise ConfigError(
            f"runtime.critic_ranks={n} but algo {cfg.algo.resolve().name!r} trains no critic; "
            "set runtime.critic_ranks=0"
        )
    if n > groups:
        raise ConfigError(
            f"runtime.critic_ranks ({n}) exceeds the groups per batch ({groups}): groups are "
            "trained whole on one rank, so some ranks would have nothing to train"
        )


def _check_keys(model: type[BaseModel], data: Mapping[str, Any], prefix: str = "") -> None:
    """Reject unknown keys, naming the closest valid one."""
    valid = list(model.model_fields)
    for key, value in data.items():
        if key not in model.model_fields:  # (YAML keys need not be strings: `1: x`)
            hint = _suggest(str(key), valid)
            hint = hint.replace("'", "'" + prefix, 1) if prefix else hint
            raise ConfigError(f"unknown config key {prefix + str(key)!r}.{hint}")
        ann = model.model_fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(value, Mapping):
            _check_keys(ann, value, prefix + key + ".")


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if k == "algo" and isinstance(v, str):  # `algo = "grpo"` is `algo.preset = "grpo"`
            v = {"preset": v}
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = dict(v) if isinstance(v, Mapping) else v
    return out


def _algo_name(algo: object) -> str | None:
    """The algorithm preset a layer's ``algo`` section names (None: it names none)."""
    if isinstance(algo, str):
        return algo
    name = algo.get("preset") if isinstance(algo, Mapping) else None
    return name if isinstance(name, str) else None


def _layer(
    data: dict[str, Any], layer: Mapping[str, Any], dropped: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Merge one source (the preset, the file, the ``--set`` items) onto the ones
    before it. A layer that switches the algorithm (``algo = "sao"`` where an
    earlier layer chose ``grpo``) drops the earlier layers' ``algo.*`` settings
    (recorded in ``dropped``): they were chosen for the other algorithm (a GRPO
    preset's ``group_size = 4`` would make SAO sample groups). The new
    algorithm's own defaults apply unless this same layer sets them."""
    new = _algo_name(layer.get("algo"))
    old = _algo_name(data.get("algo")) or AlgoConfig().preset
    algo = data.get("algo")
    if new is not None and new != old and isinstance(algo, Mapping):
        if dropped is not None:  # (minus what this layer sets anew)
            mine = layer["algo"] if isinstance(layer["algo"], Mapping) else {}
            dropped.update({f"algo.{k}": v for k, v in algo.items() if k not in {"preset", *mine}})
        data = {k: v for k, v in data.items() if k != "algo"}
    return _merge(data, layer)


def resolve_config(
    preset: str | None = None, file: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[Config, dict[str, Any]]:
    """:func:`load_config`, and the ``algo.*`` settings of earlier sources that a
    later source's switch of algorithm dropped (``sao`` shows them); empty when
    none were."""
    data: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for layer in _layers(preset, file, overrides):
        data = _layer(data, layer, dropped)
    return validate(data), dropped


def _layers(
    preset: str | None, file: str | Path | None, overrides: Sequence[str]
) -> list[dict[str, Any]]:
    """The sources in order: the preset, the file, the
    ``--set`` items (one layer together)."""
    layers: list[dict[str, Any]] = []
    if file is not None:
        from_file = read_file(file)
        preset = from_file.pop("preset", preset)
        if preset is not None and not isinstance(preset, str):
            raise ConfigError(
                f"config file {str(file)!r}: preset must be a name, one of {', '.join(PRESETS)}"
            )
        layers.append(_merge({}, from_file))
    cli: dict[str, Any] = {}
    for item in overrides:
        cli = _merge(cli, parse_override(item))
    layers.append(cli)
    name = preset or "calc-tiny"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}.{_suggest(name, sorted(PRESETS))}")
    base = PRESETS[name]
    task_names = [
        layer["task"].get("name") for layer in layers if isinstance(layer.get("task"), Mapping)
    ]
    task_name = next((n for n in reversed(task_names) if n is not None), None)
    if task_name is not None and task_name != base.get("task", {}).get("name", "calculator"):
        # another task: the preset's task options belong to its own task
        base = {k: v for k, v in base.items() if k != "task"}
    return [_merge({}, base), *layers]


def load_config(
    preset: str | None = None,
    file: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Resolve preset -> file -> ``--set`` overrides into a validated :class:`Config`.

    Later sources win key by key, except that a source which switches the
    algorithm drops the ``algo.*`` settings of the sources before it
    (:func:`_layer`)."""
    return resolve_config(preset, file, overrides)[0]


def validate(data: Mapping[str, Any]) -> Config:
    """Build a Config from a dict; unknown keys and bad values become ConfigError."""
    _check_keys(Config, data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None
    algo = cfg.algo.resolve()
    G = algo.group_size
    if cfg.train.batch_size % G:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) must be a multiple of the group size "
            f"({G}, algo {algo.name!r}): groups are trained whole"
        )
    r = cfg.rollout
    groups = cfg.train.batch_size // G
    if cfg.runtime.trainer_ranks > groups:
        raise ConfigError(
            f"runtime.trainer_ranks ({cfg.runtime.trainer_ranks}) exceeds the groups per batch "
            f"({groups} = train.batch_size {cfg.train.batch_size} / group size {G}): groups are "
            "trained whole on one rank, so some ranks would have nothing to train"
        )
    if cfg.runtime.backend == "local" and cfg.runtime.trainer_ranks > 1:
        raise ConfigError(
            "runtime.trainer_ranks > 1 needs runtime.backend=ray (the ranks are Ray actors)"
        )
    _check_critic_ranks(cfg, groups)
    if r.engine == "torch" and (r.servers or r.launch):
        raise ConfigError(
            "rollout.servers / rollout.launch need rollout.engine = http, vllm or sglang "
            "(the torch engine runs in this process)"
        )
    if r.engine != "torch" and bool(r.servers) == bool(r.launch):
        raise ConfigError(
            f"rollout.engine={r.engine!r} needs exactly one of rollout.servers (URLs of running "
            "servers) or rollout.launch (how many local servers to start)"
        )
    if r.weight_transfer == "broadcast" and r.engine not in ("http", "sglang"):
        raise ConfigError(
            f"rollout.weight_transfer=broadcast works with rollout.engine=http or sglang, not "
            f"{r.engine!r} (vLLM's NCCL transfer is not supported yet; use disk)"
        )
    if cfg.rollout.in_flight < G:
        raise ConfigError(
            f"rollout.in_flight ({cfg.rollout.in_flight}) must be >= the group size ({G})"
        )
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (written to the run directory)."""
    return cfg.model_dump(mode="json")
