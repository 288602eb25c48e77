"""The agent loop against the chat templates of the main model families
(tests/rollout/templates.py), token for token.

Each family plays the same four-turn episode with scripted replies: a reply
with a think block, a tool call (the family's own format), a reply cut by
``max_new_tokens`` and a reply ending in the stop token. The expected ids are
written by hand from each template's strings (``Family.ids`` is a table
lookup, not the tokenizer): the rendered prompt, each reply verbatim, each
observation as the template writes it after the reply (without a closing
token the reply already sampled; with the whole closing text after the cut
reply). Every generate call's prompt must be the history so far, a prefix of
the final tokens. Then the same on the embedded torch engine with a tiny
random Qwen3 model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from sao.models.tiny import build_tiny_policy
from sao.rollout import EpisodeLimits, run_episode
from sao.rollout.embedded.engine import TorchEngine
from sao.types import Completion, Message, Observation, SamplingParams, StepResult, Trajectory
from tests.rollout.scripted import Reply, ScriptedEngine, ScriptedEnv, done
from tests.rollout.templates import (
    DEEPSEEK_FAMILY,
    GEMMA_FAMILY,
    LLAMA3_FAMILY,
    MISTRAL_FAMILY,
    QWEN3_FAMILY,
    Family,
)

MAX_NEW = 64
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW)
LIMITS = EpisodeLimits(max_turns=6, max_total_tokens=2048, step_timeout_s=5, reset_timeout_s=5)
SYSTEM_AND_QUESTION = (Message("system", "You are terse."), Message("user", "What is 2+2?"))
CUT = "The tool says 4, so the final answer is 4; that settles it for good and all time."
"""Reply 3: longer than ``MAX_NEW`` bytes; its first 64 end in a letter."""


def step(obs: Observation) -> StepResult:
    return StepResult(observation=obs)


@dataclass(frozen=True)
class Script:
    """One family's episode: what the env and the engine say, and what the
    template writes (by hand)."""

    family: Family
    reset: Observation
    replies: tuple[str, str, str, str]
    """Texts of the four replies (the third is cut to ``MAX_NEW`` ids)."""
    tool_result: Observation
    prompt: str
    suffixes: tuple[str, str, str]
    """The observation text after replies 1, 2 and 3."""
    check: str
    """What the run-time check finds (``match`` or ``rewrite``)."""


QWEN3 = Script(
    QWEN3_FAMILY,
    SYSTEM_AND_QUESTION,
    (
        "<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>',
        CUT,
        "Done.<|im_end|>",
    ),
    (Message("tool", "4"),),
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    (
        "\n<|im_start|>user\nCheck with the tool.<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
    ),
    "rewrite",  # the first reply's think block is dropped from the history
)
LLAMA3 = Script(
    LLAMA3_FAMILY,
    SYSTEM_AND_QUESTION,
    (
        "<think>\nadd them\n</think>\n\nIt is 4.<|eot_id|>",
        '{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>',
        CUT,
        "Done.<|eot_id|>",
    ),
    (Message("tool", "4"),),
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    (
        "<|start_header_id|>user<|end_header_id|>\n\nCheck with the tool.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        '<|start_header_id|>ipython<|end_header_id|>\n\n"4"<|eot_id|>'  # tojson
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGo on.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "match",
)
GEMMA = Script(
    GEMMA_FAMILY,
    SYSTEM_AND_QUESTION,
    (
        "<think>\nadd them\n</think>\n\nIt is 4.<end_of_turn>",
        "```tool_code\nadd(a=2, b=2)\n```<end_of_turn>",
        CUT,
        "Done.<end_of_turn>",
    ),
    (Message("user", "```tool_output\n4\n```"),),  # Gemma has no tool role
    # No system role: its text opens the first user turn.
    "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    (
        "\n<start_of_turn>user\nCheck with the tool.<end_of_turn>\n<start_of_turn>model\n",
        "\n<start_of_turn>user\n```tool_output\n4\n```<end_of_turn>\n<start_of_turn>model\n",
        "<end_of_turn>\n<start_of_turn>user\nGo on.<end_of_turn>\n<start_of_turn>model\n",
    ),
    "match",
)
MISTRAL = Script(
    MISTRAL_FAMILY,
    "What is 2+2?",  # no system message: this template moves it (see test_tito)
    (
        " <think>\nadd them\n</think>\n\nIt is 4.</s>",
        ' [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 2}}]</s>',
        " " + CUT,
        " Done.</s>",
    ),
    (Message("user", "add returned 4"),),  # a tool message needs a call id Message lacks
    "<s>[INST] What is 2+2?[/INST]",
    (
        "[INST] Check with the tool.[/INST]",
        "[INST] add returned 4[/INST]",
        "</s>[INST] Go on.[/INST]",
    ),
    "rewrite",  # the decoded reply 2 lacks the special [TOOL_CALLS] token
)
DEEPSEEK = Script(
    DEEPSEEK_FAMILY,
    SYSTEM_AND_QUESTION,
    (
        "add them\n</think>\n\nIt is 4.<｜end▁of▁sentence｜>",  # the prompt opened <think>
        "ok\n</think>\n\n<｜tool▁calls▁begin｜>add(2, 2)<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        CUT,
        "fine\n</think>\n\nDone.<｜end▁of▁sentence｜>",
    ),
    (Message("tool", "4"),),
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is 2+2?<｜Assistant｜><think>\n",
    (
        "<｜User｜>Check with the tool.<｜Assistant｜><think>\n",
        # After tool outputs the reply follows at once: no <｜Assistant｜>, no think.
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>4<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>",
        "<｜end▁of▁sentence｜><｜User｜>Go on.<｜Assistant｜><think>\n",
    ),
    "rewrite",  # earlier replies lose their reasoning
)
SCRIPTS = (QWEN3, LLAMA3, GEMMA, MISTRAL, DEEPSEEK)


def play(script: Script, engine: ScriptedEngine) -> Trajectory:
    env = ScriptedEnv(
        script.reset,
        [step("Check with the tool."), step(script.tool_result), step("Go on."), done()],
    )
    tok = script.family.tokenizer
    return asyncio.run(run_episode(env, engine, tok, SAMPLING, LIMITS, seed=0, prompt_id="p"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.family.name)
def test_episode_is_prompt_replies_and_suffixes_token_for_token(script: Script) -> None:
    f = script.family
    replies = [f.ids(text) for text in script.replies]
    assert len(replies[2]) > MAX_NEW and all(len(r) <= MAX_NEW for r in replies[:2] + replies[3:])
    engine = ScriptedEngine([Reply(r) for r in replies])
    traj = play(script, engine)
    assert (traj.finish_reason, traj.error) == ("stop", None)

    sampled = [replies[0], replies[1], replies[2][:MAX_NEW], replies[3]]
    suffixes = [f.ids(s) for s in script.suffixes]
    expected, spans = f.ids(script.prompt), []
    for k, reply in enumerate(sampled):
        spans.append((len(expected), len(expected) + len(reply)))
        expected += reply + (suffixes[k] if k < 3 else [])
    assert list(traj.tokens) == expected
    assert [(t.start, t.end) for t in traj.turns] == spans
    assert [i for i, a in enumerate(traj.action_mask) if a] == [
        i for a, b in spans for i in range(a, b)
    ]
    # Each generate call was sent the whole history so far: a prefix of the final tokens.
    assert [prompt for prompt, _ in engine.calls] == [tuple(expected[:a]) for a, _ in spans]
    assert traj.metrics["tito/checked"] == 1.0 and traj.metrics["tito/mismatch"] == 0.0
    assert traj.metrics["tito/rewrite"] == float(script.check == "rewrite")


def test_qwen3_env_sees_the_tool_call_and_the_think_block() -> None:
    f = QWEN3.family
    env = ScriptedEnv(QWEN3.reset, [step("Check with the tool."), done()])
    engine = ScriptedEngine([Reply(f.ids(QWEN3.replies[0])), Reply(f.ids(QWEN3.replies[1]))])
    asyncio.run(run_episode(env, engine, f.tokenizer, SAMPLING, LIMITS, seed=0, prompt_id="p"))
    # Tags that are not special tokens (as in Qwen3's tokenizer) reach the environment.
    assert env.actions == [
        "<think>\nadd them\n</think>\n\nIt is 4.",
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>',
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.family.name)
def test_stop_token_ending_a_cut_reply_is_not_duplicated(script: Script) -> None:
    f = script.family
    reply = f.ids(script.replies[3])  # ends in the stop token, but the engine says "length"
    engine = ScriptedEngine([Reply(reply, finish="length"), Reply(reply)])
    env = ScriptedEnv(script.reset, [step("Go on."), done()])
    traj = asyncio.run(
        run_episode(env, engine, f.tokenizer, SAMPLING, LIMITS, seed=0, prompt_id="p")
    )
    obs = traj.tokens[traj.turns[0].end : traj.turns[0].obs_end]
    # The same observation as after a reply that stopped on the stop token.
    assert list(obs) == f.ids(script.suffixes[0].replace("Check with the tool.", "Go on."))


class Recording:
    """The torch engine, with every generate call and its completion recorded."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.calls: list[tuple[tuple[int, ...], Completion]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return self.engine.weight_sources

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        completion = await self.engine.generate(prompt_ids, sampling)
        self.calls.append((tuple(prompt_ids), completion))
        return completion

    async def update_weights(self, source: object) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.engine.aclose()


def test_torch_engine_plays_a_qwen3_episode_token_for_token() -> None:
    f = QWEN3_FAMILY
    model = build_tiny_policy(f.tokenizer, arch="qwen3", size="0.1m", seed=0)
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    env = ScriptedEnv(QWEN3.reset, [step("Check with the tool."), step(QWEN3.tool_result), done()])

    async def main() -> tuple[Trajectory, Recording]:
        engine = Recording(TorchEngine(model, max_seq_len=512, max_batch_size=2))
        try:
            traj = await run_episode(
                env, engine, f.tokenizer, sampling, LIMITS, seed=0, prompt_id="p"
            )
        finally:
            await engine.aclose()
        return traj, engine

    traj, engine = asyncio.run(main())
    assert traj.finish_reason == "stop" and len(engine.calls) == 3
    expected = f.ids(QWEN3.prompt)
    for k, (prompt, completion) in enumerate(engine.calls):
        assert prompt == tuple(expected)  # the history so far, exactly
        reply = list(completion.token_ids)
        assert traj.rollout_logp[len(expected) : len(expected) + len(reply)] == completion.logprobs
        expected += reply
        if k < 2:  # the observation; its closing <|im_end|> only when the reply was cut
            suffix = QWEN3.suffixes[k]
            stopped = completion.finish_reason == "stop" and reply[-1] == f.id("<|im_end|>")
            expected += f.ids(suffix if stopped else "<|im_end|>" + suffix)
    assert list(traj.tokens) == expected
    assert traj.metrics["tito/checked"] == 1.0 and traj.metrics["tito/mismatch"] == 0.0
