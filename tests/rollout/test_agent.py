"""The agent loop with a scripted engine and scripted environments: exact
tokens, action mask, turn boundaries and finish reasons, worked out by hand.

Character tokenizer (conftest): <|im_start|> = 1, <|im_end|> = 2 (eos), each
character one id (``c("ab")``). ChatML renders a user turn as
``<|im_start|>user\\n{text}<|im_end|>\\n`` and the generation prompt as
``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.rollout import EpisodeLimits, run_episode
from sao.types import Message, SamplingParams, StepResult, Trajectory, collate
from tests.rollout.conftest import IM_END, IM_START, c
from tests.rollout.scripted import HANG, Reply, ScriptedEngine, ScriptedEnv, done, say

SAMPLING = SamplingParams(max_new_tokens=8)
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=256, step_timeout_s=5, reset_timeout_s=5)

# <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n : 1 + 7 + 1 + 1 + 1 + 10 = 21 ids
PROMPT_HI = [IM_START, *c("user\nhi"), IM_END, *c("\n"), IM_START, *c("assistant\n")]
# \n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n : 1 + 1 + 7 + 1 + 1 + 1 + 10 = 22
OBS_OK = [*c("\n"), IM_START, *c("user\nok"), IM_END, *c("\n"), IM_START, *c("assistant\n")]


def play(env, engine, tok, *, sampling=SAMPLING, limits=LIMITS, seed=7) -> Trajectory:
    return asyncio.run(
        run_episode(env, engine, tok, sampling, limits, seed=seed, prompt_id="p0", group_id="g")
    )


def spans(traj: Trajectory) -> list[tuple[int, int, int, float]]:
    return [(t.start, t.end, t.obs_end, t.reward) for t in traj.turns]


def test_two_turn_chatml_episode_exact(chatml_tok):
    engine = ScriptedEngine(
        [
            Reply((*c("ab"), IM_END), logprobs=(-0.5, -0.25, -0.125), versions=(3, 3, 4)),
            Reply((*c("c"), IM_END), logprobs=(-1.0, -2.0), versions=(4, 4)),
        ]
    )
    env = ScriptedEnv("hi", [say("ok", reward=0.5), done()], score=1.0)
    traj = play(env, engine, chatml_tok)

    assert len(PROMPT_HI) == 21 and len(OBS_OK) == 22
    # The stop token <|im_end|> was sampled: only "\n" of the closing is an observation.
    expected = [*PROMPT_HI, *c("ab"), IM_END, *OBS_OK, *c("c"), IM_END]
    assert list(traj.tokens) == expected
    assert spans(traj) == [(21, 24, 46, 0.5), (46, 48, 48, 0.0)]
    assert traj.action_mask == (False,) * 21 + (True,) * 3 + (False,) * 22 + (True,) * 2
    assert traj.rollout_logp == (0.0,) * 21 + (-0.5, -0.25, -0.125) + (0.0,) * 22 + (-1.0, -2.0)
    assert traj.versions == (-1,) * 21 + (3, 3, 4) + (-1,) * 22 + (4, 4)
    assert (traj.finish_reason, traj.reward, traj.error) == ("stop", 1.0, None)
    assert (traj.prompt_id, traj.group_id, traj.sampling) == ("p0", "g", SAMPLING)
    # The env sees decoded text without the stop token; reset got the seed.
    assert env.actions == ["ab", "c"] and env.seeds == [7] and env.score_calls == 1
    # Each generate call got the whole history so far, which is a prefix of the next.
    assert [list(p) for p, _ in engine.calls] == [PROMPT_HI, expected[:46]]
    assert traj.metrics["num_turns"] == 2 and traj.metrics["num_action_tokens"] == 5
    assert traj.metrics["num_tokens"] == 48
    assert traj.metrics["env_latency_s"] >= 0 and traj.metrics["gen_latency_s"] >= 0


def test_tokens_match_the_rendered_conversation(chatml_tok):
    engine = ScriptedEngine([Reply((*c("ab"), IM_END)), Reply((*c("c"), IM_END))])
    env = ScriptedEnv((Message("system", "be brief"), Message("user", "hi")), [say("ok"), done()])
    traj = play(env, engine, chatml_tok)
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ab"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "c"},
    ]
    text = chatml_tok.apply_chat_template(convo, tokenize=False)
    # Same ids as tokenizing the whole chat once, minus the final "\n" never sampled.
    assert list(traj.tokens) == chatml_tok.encode(text, add_special_tokens=False)[:-1]


def test_reply_cut_by_length_gets_closing_tokens_as_observation(chatml_tok):
    engine = ScriptedEngine([Reply(c("abc")), Reply((*c("d"), IM_END))])
    env = ScriptedEnv("hi", [say("ok"), done()])
    traj = play(env, engine, chatml_tok, sampling=SamplingParams(max_new_tokens=2))
    # "ab" was cut (no <|im_end|>), so the full closing <|im_end|>\n is observation.
    expected = [*PROMPT_HI, *c("ab"), IM_END, *OBS_OK, *c("d"), IM_END]
    assert list(traj.tokens) == expected
    assert spans(traj) == [(21, 23, 46, 0.0), (46, 48, 48, 0.0)]
    assert traj.action_mask[23] is False and traj.tokens[23] == IM_END
    assert env.actions == ["ab", "d"]
    assert traj.finish_reason == "stop"


def test_history_is_a_prefix_at_every_generate_call(chatml_tok):
    engine = ScriptedEngine(lambda prompt: Reply((*c("x"), IM_END)))
    env = ScriptedEnv("hi", [say("a"), say("bb"), say("ccc"), done()])
    traj = play(env, engine, chatml_tok)
    prompts = [p for p, _ in engine.calls]
    assert len(prompts) == 4
    for earlier, later in zip(prompts, [*prompts[1:], traj.tokens], strict=True):
        assert later[: len(earlier)] == earlier
    # max_new_tokens = min(8, 256 - history length) = 8 throughout.
    assert [s.max_new_tokens for _, s in engine.calls] == [8, 8, 8, 8]


@settings(max_examples=25, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.text("ab ", max_size=4), st.booleans(), st.text("xy\n", max_size=3)),
        min_size=1,
        max_size=3,
    )
)
def test_any_script_reads_as_the_rendered_conversation(chatml_tok, turns):
    # Each turn: reply text, whether the reply ended with <|im_end|>, next observation.
    replies = [Reply((*c(text), IM_END) if closed else c(text)) for text, closed, _ in turns]
    steps = [say(obs) for _, _, obs in turns[:-1]] + [done()]
    traj = play(ScriptedEnv("q", steps), ScriptedEngine(replies), chatml_tok)
    convo = [{"role": "user", "content": "q"}]
    for text, _, obs in turns:
        convo += [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
    text = chatml_tok.apply_chat_template(convo[:-1], tokenize=False)
    rendered = chatml_tok.encode(text, add_special_tokens=False)
    # The trajectory is the rendered chat up to the last sampled token.
    tail = [*c("\n")] if turns[-1][1] else [IM_END, *c("\n")]
    assert [*traj.tokens, *tail] == rendered
    for turn, reply in zip(traj.turns, replies, strict=True):
        assert traj.tokens[turn.start : turn.end] == tuple(reply.ids)
        assert all(traj.action_mask[turn.start : turn.end])
        assert not any(traj.action_mask[turn.end : turn.obs_end])
    assert sum(traj.action_mask) == sum(len(r.ids) for r in replies)


def test_without_chat_template_text_is_tokenized_and_appended(plain_tok):
    engine = ScriptedEngine([Reply((*c("ab"), IM_END)), Reply(c("c"), finish="stop")])
    env = ScriptedEnv("hi", [say("ok"), done()])
    traj = play(env, engine, plain_tok)
    assert list(traj.tokens) == [*c("hi"), *c("ab"), IM_END, *c("ok"), *c("c")]
    assert spans(traj) == [(2, 5, 7, 0.0), (7, 8, 8, 0.0)]
    assert env.actions == ["ab", "c"]


def test_token_id_observations_are_appended_verbatim(chatml_tok):
    engine = ScriptedEngine([Reply(c("ab")), Reply(c("c"))])
    env = ScriptedEnv((5, 6, 7), [StepResult(observation=(9, 9)), done()])
    traj = play(env, engine, chatml_tok)
    assert list(traj.tokens) == [5, 6, 7, *c("ab"), 9, 9, *c("c")]
    assert spans(traj) == [(3, 5, 7, 0.0), (7, 8, 8, 0.0)]


def test_step_raising_is_env_error(chatml_tok):
    engine = ScriptedEngine([Reply((*c("ab"), IM_END))])
    env = ScriptedEnv("hi", [RuntimeError("boom")], score=0.25)
    traj = play(env, engine, chatml_tok)
    assert traj.finish_reason == "env_error"
    assert traj.error.startswith("Env.step raised RuntimeError: boom (at ")
    assert spans(traj) == [(21, 24, 24, 0.0)]
    assert (traj.reward, env.score_calls) == (0.25, 1)


def test_reset_raising_is_env_error_and_score_still_runs(chatml_tok):
    engine = ScriptedEngine([])
    env = ScriptedEnv(ValueError("no such task"), score=0.0)
    traj = play(env, engine, chatml_tok)
    assert traj.finish_reason == "env_error" and "no such task" in traj.error
    assert traj.tokens == () and traj.turns == () and engine.calls == []
    assert env.score_calls == 1


def test_hanging_step_times_out(chatml_tok):
    limits = EpisodeLimits(max_turns=3, max_total_tokens=256, step_timeout_s=0.2)
    engine = ScriptedEngine([Reply((*c("ab"), IM_END))])
    env = ScriptedEnv("hi", [HANG])
    traj = play(env, engine, chatml_tok, limits=limits)
    assert (
        traj.finish_reason == "timeout"
        and "Env.step exceeded EpisodeLimits.step_timeout_s=0.2 s" in traj.error
    )
    assert spans(traj) == [(21, 24, 24, 0.0)] and env.score_calls == 1


def test_timeout_does_not_wait_for_a_slow_unwinding_env(chatml_tok):
    limits = EpisodeLimits(max_turns=3, max_total_tokens=256, step_timeout_s=0.2)
    env = ScriptedEnv("hi", [HANG], ignore_cancel=True)

    async def episode() -> tuple[Trajectory, bool, bool]:
        engine = ScriptedEngine([Reply((*c("ab"), IM_END))])
        traj = await run_episode(env, engine, chatml_tok, SAMPLING, limits, seed=0, prompt_id="p")
        await asyncio.sleep(0)  # let the cancelled step start unwinding
        return traj, env.unwinding, env.unwound

    traj, unwinding, unwound = asyncio.run(episode())
    # The episode ended while the env was still cleaning up after the cancellation.
    assert traj.finish_reason == "timeout" and unwinding and not unwound


def test_hanging_reset_times_out(chatml_tok):
    limits = EpisodeLimits(max_turns=3, max_total_tokens=256, reset_timeout_s=0.2)
    env = ScriptedEnv(HANG)
    traj = play(env, ScriptedEngine([]), chatml_tok, limits=limits)
    assert traj.finish_reason == "timeout" and "Env.reset exceeded" in traj.error
    assert traj.tokens == ()


def test_bad_return_types_are_env_errors(chatml_tok):
    env = ScriptedEnv("hi", [7])
    traj = play(env, ScriptedEngine([Reply(c("a"))]), chatml_tok)
    assert traj.finish_reason == "env_error" and "returned int" in traj.error

    env = ScriptedEnv(7)
    traj = play(env, ScriptedEngine([]), chatml_tok)
    assert traj.finish_reason == "env_error" and "returned int" in traj.error

    env = ScriptedEnv("hi", [StepResult(observation=[1.5, "x"])])
    traj = play(env, ScriptedEngine([Reply(c("a"))]), chatml_tok)
    assert traj.finish_reason == "env_error" and "['float', 'str']" in traj.error

    env = ScriptedEnv("hi", [StepResult(observation=None, done=False)])
    traj = play(env, ScriptedEngine([Reply(c("a"))]), chatml_tok)
    assert traj.finish_reason == "env_error" and "no observation" in traj.error


def test_max_turns_is_length(chatml_tok):
    limits = EpisodeLimits(max_turns=2, max_total_tokens=256)
    engine = ScriptedEngine(lambda prompt: Reply((*c("ab"), IM_END)))
    env = ScriptedEnv("hi", [say("ok"), say("ok"), say("ok")])
    traj = play(env, engine, chatml_tok, limits=limits)
    # Turn 2 ends the episode: its observation is not appended.
    assert spans(traj) == [(21, 24, 46, 0.0), (46, 49, 49, 0.0)]
    assert traj.finish_reason == "length" and traj.truncated and traj.error is None
    assert len(env.actions) == 2


def test_token_budget_is_length_and_caps_max_new_tokens(chatml_tok):
    limits = EpisodeLimits(max_turns=5, max_total_tokens=30)
    engine = ScriptedEngine(lambda prompt: Reply(c("abcdefghij")))
    env = ScriptedEnv("hi", [say("ok"), say("ok")])
    traj = play(env, engine, chatml_tok, limits=limits)
    # 21 prompt ids leave 9: the reply is cut to 9, then "ok" (23 ids) does not fit.
    assert [s.max_new_tokens for _, s in engine.calls] == [8]
    assert spans(traj) == [(21, 29, 29, 0.0)] and traj.finish_reason == "length"

    engine = ScriptedEngine(lambda prompt: Reply(c("abcdefghij")), max_seq_len=25)
    traj = play(ScriptedEnv("hi", [say("ok")]), engine, chatml_tok)
    assert [s.max_new_tokens for _, s in engine.calls] == [4]  # 25 - 21
    assert traj.num_tokens == 25 and traj.finish_reason == "length"


def test_prompt_longer_than_budget_fails_the_episode(chatml_tok):
    limits = EpisodeLimits(max_turns=1, max_total_tokens=21)
    env = ScriptedEnv("hi")
    traj = play(env, ScriptedEngine([]), chatml_tok, limits=limits)
    assert traj.finish_reason == "error" and traj.num_tokens == 0 and env.score_calls == 1
    assert "21 tokens but an episode may hold 21" in traj.error


@pytest.mark.parametrize("bad", [KeyError("judge"), float("nan")])
def test_score_failure_gives_zero_reward_and_reason(chatml_tok, bad):
    env = ScriptedEnv("hi", [done(reward=0.5)], score=bad)
    if isinstance(bad, float):
        env.score_value = bad
    traj = play(env, ScriptedEngine([Reply(c("a"))]), chatml_tok)
    assert traj.reward == 0.0 and env.score_calls == 1
    assert traj.finish_reason == "env_error" and "Env.score" in traj.error
    assert traj.turns[0].reward == 0.5


def test_aborted_generation_ends_with_length(chatml_tok):
    engine = ScriptedEngine([Reply(c("ab"), finish="aborted")])
    env = ScriptedEnv("hi", [done()])
    traj = play(env, engine, chatml_tok)
    assert traj.finish_reason == "length" and "aborted" in traj.error
    assert env.actions == [] and spans(traj) == [(21, 23, 23, 0.0)]


def test_collate_puts_rewards_on_last_action_token(chatml_tok):
    engine = ScriptedEngine([Reply((*c("ab"), IM_END)), Reply((*c("c"), IM_END))])
    a = play(ScriptedEnv("hi", [say("ok", reward=0.5), done()], score=1.0), engine, chatml_tok)
    engine = ScriptedEngine([Reply((*c("ab"), IM_END))])
    b = play(ScriptedEnv("hi", [RuntimeError("x")], score=2.0), engine, chatml_tok)
    batch = collate([a, b])
    assert batch.tokens_BT.shape == (2, 48)
    # Row 0: turn reward 0.5 on token 23, outcome 1.0 on the last action token 47.
    assert batch.rewards_BT[0].nonzero().flatten().tolist() == [23, 47]
    assert batch.rewards_BT[0, 23] == 0.5 and batch.rewards_BT[0, 47] == 1.0
    # Row 1: one 3-token action at 21..23, the outcome on 23.
    assert batch.rewards_BT[1].nonzero().flatten().tolist() == [23]
    assert batch.rewards_BT[1, 23] == 2.0
    assert batch.action_mask_BT[0].nonzero().flatten().tolist() == [21, 22, 23, 46, 47]


def test_one_hung_env_does_not_block_another_episode(chatml_tok):
    engine = ScriptedEngine(lambda prompt: Reply((*c("a"), IM_END)), delay_s=0.01)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=256, step_timeout_s=0.3)
    hung, fine = ScriptedEnv("hi", [HANG]), ScriptedEnv("hi", [say("ok"), done()])

    async def both() -> list[Trajectory]:
        return await asyncio.gather(
            run_episode(hung, engine, chatml_tok, SAMPLING, limits, seed=0, prompt_id="h"),
            run_episode(fine, engine, chatml_tok, SAMPLING, limits, seed=1, prompt_id="f"),
        )

    h, f = asyncio.run(both())
    assert (h.finish_reason, f.finish_reason) == ("timeout", "stop")
    assert f.num_turns == 2


def test_episode_limits_validation():
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="max_total_tokens"):
        EpisodeLimits(max_total_tokens=True)
    with pytest.raises(ValueError, match="step_timeout_s"):
        EpisodeLimits(step_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="reset_timeout_s"):
        EpisodeLimits(reset_timeout_s=-1.0)
    with pytest.raises(TypeError, match="limits must be an EpisodeLimits"):
        asyncio.run(
            run_episode(
                ScriptedEnv("hi"), ScriptedEngine([]), None, SAMPLING, {}, seed=0, prompt_id="p"
            )
        )


def test_project_char_tokenizer_matches_its_assistant_mask():
    tokenization = pytest.importorskip("sao.models.tokenization")
    tok = tokenization.build_char_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    enc = tok.encode
    engine = ScriptedEngine([Reply((*enc("ab"), im_end)), Reply((*enc("c"), im_end))])
    traj = play(ScriptedEnv("hi", [say("ok"), done()]), engine, tok)
    convo = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ab"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "c"},
    ]
    out = tok.apply_chat_template(
        convo, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    # The template's own rendering, minus the final "\n" that is never sampled.
    assert list(traj.tokens) == list(out["input_ids"])[:-1]
    assert [bool(m) for m in traj.action_mask] == [bool(m) for m in out["assistant_masks"]][:-1]
