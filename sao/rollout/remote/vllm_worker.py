"""A vLLM worker extension that reloads weights and refreshes tied heads.

vLLM runs this class inside its worker processes when a server is started
with ``--worker-extension-cls sao.rollout.remote.vllm_worker.SaoWorkerExtension``
(what ``rollout.launch`` does); its methods are then callable through
``POST /collective_rpc {"method": "reload_weights_and_refresh", "kwargs":
{"weights_path": DIR}}``.

Why. On the CPU, vLLM pre-packs every linear layer's weight for its GEMM
kernels (``dispatch_cpu_unquantized_gemm``). An in-place ``reload_weights``
re-packs each layer whose weights it loaded, but a tied LM head
(``tie_word_embeddings``, as in every tiny sao policy) loads nothing -- its
weight *is* the embedding's, refreshed through ``embed_tokens`` -- so the head
keeps multiplying by the packed copy of the old embedding and the served
log-probabilities belong to neither version (measured: off by up to 0.14
nats). After the reload this extension re-runs
``quant_method.process_weights_after_loading`` on every module that holds a
pre-packed copy (``cpu_linear``) of a weight it shares with another module.
On a GPU nothing is pre-packed and the method is a plain ``reload_weights``.

This module runs in vLLM's Python: it imports vLLM and torch lazily, inside
the method, and nothing from sao beyond what ``sao.rollout`` itself imports.
"""

from __future__ import annotations

from typing import Protocol, cast

__all__ = ["SaoWorkerExtension"]


class _ModelRunner(Protocol):
    def get_model(self) -> object: ...


class _Worker(Protocol):
    """The part of vLLM's ``Worker`` (``vllm.v1.worker.gpu_worker``) used here."""

    vllm_config: object
    model_runner: _ModelRunner

    def reload_weights(self, *, weights_path: str) -> None: ...


class SaoWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``).

    vLLM refuses an extension attribute that the worker already has, so the
    helpers are module functions and the only attribute is the RPC method.
    """

    def reload_weights_and_refresh(self, weights_path: str) -> list[str]:
        """``reload_weights(weights_path=...)``, then re-pack tied pre-packed
        weights; returns the names of the modules re-packed (``["model.embed_tokens",
        "lm_head"]`` for a tied Llama on the CPU, ``[]`` on a GPU)."""
        from vllm.config import set_current_vllm_config

        worker = cast(_Worker, self)
        worker.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(worker.vllm_config):
            return _refresh_tied_prepacked(worker.model_runner.get_model())


def _refresh_tied_prepacked(model: object) -> list[str]:
    """Re-run ``process_weights_after_loading`` on the modules of ``model``
    that keep a pre-packed (``cpu_linear``) copy of a tied weight."""
    import torch

    assert isinstance(model, torch.nn.Module)
    owners: dict[int, int] = {}  # parameter id -> number of modules holding it
    modules = list(model.named_modules(remove_duplicate=False))
    for _, module in modules:
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    refreshed: list[str] = []
    seen: set[int] = set()
    for name, module in modules:
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (
            id(module) in seen
            or method is None
            or not hasattr(module, "cpu_linear")  # set only by vLLM's CPU GEMM dispatch
            or not isinstance(weight, torch.Tensor)
            or weight.numel() == 0  # the packed copy is all there is: reloaded with it
            or owners.get(id(weight), 0) < 2
        ):
            continue
        seen.add(id(module))
        with torch.no_grad():
            method.process_weights_after_loading(module)
        refreshed.append(name)
    return refreshed
