"""sao: Single-rollout Asynchronous Optimization for agentic reinforcement
learning of language models."""

__version__ = "0.1.0"
