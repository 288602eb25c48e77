"""The HTTP client's version rule at the edges of a pause, made deterministic
by a vLLM-protocol server (``sao serve`` without per-token versions) that
holds one request or its answer at a chosen point.

vLLM and SGLang queue a request that reaches them while paused and run it
after the resume, so such a request is sampled by the new weights although
the client sent it before the update. Its answer looks like one that finished
just before the pause; the client must not tag it with the old version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from aiohttp import web

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.remote.server import EngineServer
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import write_weights
from sao.types import Completion, SamplingParams
from tests.rollout.embedded.test_engine import build, reference_logp
from tests.rollout.engines import serving

PROMPT = [2, 7, 1, 8, 2, 8]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)


class HoldingServer(EngineServer):
    """Holds the first completion: its request until the pause has reached the
    server (``hold="request"``: in transit), or its answer until the pause
    (``"answer_to_pause"``) or the resume (``"answer_to_resume"``) has.
    ``held`` is set once the request is held (in transit, or its answer
    sampled); the reload waits for ``reload_may_run``."""

    def __init__(self, engine: TorchEngine, hold: str) -> None:
        super().__init__(engine, model_name="tiny", report_versions=False)
        self.hold = hold
        self.held, self.paused, self.resumed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.reload_may_run = asyncio.Event()
        self.reload_may_run.set()

    async def completions(self, request: web.Request) -> web.Response:
        hold, self.hold = self.hold, ""
        if hold == "request":
            self.held.set()
            await self.paused.wait()
        answer = await super().completions(request)
        if hold:
            self.held.set()
        if hold == "answer_to_pause":
            await self.paused.wait()
        if hold == "answer_to_resume":
            await self.resumed.wait()
        return answer

    async def pause(self, request: web.Request) -> web.Response:
        answer = await super().pause(request)
        self.paused.set()
        return answer

    async def resume(self, request: web.Request) -> web.Response:
        answer = await super().resume(request)
        self.resumed.set()
        return answer

    async def collective_rpc(self, request: web.Request) -> web.Response:
        await self.reload_may_run.wait()
        return await super().collective_rpc(request)


def run(hold: str, tmp_path: Path, *, answer_before_reload: bool = False) -> tuple:
    """One generation sent before an update to version 1; returns it and the
    client's redraw count."""
    old, new = build("llama", seed=0), build("llama", seed=1)
    source = write_weights(new.state_dict(), tmp_path, 1)

    async def go() -> tuple[Completion, int]:
        local = TorchEngine(old, max_seq_len=64, max_batch_size=4)
        server = HoldingServer(local, hold)
        try:
            async with serving(server.app) as url:
                client = VLLMEngine(url, request_timeout_s=30)
                await client.connect(None, timeout_s=10)
                try:
                    task = asyncio.create_task(client.generate(PROMPT, SAMPLING))
                    await server.held.wait()
                    if answer_before_reload:
                        server.reload_may_run.clear()
                    update = asyncio.create_task(client.update_weights(source))
                    if answer_before_reload:  # the answer comes while the update is held
                        done = await asyncio.wait_for(asyncio.shield(task), 10)
                        server.reload_may_run.set()
                    await update
                    done = await asyncio.wait_for(task, 10)
                    return done, client.redrawn
                finally:
                    await client.aclose()
        finally:
            await local.aclose()

    done, redrawn = asyncio.run(go())
    model = new if done.versions == (1,) * len(done.versions) else old
    assert len(done.token_ids) == SAMPLING.max_new_tokens
    ref = reference_logp(model, PROMPT, done.token_ids, SAMPLING.temperature)
    assert torch.allclose(torch.tensor(done.logprobs), ref, atol=1e-4, rtol=0)
    return done, redrawn


@pytest.mark.parametrize("hold", ["request", "answer_to_resume"])
def test_an_answer_that_overlaps_a_finished_pause_is_sampled_again(
    hold: str, tmp_path: Path
) -> None:
    # "request": it reached the server during the pause and ran with the new
    # weights; "answer_to_resume": it ran with the old ones. The client cannot
    # tell the two apart, so it samples again under version 1 (the log-probs
    # match the new weights, checked in run)
    done, redrawn = run(hold, tmp_path)
    assert done.versions == (1,) * 8
    assert redrawn == 1


def test_an_answer_that_arrives_before_the_resume_keeps_the_old_version(
    tmp_path: Path,
) -> None:
    # it finished before the pause reached the server (not aborted) and came
    # back before the reload: sampled by version 0 and kept
    done, redrawn = run("answer_to_pause", tmp_path, answer_before_reload=True)
    assert done.versions == (0,) * 8
    assert redrawn == 0
