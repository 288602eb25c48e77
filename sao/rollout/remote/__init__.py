"""Engines outside the trainer's process: the HTTP clients for ``sao
serve``, vLLM and SGLang, the ``sao serve`` server, the router across
servers, the launcher and the weight transfer (disk, NCCL/gloo broadcast).
It imports :mod:`sao.rollout`'s contracts, the embedded engine (for ``sao
serve``), models and types."""
