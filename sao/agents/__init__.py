"""Train the agents you already have: your code talks to the policy through an
OpenAI-compatible endpoint that records every token (:mod:`sao.agents.endpoint`),
and its calls become training samples (:mod:`sao.agents.export`). It imports
rollout (the ``Engine`` contract, resume, a free port), the envs' splits and
the types; only the composition root (:mod:`sao.app`) imports it."""

from sao.agents.endpoint import AgentEndpoint, parse_tool_calls
from sao.agents.export import Call, export_calls
from sao.agents.runner import AgentRunner, AgentTask

__all__ = ["AgentEndpoint", "AgentRunner", "AgentTask", "Call", "export_calls", "parse_tool_calls"]
