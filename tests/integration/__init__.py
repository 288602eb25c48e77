"""Tests against real external servers (vLLM on the CPU), skipped unless configured."""
