"""Runs inside each vLLM worker process (``worker_extension_cls``): in-place weight loading for `VLLMEngine`.

Imports nothing of vLLM at module level and nothing of posttrain at all, so a worker can import it cheaply.
UNTESTED HERE (no vLLM, no GPU): see docs/rollout.md.
"""

from __future__ import annotations

import torch


class PosttrainWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` and ``self.device`` are the worker's."""

    def posttrain_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy Hugging Face-named tensors into the model in place; returns the parameters left unloaded."""
        model = self.model_runner.model
        weights = ((name, tensor.to(self.device, non_blocking=True)) for name, tensor in named_tensors)
        loaded = model.load_weights(weights=weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if loaded is None:  # older models do not report what they loaded
            return []
        return sorted(name for name, _ in model.named_parameters() if name not in loaded)
