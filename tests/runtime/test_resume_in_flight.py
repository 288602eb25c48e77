"""Episodes in flight at a checkpoint are continued on resume where their
environment is restorable: the checkpoint holds their history between turns
and their environment's state, and the resumed run plays them on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from sao.app.run import train
from sao.config import load_config
from sao.envs.base import Split
from sao.rollout.resume import EpisodeResume
from sao.types import Env, StepResult
from tests.runtime.test_episode_failures import overrides
from tests.train.test_learning import SayATask


class ThreeTurnEnv:
    """Three replies per episode; reward = share of 'a' in the last one."""

    loaded: ClassVar[list[int]] = []
    """Replies already seen by each env restored from a checkpoint."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def reset(self, seed: int) -> str:
        return "a"

    async def step(self, action: str) -> StepResult:
        self.seen.append(action)
        return StepResult(None if len(self.seen) == 3 else "b", done=len(self.seen) == 3)

    def score(self) -> float:
        return self.seen[-1][:4].count("a") / 4 if self.seen else 0.0

    def state_dict(self) -> dict[str, object]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.seen = [str(x) for x in state["seen"]]  # type: ignore[attr-defined]
        ThreeTurnEnv.loaded.append(len(self.seen))


class ThreeTurnTask(SayATask):
    def make_env(self, split: Split, index: int) -> Env:
        return ThreeTurnEnv()


def test_in_flight_episodes_continue_after_resume(tmp_path: Path, tiny_policy: Path) -> None:
    extra = ("algo=grpo", "algo.group_size=2", "rollout.max_turns=3", "rollout.in_flight=16")
    # one decode slot (the others wait between turns) and room to run ahead (max_lag 3)
    extra += ("rollout.max_batch_size=1", "runtime.max_lag=3", "log.checkpoint_every=2")
    cfg = load_config(overrides=overrides(tmp_path, tiny_policy, *extra, "train.steps=3"))
    run_dir = train(cfg, task=ThreeTurnTask())
    # as if killed after the checkpoint of step 2: resume from it
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_000003")
    (ckpts / "latest").unlink()
    state = json.loads((ckpts / "step_000002" / "state.json").read_text())
    saved = {k: EpisodeResume.from_dict(v) for k, v in state["resume"].items()}
    assert saved, "episodes were waiting for a generation at the checkpoint"
    for key, r in saved.items():
        index, member = (int(x) for x in key.split("/"))
        assert index in state["in_flight"] and 0 <= member < 2
        assert r.env_state == {"seen": [m.content for m in r.messages if m.role == "assistant"]}
        assert len(r.turns) == len(r.env_state["seen"]) < 3  # caught between turns
        assert sum(r.action_mask) == sum(t.end - t.start for t in r.turns)

    ThreeTurnEnv.loaded.clear()
    resumed = load_config(overrides=overrides(tmp_path, tiny_policy, *extra, "train.steps=3"))
    train(resumed, task=ThreeTurnTask(), resume=run_dir)
    # every saved episode was continued from its own state, none reset from scratch
    assert sorted(ThreeTurnEnv.loaded) == sorted(len(r.turns) for r in saved.values())
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 3
