"""The run-time token-in/token-out check (sao.rollout.tito), its policies
(``rollout.tito_check``) and metrics, and the loop's clear failures on input
a chat template cannot take.

ChatML on the byte tokenizer of tests/rollout/templates.py: a user turn is
``<|im_start|>user\\n{text}<|im_end|>\\n``, the generation prompt
``<|im_start|>assistant\\n``; ids by table lookup (``F.ids``).
"""

from __future__ import annotations

import asyncio

import pytest

from sao.models.tokenization import CHAT_TEMPLATE, train_bpe_tokenizer
from sao.rollout import EpisodeLimits, run_episode
from sao.rollout.agent import _Episode
from sao.rollout.chat import decode_reply
from sao.rollout.tito import (
    Generation,
    GenerationLog,
    TitoPolicy,
    check_episode,
    check_render,
    check_stream,
)
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.orchestrator import Orchestrator, RunStopped
from sao.runtime.staleness import StalenessGate
from sao.types import Completion, Message, SamplingParams, StepResult, Trajectory, Turn
from tests.rollout.scripted import Reply, ScriptedEngine, ScriptedEnv, done, say
from tests.rollout.templates import (
    CHATML_WITH_TURN_NUMBERS,
    CHATML_WITHOUT_TOOL,
    GEMMA_FAMILY,
    MISTRAL_FAMILY,
    QWEN3_FAMILY,
    Family,
)

SAMPLING = SamplingParams(max_new_tokens=16)
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MOODY = CHATML.replace(
    "{{- '<|im_start|>' + message['role']",
    "{%- set calm = message['role'] == 'user' and loop.index0 > 0"
    " and messages[loop.index0 - 1]['content'].endswith('!') %}"
    "{{- '<|im_start|>' + message['role'] + (' (calm down)' if calm else '')",
)
"""ChatML that writes a user turn after an exclaimed reply differently: it
depends on a reply's content, which the loop never renders (placeholders), so
only the final rendering shows it (a stand-in for a loop bug)."""


def family(template: str) -> Family:
    q = QWEN3_FAMILY
    return Family("chatml", template, specials=q.specials, eos=q.eos, pad=q.pad, added=q.added)


F = family(CHATML)
END = F.id("<|im_end|>")


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def play(
    fam: Family,
    env: ScriptedEnv,
    replies: list[Reply],
    *,
    policy: TitoPolicy = "warn",
) -> Trajectory:
    limits = EpisodeLimits(max_turns=4, max_total_tokens=512, tito_check=policy)
    engine = ScriptedEngine(replies)
    return asyncio.run(
        run_episode(env, engine, fam.tokenizer, SAMPLING, limits, seed=0, prompt_id="p")
    )


def two_turns(fam: Family, first_reply: str, *, policy: TitoPolicy = "warn") -> Trajectory:
    env = ScriptedEnv("hi", [say("ok"), done()])
    return play(
        fam, env, [Reply(fam.ids(first_reply)), Reply(fam.ids("bye<|im_end|>"))], policy=policy
    )


# ---------------------------------------------------------------- the stream


def test_generation_log_records_calls_and_forwards_other_attributes() -> None:
    engine = ScriptedEngine([Reply([5, 6])], max_seq_len=99)
    log = GenerationLog(engine)
    completion = asyncio.run(log.generate([1, 2], SAMPLING))
    assert log.max_seq_len == 99 and log.version == 0
    assert log.generations == [Generation((1, 2), completion)]


def traj_of(tokens: list[int], actions: list[int], turns: tuple[Turn, ...]) -> Trajectory:
    n = len(tokens)
    return Trajectory(
        prompt_id="p",
        tokens=tuple(tokens),
        action_mask=tuple(i in actions for i in range(n)),
        rollout_logp=tuple(-0.5 if i in actions else 0.0 for i in range(n)),
        versions=tuple(0 if i in actions else -1 for i in range(n)),
        turns=turns,
        reward=0.0,
        finish_reason="stop",
    )


def gen(prompt: list[int], ids: list[int]) -> Generation:
    n = len(ids)
    return Generation(tuple(prompt), Completion(tuple(ids), (-0.5,) * n, (0,) * n, "stop"))


def test_stream_check_passes_exactly_the_sampled_stream() -> None:
    # prompt 10 11 | reply 20 21 | observation 12 | reply 22
    traj = traj_of([10, 11, 20, 21, 12, 22], [2, 3, 5], (Turn(2, 4, 5, 0.0), Turn(5, 6, 6, 0.0)))
    good = [gen([10, 11], [20, 21]), gen([10, 11, 20, 21, 12], [22])]
    assert check_stream(F.tokenizer, traj, good, complete=True).kind == "match"

    other_prompt = [gen([10, 11], [20, 21]), gen([10, 11, 20, 99, 12], [22])]
    found = check_stream(F.tokenizer, traj, other_prompt, complete=True)
    assert (found.kind, found.position) == ("mismatch", 3)
    assert "generate call 2's prompt (5 tokens) is not a prefix" in found.message

    moved = [gen([10, 11], [20, 21]), gen([10, 11, 20, 21], [12])]  # sampled 12, a non-action
    found = check_stream(F.tokenizer, traj, moved, complete=True)
    assert (found.kind, found.position) == ("mismatch", 4)

    missing = [gen([10, 11], [20, 21])]  # token 5 is an action no call sampled
    assert check_stream(F.tokenizer, traj, missing, complete=True).position == 5
    assert check_stream(F.tokenizer, traj, missing, complete=False).kind == "match"  # resumed


def test_a_loop_that_corrupts_the_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = _Episode.append_action

    def off_by_one(self: _Episode, completion: Completion) -> None:
        original(self, completion)
        self.logp[-1] += 1.0  # a bug: the trainer would see another log-probability

    monkeypatch.setattr(_Episode, "append_action", off_by_one)
    traj = two_turns(F, "yo<|im_end|>", policy="drop")
    assert traj.finish_reason == "error" and traj.metrics["tito/mismatch"] == 1.0
    assert "generate call 1 sampled 3 tokens after its 21-token prompt" in (traj.error or "")


# ---------------------------------------------------------------- the template


def test_chatml_history_matches_the_template() -> None:
    traj = two_turns(F, "yo<|im_end|>")
    assert traj.metrics == traj.metrics | {"tito/checked": 1.0, "tito/mismatch": 0.0}
    assert traj.metrics["tito/rewrite"] == 0.0 and traj.error is None


def conversation(traj: Trajectory, tok: object, first: list[Message], obs: list[Message]) -> list:
    """The messages the loop keeps: replies decoded, observations in between."""
    msgs = list(first)
    for k, t in enumerate(traj.turns):
        msgs.append(Message("assistant", decode_reply(tok, traj.tokens[t.start : t.end])))
        msgs += obs[k : k + 1]
    return msgs


def test_qwen3_dropping_earlier_reasoning_is_a_rewrite_at_the_reply() -> None:
    q = QWEN3_FAMILY
    env = ScriptedEnv("hi", [say("ok"), done()])
    think = "<think>\nhm\n</think>\n\nyo<|im_end|>"
    traj = play(q, env, [Reply(q.ids(think)), Reply(q.ids("bye<|im_end|>"))])
    assert traj.metrics["tito/rewrite"] == 1.0 and traj.metrics["tito/mismatch"] == 0.0
    msgs = conversation(traj, q.tokenizer, [Message("user", "hi")], [Message("user", "ok")])
    found = check_render(q.tokenizer, traj, msgs)
    prompt = len(q.ids(user("hi") + "<|im_start|>assistant\n"))
    assert (found.kind, found.position) == ("rewrite", prompt)  # where <think> was sampled
    assert "reply 1" in found.message and "'<think>\\nhm\\n</think" in found.message


def test_a_reply_sampled_in_other_tokens_than_the_tokenizer_would_is_a_match() -> None:
    tok = train_bpe_tokenizer(["hello hello hello world"] * 8, vocab_size=300)
    assert tok.chat_template == CHAT_TEMPLATE
    canonical = tok.encode("hello", add_special_tokens=False)
    by_char = [i for ch in "hello" for i in tok.encode(ch, add_special_tokens=False)]
    assert canonical != by_char
    env = ScriptedEnv("hi", [done()])
    reply = Reply([*by_char, tok.convert_tokens_to_ids("<|im_end|>")])
    traj = asyncio.run(
        run_episode(
            env, ScriptedEngine([reply]), tok, SAMPLING, EpisodeLimits(), seed=0, prompt_id="p"
        )
    )
    assert list(traj.tokens[traj.turns[0].start : traj.turns[0].end])[:5] == by_char
    assert traj.metrics["tito/mismatch"] == 0.0 and traj.metrics["tito/rewrite"] == 0.0


def test_a_turn_the_template_writes_otherwise_is_a_mismatch_with_position_and_context() -> None:
    m = family(MOODY)
    traj = two_turns(m, "yo!<|im_end|>")
    # Trained anyway (warn) and named: where, and both texts around it.
    assert traj.finish_reason == "stop" and traj.metrics["tito/mismatch"] == 1.0
    prompt = m.ids(user("hi") + "<|im_start|>assistant\n")
    at = len(prompt) + len(m.ids("yo!<|im_end|>")) + len(m.ids("\n<|im_start|>user"))
    error = traj.error or ""
    assert error.startswith("token-in/token-out check (rollout.tito_check=warn): the observation")
    assert f"from token {at} the history has" in error
    assert "'\\n<|im_start|>user' ▸ '\\nok<|im_end|>\\n'" in error
    assert "▸ ' (calm down)\\nok<|im_end|'" in error


@pytest.mark.parametrize(
    ("policy", "finish"), [("warn", "stop"), ("drop", "error"), ("stop", "error")]
)
def test_policies(policy: TitoPolicy, finish: str) -> None:
    traj = two_turns(family(MOODY), "yo!<|im_end|>", policy=policy)
    assert traj.finish_reason == finish and traj.metrics["tito/mismatch"] == 1.0
    assert traj.metrics.get("tito/stop") == (1.0 if policy == "stop" else None)
    assert f"rollout.tito_check={policy}" in (traj.error or "")


def test_off_checks_nothing() -> None:
    traj = two_turns(family(MOODY), "yo!<|im_end|>", policy="off")
    assert traj.error is None and not any(k.startswith("tito/") for k in traj.metrics)


def test_token_id_observations_get_only_the_stream_check() -> None:
    env = ScriptedEnv("hi", [StepResult(observation=(F.id("<|im_start|>"), 40, 41)), done()])
    traj = play(F, env, [Reply(F.ids("yo")), Reply(F.ids("bye<|im_end|>"))])
    assert traj.metrics["tito/mismatch"] == 0.0 and traj.error is None
    msgs = [Message("user", "hi"), Message("assistant", "yo"), Message("assistant", "bye")]
    assert check_render(F.tokenizer, traj, msgs).notes == ("not compared with the template",)


def test_a_check_that_cannot_run_is_a_mismatch() -> None:
    traj = two_turns(F, "yo<|im_end|>")
    bad = [Message("user", "hi"), Message("assistant", "yo")]
    broken = family("{{ raise_exception('no') }}").tokenizer
    found = check_episode(broken, traj, [*bad, Message("user", "ok"), bad[1]], [], complete=False)
    assert found.kind == "mismatch" and "the check could not run" in found.message


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("fam", "why"),
    [
        (GEMMA_FAMILY, "Conversation roles must alternate"),
        (MISTRAL_FAMILY, "Tool call IDs should be alphanumeric strings with length 9!"),
    ],
    ids=["gemma", "mistral"],
)
def test_a_tool_message_the_template_rejects_fails_the_episode(fam: Family, why: str) -> None:
    env = ScriptedEnv("hi", [StepResult(observation=(Message("tool", "4"),)), done()])
    traj = play(fam, env, [Reply(fam.ids("call")), Reply(fam.ids("x"))])
    assert traj.finish_reason == "env_error" and traj.num_turns == 1
    assert "Env.step: the chat template rejected the messages (roles: " in (traj.error or "")
    assert why in (traj.error or "") and "Message('user', ...)" in (traj.error or "")


def test_a_tool_message_the_template_drops_fails_the_episode() -> None:
    env = ScriptedEnv("hi", [StepResult(observation=(Message("tool", "4 apples"),)), done()])
    traj = play(family(CHATML_WITHOUT_TOOL), env, [Reply(F.ids("call")), Reply(F.ids("x"))])
    assert traj.finish_reason == "env_error"
    assert "rendered nothing of the 'tool' message '4 apples'" in (traj.error or "")


def test_mistral_moving_the_system_message_is_not_prefix_stable() -> None:
    m = MISTRAL_FAMILY
    env = ScriptedEnv((Message("system", "Be terse."), Message("user", "hi")), [say("ok"), done()])
    traj = play(m, env, [Reply(m.ids(" yo</s>")), Reply(m.ids(" bye</s>"))])
    # The first prompt put the system text into the (then last) user turn; the next
    # rendering moves it to the new last one: the history cannot be that conversation.
    assert traj.finish_reason == "error" and traj.num_turns == 1
    error = traj.error or ""
    assert "the chat template is not prefix-stable" in error and "at character 10" in error
    assert (
        "it wrote '<s>[INST] ' ▸ 'Be terse.\\n\\nhi[/INST]', now '<s>[INST] ' ▸ 'hi[/INST]" in error
    )


def test_a_template_that_rewrites_earlier_user_turns_is_not_prefix_stable() -> None:
    env = ScriptedEnv("hi", [say("ok"), done()])
    traj = play(family(CHATML_WITH_TURN_NUMBERS), env, [Reply(F.ids("yo")), Reply(F.ids("x"))])
    assert traj.finish_reason == "error"
    assert "not prefix-stable" in (traj.error or "")
    assert "it wrote '<|im_start|>user\\nhi (' ▸ '1 to go)" in (traj.error or "")


# ---------------------------------------------------------------- the orchestrator


class NoRunner:
    def metrics(self) -> dict[str, float]:
        return {}


def orchestrator(reports: list[Trajectory]) -> Orchestrator:
    gate = StalenessGate(0, 1)
    buffer = TrajectoryBuffer(gate, group_size=1, dynamic_sampling=False)
    return Orchestrator(
        NoRunner(),  # type: ignore[arg-type]
        SAMPLING,
        gate=gate,
        buffer=buffer,
        in_flight=1,
        group_size=1,
        seed=0,
        report=lambda traj, step: reports.append(traj),
    )


def test_orchestrator_counts_mismatches_names_the_first_and_stops_on_stop() -> None:
    reports: list[Trajectory] = []
    orch = orchestrator(reports)
    ok, moody = two_turns(F, "yo<|im_end|>"), two_turns(family(MOODY), "yo!<|im_end|>")
    for traj in (ok, moody, moody, ok):
        orch._finished(traj)
    metrics = orch.runtime_metrics([], 0)
    assert metrics["tito/mismatch_frac"] == 0.5 and metrics["tito/rewrite_frac"] == 0.0
    assert reports == [moody] and orch.buffer.num_ready() == 4  # warn: all trained
    assert orch.counters()["tito_mismatches"] == 2.0

    dropped = two_turns(family(MOODY), "yo!<|im_end|>", policy="drop")
    orch._finished(dropped)
    assert orch.buffer.failed == 1 and reports[-1] is dropped and orch._fatal is None

    orch._finished(two_turns(family(MOODY), "yo!<|im_end|>", policy="stop"))
    assert isinstance(orch._fatal, RunStopped)
    assert "(rollout.tito_check=stop)" in str(orch._fatal)
    assert orch.runtime_metrics([], 0)["tito/mismatch_frac"] == 4 / 6
