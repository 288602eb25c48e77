"""The embedded engine: :class:`~sao.rollout.embedded.engine.TorchEngine`
in the trainer's process (KV cache, continuous-batching scheduler, sampling
with the exact log-probabilities DIS needs). It imports only
:mod:`sao.rollout`'s contracts, the types and torch."""
