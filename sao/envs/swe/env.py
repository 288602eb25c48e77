"""``SweEnv``: one episode of fixing a repository with file and shell tools.

The first observation is the issue. Each reply is one tool call
(:mod:`sao.envs.swe.protocol`); its observation is the tool's output cut to
``obs_chars`` with a marker. A malformed call gets an observation saying
what is wrong and the correct format, and wastes the turn. The episode ends
at ``submit`` or after ``max_turns`` replies; then the tests are graded
(:mod:`sao.envs.swe.grading`) and the working copy is removed. ``score`` is
that grade's reward; an episode the agent loop cut short (token budget) is
graded there, synchronously, on its final working copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from sao.envs._state import expect_same, read, read_optional
from sao.envs._tools import ToolCall, ToolCallError, as_observation, clip, opening
from sao.envs.base import Message, Observation, StepResult
from sao.envs.sandbox import SandboxResult, run_shell
from sao.envs.swe.grading import Grade, GradeLimits, grade
from sao.envs.swe.problem import SweProblem
from sao.envs.swe.protocol import parse_call
from sao.envs.swe.workspace import ToolError, Workspace

__all__ = ["SYSTEM_PROMPT", "SweEnv", "SweOptions"]

SYSTEM_PROMPT = (
    "Fix the issue in the repository. One tool call per reply: ls, read PATH [START END], "
    "replace PATH OLD => NEW, edit PATH START END (new lines below), run CMD, test, submit."
)
CUT = "\n...(cut)"
"""The marker that ends a cut observation."""


@dataclass(frozen=True)
class SweOptions:
    """Episode options shared by every env of a task (see ``SweTask``)."""

    max_turns: int = 8
    obs_chars: int = 400
    run_wall_s: float = 5.0
    protect_tests: bool = True
    partial_credit: bool = False
    system: bool = False
    grading: GradeLimits = field(default_factory=GradeLimits)


class SweEnv:
    """One ``swe`` episode; state lives in typed attributes."""

    def __init__(self, problem: SweProblem, options: SweOptions) -> None:
        self.problem = problem
        self.options = options
        self.workspace = Workspace(problem)
        self.turns = self.wasted = self.runs = self.edits = 0
        self.submitted = self.done = False
        self.grade: Grade | None = None
        self.sandbox = ""
        """Isolation level of the last sandbox run (``Isolation.level``), or ""."""

    def first_messages(self) -> list[Message]:
        """The issue, after the system message if enabled."""
        return opening(self.problem.issue, SYSTEM_PROMPT if self.options.system else None)

    async def reset(self, seed: int) -> Observation:
        """Start the episode on a fresh working copy; ``seed`` is unused."""
        self.turns = self.wasted = self.runs = self.edits = 0
        self.submitted = self.done = False
        self.grade = None
        self.workspace.create()
        return as_observation(self.first_messages())

    async def step(self, action: str) -> StepResult:
        """Apply one tool call; grade at ``submit`` or the turn limit."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.turns += 1
        obs: str | None
        try:
            call = parse_call(action)
            if call.name == "submit":
                self.submitted, obs = True, None
            elif call.name in ("run", "test"):
                obs = await self._shell(call)
            else:
                obs = self.use_file_tool(call)
        except (ToolCallError, ToolError) as err:
            self.wasted += 1
            obs = str(err)
        info: dict[str, int | float | str] = {}
        if self.submitted or self.turns >= self.options.max_turns:
            info.update((await self._finish()).info())
            obs = None
        return StepResult(obs, done=self.done, info={**self._counters(), **info})

    def use_file_tool(self, call: ToolCall) -> str:
        """The observation of ``ls``, ``read``, ``replace`` or ``edit`` (no sandbox)."""
        a, ws = call.arguments, self.workspace
        if call.name == "ls":
            return self._cut(ws.ls(str(a.get("path", ""))))
        if call.name == "read":
            start, end = a.get("start"), a.get("end")
            lines = ws.read(
                str(a["path"]),
                None if start is None else int(start),
                None if end is None else int(end),
            )
            return self._cut(lines, f"{CUT} (read {a['path']} START END for more)")
        if call.name == "replace":
            shown = ws.replace(str(a["path"]), str(a["old"]), str(a["new"]))
        else:
            shown = ws.edit(
                str(a["path"]), int(str(a["start"])), int(str(a["end"])), str(a.get("text", ""))
            )
        self.edits += 1
        return self._cut(shown)

    def observe(self, action: str) -> str:
        """What a file-tool call or a malformed call shows (demonstrations use it)."""
        try:
            return self.use_file_tool(parse_call(action))
        except (ToolCallError, ToolError) as err:
            return str(err)

    async def _shell(self, call: ToolCall) -> str:
        """Run ``run``'s command or the problem's test command in the sandbox."""
        self.runs += 1
        command = str(call.arguments["command"]) if call.name == "run" else self.problem.test_cmd
        wall = min(
            float(str(call.arguments.get("timeout", self.options.run_wall_s))),
            self.options.run_wall_s,
        )
        limits = self.options.grading
        try:
            result = await run_shell(
                command,
                self.workspace.root or "",
                wall_s=max(wall, 0.1),
                cpu_s=math.ceil(wall) + 1,
                memory_mb=limits.memory_mb,
                disk_mb=limits.disk_mb,
                file_size_mb=limits.file_size_mb,
                max_processes=limits.max_processes,
                max_output_chars=self.options.obs_chars,
                allow_root=limits.allow_root,
            )
        except (OSError, ValueError) as err:  # the sandbox itself failed, not the command
            return self._cut(f"(sandbox error: {err})")
        self.sandbox = result.isolation.level
        return shell_observation(result, self.options.obs_chars)

    def _cut(self, text: str, marker: str = CUT) -> str:
        return clip(text, self.options.obs_chars, marker)

    async def _finish(self) -> Grade:
        """Grade the final working copy once, then remove it."""
        if self.grade is None:
            if self.workspace.root is None:
                n_f2p, n_p2p = len(self.problem.fail_to_pass), len(self.problem.pass_to_pass)
                self.grade = Grade(0.0, "not_started", 0, n_f2p, 0, n_p2p, 0)
            else:
                o = self.options
                self.grade = await grade(
                    self.problem,
                    self.workspace.root,
                    protect_tests=o.protect_tests,
                    partial=o.partial_credit,
                    limits=o.grading,
                )
        self.workspace.remove()
        self.done = True
        return self.grade

    def score(self) -> float:
        """The grade's reward; an episode not yet graded is graded now (this
        blocks for the test run, in a worker thread with its own loop)."""
        if self.grade is None and self.workspace.root is not None:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, self._finish()).result()
        return self.grade.reward if self.grade is not None else 0.0

    def close(self) -> None:
        """Remove the working copy now (it is also removed when the env is collected)."""
        self.workspace.remove()

    def _counters(self) -> dict[str, int | float | str]:
        return {
            "turns": self.turns,
            "wasted": self.wasted,
            "runs": self.runs,
            "edits": self.edits,
            "sandbox": self.sandbox,
        }

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``): counters, the grade once
        there is one, and the working copy's changes from the original."""
        live = self.workspace.root is not None and not self.done
        return {
            "instance_id": self.problem.instance_id,
            **self._counters(),
            "submitted": self.submitted,
            "done": self.done,
            "grade": None if self.grade is None else self.grade.info(),
            "changes": self.workspace.changes() if live else None,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same problem only)."""
        expect_same(state, "instance_id", self.problem.instance_id)
        self.turns, self.wasted = read(state, "turns", int), read(state, "wasted", int)
        self.runs, self.edits = read(state, "runs", int), read(state, "edits", int)
        self.sandbox = read(state, "sandbox", str)
        self.submitted, self.done = read(state, "submitted", bool), read(state, "done", bool)
        saved = read_optional(state, "grade", dict)
        self.grade = None if saved is None else _read_grade(saved)
        changes = read_optional(state, "changes", dict)
        if changes is not None:
            self.workspace.apply(changes)


def _read_grade(saved: Mapping[str, object]) -> Grade:
    kinds = {"reward": float, "test_status": str}
    values: dict[str, object] = {
        f.name: read(saved, f.name, kinds.get(f.name, int)) for f in fields(Grade)
    }
    return Grade(**values)  # type: ignore[arg-type]


def shell_observation(result: SandboxResult, limit: int) -> str:
    """What the policy sees after a shell command: its stdout, its stderr,
    then ``(exit N)`` when it failed and ``(stopped: REASON)`` when a limit
    stopped it; cut to ``limit`` characters with :data:`CUT`."""
    status = []
    if result.exit_code not in (0, None):
        status.append(f"(exit {result.exit_code})")
    if result.killed_reason and result.killed_reason != "leftover_processes":
        status.append(f"(stopped: {result.killed_reason})")
    if result.export_error:
        status.append(f"(changes not kept: {result.export_error})")
    body = "\n".join(p.rstrip("\n") for p in (result.stdout, result.stderr) if p.strip())
    tail = " ".join(status)
    if not body:
        return tail or "(no output)"
    if not tail:
        return clip(body, limit, CUT)
    return clip(body, max(limit - len(tail) - 1, 0), CUT) + "\n" + tail
