"""The policy behind an OpenAI-compatible endpoint, recording every token.

While a run trains an agent, :class:`AgentEndpoint` serves the policy's
engine at ``/v1/chat/completions`` and ``/v1/completions`` (and
``/v1/models``) on 127.0.0.1. Each request names its episode, in one of three
ways: the URL (``/episodes/ID/v1/...``, what the agent's ``base_url`` is set
to), a header ``X-Episode-Id: ID``, or the API key (``Authorization: Bearer
ID``). Every call records the prompt ids it was given and the ids it sampled,
with log-probabilities and weight versions (:class:`~sao.agents.export.Call`).

Token in, token out, also here: when a request's messages are the previous
request's messages plus the reply it got back, then new messages, the prompt
is the previous prompt and the *sampled* reply ids, then only the new
messages rendered after it (:func:`sao.rollout.chat.encode_next_observation`)
-- never the reply re-rendered from text. Any other request is rendered
whole with the tokenizer's chat template (``tools`` passed on).

Tool calls come back in the OpenAI format: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` blocks in a reply (the Hermes / Qwen
convention) become ``message.tool_calls``. Sampling is the run's (the
trainer reproduces it): a request's ``temperature`` or ``top_p`` is ignored;
``max_tokens`` may only lower the run's ``rollout.max_new_tokens``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from sao.agents.export import Call
from sao.rollout.chat import decode_reply, encode_next_observation
from sao.rollout.engine import Engine, episode_key
from sao.rollout.remote.launch import free_port
from sao.types import Message, SamplingParams

__all__ = ["AgentEndpoint", "EpisodeCalls", "parse_tool_calls"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FINISH = {"stop": "stop", "length": "length", "aborted": "length"}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The reply's text outside ``<tool_call>`` blocks, and the blocks that hold
    ``{"name": str, "arguments": object}`` as OpenAI tool calls (others stay text)."""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match[str]) -> str:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return m.group(0)
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
        return ""

    content = _TOOL_CALL.sub(take, text).strip()
    return content, calls


def _text(content: object) -> str:
    """An OpenAI message content (a string, None, or a list of text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise _Bad(f"message content must be a string or a list of parts, not {type(content).__name__}")


_ROLES = ("system", "user", "assistant", "tool")


def _message(m: Mapping[str, Any]) -> Message:
    role = m.get("role")
    if role not in _ROLES:
        raise _Bad(f"message role {role!r} is not one of {', '.join(_ROLES)}")
    return Message(role, _text(m.get("content")))


def _key(message: Mapping[str, Any]) -> tuple[object, ...]:
    """What identifies a message when a later request repeats it."""
    calls = tuple(
        (c.get("function", {}).get("name"), _canonical(c.get("function", {}).get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return (message.get("role"), _text(message.get("content")), calls)


def _canonical(arguments: object) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return str(arguments)
    return json.dumps(value, sort_keys=True)


class _Bad(Exception):
    """A request the endpoint refuses (HTTP 400 / 404, OpenAI error body)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EpisodeCalls:
    """One open episode: its sampling, its calls, and its conversation so far."""

    sampling: SamplingParams
    calls: list[Call] = field(default_factory=list)
    messages: list[Mapping[str, Any]] = field(default_factory=list)
    """The last chat request's messages plus the reply it got (``[]``: none yet)."""


class AgentEndpoint:
    """``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` over ``engine``."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_name: str = "policy",
        max_seq_len: int | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_seq_len = max_seq_len
        self.episodes: dict[str, EpisodeCalls] = {}
        self.app = web.Application(client_max_size=16 * 1024**2)
        r = self.app.router
        for prefix in ("", "/episodes/{episode}"):
            r.add_get(prefix + "/v1/models", self.models)
            r.add_post(prefix + "/v1/chat/completions", self.chat)
            r.add_post(prefix + "/v1/completions", self.completions)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (a free port by default); returns the base URL."""
        port = port or free_port()
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, episode: str, sampling: SamplingParams) -> EpisodeCalls:
        """Start recording ``episode`` (its requests are refused before and after)."""
        calls = self.episodes[episode] = EpisodeCalls(sampling)
        return calls

    def close_episode(self, episode: str) -> EpisodeCalls | None:
        return self.episodes.pop(episode, None)

    # ------------------------------------------------------------------ routes

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": self.model_name, "object": "model", "owned_by": "sao"}]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.Response:
        try:
            ep, body = await self._request(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _Bad("messages must be a non-empty list")
            prompt = self._chat_prompt(ep, messages, body.get("tools"))
            call = await self._generate(request, ep, prompt, body)
            content, tool_calls = parse_tool_calls(decode_reply(self.tokenizer, call.ids))
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                reply["tool_calls"] = tool_calls
            ep.messages = [*messages, reply]
            finish = "tool_calls" if tool_calls else _FINISH[call.finish]
            choice = {"index": 0, "message": reply, "finish_reason": finish}
            return self._response("chat.completion", choice, call)
        except _Bad as err:
            return _error(err)

    async def completions(self, request: web.Request) -> web.Response:
        try:
            ep, body = await self._request(request)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                ids = [int(i) for i in prompt]
            else:
                raise _Bad("prompt must be a string or a list of token ids")
            call = await self._generate(request, ep, ids, body)
            text = decode_reply(self.tokenizer, call.ids)
            choice = {"index": 0, "text": text, "finish_reason": _FINISH[call.finish]}
            return self._response("text_completion", choice, call)
        except _Bad as err:
            return _error(err)

    # ------------------------------------------------------------------ helpers

    async def _request(self, request: web.Request) -> tuple[EpisodeCalls, dict[str, Any]]:
        eid = request.match_info.get("episode") or request.headers.get("X-Episode-Id")
        auth = request.headers.get("Authorization", "")
        if not eid and auth.startswith("Bearer ") and auth[7:] in self.episodes:
            eid = auth[7:]
        if not eid:
            raise _Bad(
                "no episode id: use base_url .../episodes/ID/v1, the header X-Episode-Id, "
                "or the episode id as the API key"
            )
        ep = self.episodes.get(eid)
        if ep is None:
            raise _Bad(f"episode {eid!r} is not running (finished, or never started)", 404)
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            raise _Bad(f"the request body is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise _Bad("the request body must be a JSON object")
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise _Bad(f"model {model!r} is not served here; use {self.model_name!r}", 404)
        return ep, body

    def _chat_prompt(self, ep: EpisodeCalls, messages: Sequence[Any], tools: object) -> list[int]:
        """The prompt ids: the previous call's tokens and the new messages after
        them when this request extends the last one, else the whole render."""
        if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
            raise _Bad("every message must be an object with a role")
        prev, last = ep.messages, ep.calls[-1] if ep.calls else None
        same = len(messages) > len(prev) and [_key(m) for m in messages[: len(prev)]] == [
            _key(m) for m in prev
        ]
        try:
            if last is not None and prev and same:
                history = [_message(m) for m in prev[:-1]]
                new = tuple(_message(m) for m in messages[len(prev) :])
                suffix = encode_next_observation(
                    self.tokenizer, history, last.ids, last.finish, new
                )
                return [*last.tokens, *suffix]
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=tools if isinstance(tools, list) else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except _Bad:
            raise
        except Exception as err:  # the template cannot render these messages
            raise _Bad(f"the chat template cannot render the messages: {err}") from None
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    async def _generate(
        self, request: web.Request, ep: EpisodeCalls, prompt: list[int], body: Mapping[str, Any]
    ) -> Call:
        room = (self.max_seq_len or 1 << 30) - len(prompt)
        if room < 1:
            raise _Bad(f"the prompt has {len(prompt)} tokens; the model holds {self.max_seq_len}")
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        limit = ep.sampling.max_new_tokens
        if isinstance(asked, int) and asked > 0:
            limit = min(limit, asked)
        sampling = replace(ep.sampling, max_new_tokens=min(limit, room))
        token = episode_key.set(request.match_info.get("episode") or str(id(ep)))
        try:
            done = await self.engine.generate(prompt, sampling)
        finally:
            episode_key.reset(token)
        call = Call(tuple(prompt), done.token_ids, done.logprobs, done.versions, done.finish_reason)
        ep.calls.append(call)
        return call

    def _response(self, kind: str, choice: dict[str, Any], call: Call) -> web.Response:
        return web.json_response(
            {
                "id": f"sao-{uuid.uuid4().hex[:16]}",
                "object": kind,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(call.prompt_ids),
                    "completion_tokens": len(call.ids),
                    "total_tokens": len(call.tokens),
                },
            }
        )


def _error(err: _Bad) -> web.Response:
    kind = "invalid_request_error" if err.status == 400 else "not_found_error"
    return web.json_response({"error": {"message": str(err), "type": kind}}, status=err.status)
