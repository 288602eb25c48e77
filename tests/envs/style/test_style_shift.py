"""The style-shift task: hand-checked judge cases, the preference schedule,
splits, demonstrations and the optional LLM judge (against a local server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sao.envs.base import Env, StepAware, Task
from sao.envs.registry import make_task
from sao.envs.style.judges import style_share, style_votes
from sao.envs.style.shift import (
    FORMAT_HINT,
    STYLES,
    BuiltinJudge,
    StyleShiftEnv,
    StyleShiftTask,
    detect_style,
    judge_text,
    preferred_style,
)
from tests.envs.conftest import play

CASES = {
    "academic": "[academic] notably, red cats merit analysis; the evidence is thus clear.",
    "cute": "[cute] red cats are so fluffy and smol, yay!",
    "chuunibyou": "[chuunibyou] behold! red cats awaken the darkness within my sealed eye!",
    "classical": "[classical] yonder red cats doth rest ere the night, alas.",
}


def test_protocols_and_registry() -> None:
    task = make_task("style_shift")
    assert isinstance(task, Task) and isinstance(task, StepAware)
    assert isinstance(task.make_env("train", 0), Env)


def test_example_episode() -> None:
    env = StyleShiftEnv("red cats", "cute", judge=BuiltinJudge())
    ep = play(env, [CASES["cute"]])
    assert ep.first == "write about red cats"
    assert ep.observations == [None] and ep.done and ep.score == 1.0
    assert ep.results[0].info == {
        "quality": 1,
        "style": "cute",
        "preferred": "cute",
        "reason": "ok",
        # held-out accuracy per style (eval/style_...): only the cute judge accepts it
        "metric/style_academic": 0.0,
        "metric/style_cute": 1.0,
        "metric/style_chuunibyou": 0.0,
        "metric/style_classical": 0.0,
    }


@pytest.mark.parametrize("style", STYLES)
def test_each_style_is_detected_and_scored(style: str) -> None:
    assert detect_style(CASES[style]) == style
    assert judge_text(CASES[style], "red cats").quality
    for preferred in STYLES:
        env = StyleShiftEnv("red cats", preferred, judge=BuiltinJudge())
        assert play(env, [CASES[style]]).score == float(style == preferred)


@pytest.mark.parametrize(
    "text",
    [
        "[cute] red cats sit on the mat quietly.",  # no marker words
        "[cute] behold the darkness, red cats, uwu",  # chuunibyou markers dominate
        "[cute] behold red cats, uwu",  # tie: no clear style
        "[poetic] thee and thou, red cats",  # unknown tag
        "cute: red cats are fluffy, yay",  # no tag
    ],
)
def test_style_detection_failures(text: str) -> None:
    assert detect_style(text) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("red cats are so fluffy, yay!", "no style tag"),
        ("[cute] yay red cats", "length 3 words"),
        ("[cute] " + "red cats are fluffy yay " * 8, "length 40 words"),
        ("[cute] red cats are " + "supercalifragilistic" * 12 + " yay", "chars"),
        ("[cute] red cats yay yay yay yay fluffy", "repetition"),
        ("[cute] red cats uwu uwu red cats uwu", "repetition"),
        ("[cute] blue dogs are so fluffy and smol, yay!", "off topic"),
        ("[cute] red cats are so fluffy \x00 yay!", "unprintable"),
        ("[cute] redcats are so fluffy and smol, yay!", "off topic"),
    ],
)
def test_quality_failures(text: str, reason: str) -> None:
    verdict = judge_text(text, "red cats")
    assert not verdict.quality and reason in verdict.reason
    env = StyleShiftEnv("red cats", "cute", judge=BuiltinJudge())
    assert play(env, [text]).score == 0.0


def test_style_votes_by_hand() -> None:
    # tag cute (1) + uwu (1); behold, darkness (2 chuunibyou)
    assert style_votes("[cute] behold the darkness, red cats, uwu") == {
        "academic": 0,
        "cute": 2,
        "chuunibyou": 2,
        "classical": 0,
    }
    # no tag: no tag vote, markers counted in the whole text
    assert style_votes("thou red cats, yay")["classical"] == 1
    assert style_votes("red cats")["cute"] == 0 and style_share("red cats", "cute") == 0.0
    # the chuunibyou case: tag + behold, awaken, darkness, sealed = 5 of 5
    assert style_share(CASES["chuunibyou"], "chuunibyou") == 1.0


@pytest.mark.parametrize(
    ("text", "preferred", "score", "succeeds_under"),
    [
        (CASES["cute"], "cute", 1.0, {"cute"}),  # tag + fluffy, smol, yay: 4 of 4
        (CASES["cute"], "chuunibyou", 0.0, {"cute"}),
        # a cute text drifting after a switch: cute tag + fluffy (2), cursed (1 of 3)
        ("[cute] red cats are so fluffy, my cursed friends", "chuunibyou", 1 / 3, {"cute"}),
        # cute tag (1) + behold, awaken, darkness (3): 3 of 4 under chuunibyou
        ("[cute] behold! red cats awaken the darkness now", "chuunibyou", 3 / 4, {"chuunibyou"}),
        ("[cute] behold! red cats awaken the darkness now", "cute", 1 / 4, {"chuunibyou"}),
        # 2 of 4 each: no style above one half succeeds
        ("[cute] behold the darkness, red cats, uwu", "cute", 1 / 2, set()),
        ("[cute] red cats yay yay yay yay fluffy", "cute", 0.0, set()),  # quality fails first
    ],
)
def test_partial_credit_by_hand(
    text: str, preferred: str, score: float, succeeds_under: set[str]
) -> None:
    env = StyleShiftEnv("red cats", preferred, judge=BuiltinJudge(), credit="partial")
    ep = play(env, [text])
    assert ep.score == pytest.approx(score)
    info = ep.results[0].info
    assert {s for s in STYLES if info[f"metric/style_{s}"] == 1.0} == succeeds_under


def test_partial_credit_is_the_tasks_option() -> None:
    task = StyleShiftTask(credit="partial")
    assert task.make_env("train", 0).credit == "partial"
    assert task.make_eval_env(0, "classical").credit == "partial"
    assert StyleShiftTask().make_env("train", 0).credit == "binary"


def test_topic_match_is_case_insensitive() -> None:
    assert judge_text("[cute] Red Cats are so fluffy, yay!", "red cats").quality


@pytest.mark.parametrize(
    ("step", "style"),
    [(0, "cute"), (132, "cute"), (133, "chuunibyou"), (265, "chuunibyou"), (266, "classical")],
)
def test_default_schedule_boundaries(step: int, style: str) -> None:
    task = StyleShiftTask()
    assert preferred_style(task.schedule, step) == style
    task.set_train_step(step)
    assert task.preferred == style and task.make_env("eval", 0).preferred == style


def test_envs_keep_the_preference_they_were_made_with() -> None:
    task = StyleShiftTask(schedule=[(0, "academic"), (10, "classical")])
    before = task.make_env("train", 1)
    task.set_train_step(10)
    after = task.make_env("train", 1)
    assert (before.preferred, after.preferred) == ("academic", "classical")
    assert before.topic == after.topic


def test_eval_env_per_style() -> None:
    task = StyleShiftTask()
    task.set_train_step(300)
    envs = {s: task.make_eval_env(3, s) for s in STYLES}
    assert {s: e.preferred for s, e in envs.items()} == {s: s for s in STYLES}
    assert len({e.topic for e in envs.values()}) == 1
    with pytest.raises(ValueError, match="style"):
        task.make_eval_env(0, "gothic")


@pytest.mark.parametrize(
    "schedule",
    [[], [(5, "cute")], [(0, "cute"), (0, "academic")], [(0, "gothic")], [(0, "cute", 1)]],
)
def test_bad_schedules(schedule: list[tuple[int, str]]) -> None:
    with pytest.raises(ValueError, match="option schedule"):
        StyleShiftTask(schedule=schedule)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"min_words": 0}, "min_words"),
        ({"max_turns": 0}, "max_turns"),
        ({"error_rate": 2.0}, "error_rate"),
        ({"judge": "gpt"}, "judge"),
        ({"judge": "openai", "judge_model": "m"}, "judge_base_url"),
        ({"judge": "openai", "judge_base_url": "http://x/v1"}, "judge_model"),
        ({"credit": "graded"}, "credit"),
        (
            {"credit": "partial", "judge": "openai", "judge_base_url": "http://x/v1"},
            "credit",
        ),
    ],
)
def test_options_are_validated(kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=f"option {option}"):
        StyleShiftTask(**kwargs)  # type: ignore[arg-type]


def test_topic_splits_are_disjoint_and_deterministic() -> None:
    task = StyleShiftTask(seed=5)
    train = {task.topic("train", i) for i in range(2000)}
    evals = {task.topic("eval", i) for i in range(task.eval_size)}
    assert not train & evals and len(evals) == len(task.topics["eval"]) > 20
    assert [StyleShiftTask(seed=5).topic("train", i) for i in range(30)] == [
        task.topic("train", i) for i in range(30)
    ]


@pytest.mark.parametrize("action", ["", "x" * 200_000, "[cute]", "[cute] " + "uwu " * 10_000])
def test_adversarial_texts_score_zero(action: str) -> None:
    env = StyleShiftTask().make_env("train", 0)
    ep = play(env, [action, action])
    assert ep.done and len(ep.results) == 1 and ep.score == 0.0
    assert env.text is not None and len(env.text) <= 4000


def test_untagged_text_is_retried_when_turns_remain() -> None:
    env = StyleShiftTask(max_turns=2).make_eval_env(0, "cute")
    fixed = CASES["cute"].replace("red cats", env.topic)
    ep = play(env, ["red cats are fluffy", fixed])
    assert ep.observations == [FORMAT_HINT, None] and ep.score == 1.0


def test_score_before_any_step_and_after_done() -> None:
    env = StyleShiftTask().make_env("eval", 0)
    assert env.score() == 0.0
    play(env, [CASES["cute"]])
    assert asyncio.run(env.step("again")).done


def test_demonstrations_cover_styles_and_are_imperfect() -> None:
    task = StyleShiftTask()
    demos = task.demonstrations(400, seed=0)
    assert demos == task.demonstrations(400, seed=0)
    verdicts = []
    for conv in demos:
        assert [m.role for m in conv] == ["user", "assistant"]
        topic = conv[0].content.removeprefix("write about ")
        assert task.split_of(topic) == "train"
        verdicts.append(judge_text(conv[1].content, topic))
    styles = Counter(v.style for v in verdicts if v.quality)
    assert set(styles) >= set(STYLES)
    good = sum(v.quality and v.style is not None for v in verdicts) / len(verdicts)
    assert 0.55 < good < 0.9


def test_demonstrations_lean_toward_the_first_scheduled_style() -> None:
    # demo_lean=2: the first style weighs 2 of 5, each other style 1 of 5.
    def tags(task: StyleShiftTask) -> Counter[str]:
        demos = task.demonstrations(2000, seed=1)
        return Counter(m.group(1) for c in demos if (m := re.match(r"\[(\w+)\]", c[-1].content)))

    cute = tags(StyleShiftTask())
    assert cute.most_common(1)[0][0] == "cute"
    assert 0.33 < cute["cute"] / sum(cute.values()) < 0.47
    classical = tags(StyleShiftTask(schedule=[(0, "classical"), (10, "cute")]))
    assert classical.most_common(1)[0][0] == "classical"
    flat = tags(StyleShiftTask(demo_lean=1.0))
    assert max(flat.values()) / sum(flat.values()) < 0.3
    with pytest.raises(ValueError, match="demo_lean"):
        StyleShiftTask(demo_lean=0.0)


# --- the optional LLM judge, against a local canned server -------------------


class _Handler(BaseHTTPRequestHandler):
    reply: str = '{"quality": 1, "style": "cute"}'
    status: int = 200
    delay_s: float = 0.0
    seen: list[dict[str, object]] = []  # noqa: RUF012 (shared with the test on purpose)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        time.sleep(self.delay_s)
        data = {"choices": [{"message": {"role": "assistant", "content": self.reply}}]}
        raw = json.dumps(data).encode() if self.status == 200 else b"oops"
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(raw)  # the client may have timed out already

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def judge_server() -> Iterator[tuple[str, type[_Handler]]]:
    """A local chat-completions endpoint returning canned judge replies."""
    handler = type("Handler", (_Handler,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    server.shutdown()
    server.server_close()


def _llm_task(url: str, **kwargs: object) -> StyleShiftTask:
    return StyleShiftTask(
        judge="openai",
        judge_base_url=url,
        judge_model="judge-1",
        judge_api_key_env="SAO_TEST_JUDGE_KEY",
        **kwargs,  # type: ignore[arg-type]
    )


def test_llm_judge_success(
    judge_server: tuple[str, type[_Handler]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = judge_server
    monkeypatch.setenv("SAO_TEST_JUDGE_KEY", "secret")
    env = _llm_task(url).make_eval_env(0, "cute")
    ep = play(env, ["anything at all"])
    assert ep.score == 1.0 and env.verdict is not None and env.verdict.reason == "llm judge"
    (request,) = handler.seen
    assert request["path"] == "/v1/chat/completions" and request["model"] == "judge-1"
    assert request["auth"] == "Bearer secret"
    assert "anything at all" in json.dumps(request["messages"])
    other = _llm_task(url).make_eval_env(0, "academic")
    assert play(other, ["anything"]).score == 0.0  # style mismatch


@pytest.mark.parametrize(
    ("status", "reply", "delay_s", "reason"),
    [
        (500, "", 0.0, "HTTPError"),
        (200, "I refuse", 0.0, "no JSON"),
        (200, '{"style": "cute"}', 0.0, "KeyError"),
        (200, '{"quality": 1, "style": "cute"}', 0.5, "timed out"),
    ],
)
def test_llm_judge_errors_score_zero(
    judge_server: tuple[str, type[_Handler]], status: int, reply: str, delay_s: float, reason: str
) -> None:
    url, handler = judge_server
    handler.status, handler.reply, handler.delay_s = status, reply, delay_s
    env = _llm_task(url, judge_timeout_s=0.1).make_eval_env(0, "cute")
    ep = play(env, [CASES["cute"]])
    assert ep.score == 0.0 and env.verdict is not None
    assert reason in env.verdict.reason and ep.results[0].info["quality"] == 0
