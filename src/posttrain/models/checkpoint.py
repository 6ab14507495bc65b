"""Atomic checkpoints: a plain Hugging Face directory plus a training-state file.

Layout under a run's output directory:

    checkpoints/step-000120/   config.json, model.safetensors, tokenizer files  (loadable by transformers)
                               adapter/                 (LoRA runs: the adapter, for an exact resume)
                               training_state.pt        (optimizer, LR schedule, RNG states, data cursor, step...)
    checkpoints/latest         the name of the newest complete checkpoint
    final/                     the finished model, a plain HF directory (LoRA merged in unless
                               model.lora.merge_on_save: false, which leaves the adapter alone)

Every directory is written under a temporary name and renamed into place, and `latest` is replaced
atomically after the rename, so a crash mid-write (even SIGKILL) leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from posttrain.models.lora import is_lora

STATE_FILE = "training_state.pt"


def save_model_dir(directory: Path, model, tokenizer, *, merge_lora: bool = True) -> Path:
    """Write `model` + `tokenizer` as an HF directory at `directory`, atomically (replacing any old one)."""
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_model(tmp, model, tokenizer, merge_lora=merge_lora)
    _replace_dir(tmp, directory)
    return directory


def save_checkpoint(
    output_dir: Path, step: int, model, tokenizer, state: dict[str, Any], *, keep: int = 2,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` (model + `state`), point `latest` at it, prune all but the newest `keep`.
    `extra(directory)` writes more that belongs to the checkpoint (an RL critic) before it is renamed into place."""
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _write_model(tmp, model, tokenizer, merge_lora=True)
    if is_lora(model):
        model.save_pretrained(tmp / "adapter")
    if extra is not None:
        extra(tmp)
    state = {**state, "step": step, "rng": capture_rng()}
    with open(tmp / STATE_FILE, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    _replace_dir(tmp, root / name)
    _write_atomic(root / "latest", name)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = Path(output_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    complete = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    # Our own file, written by `save_checkpoint`: it holds RNG states and plain Python objects.
    return torch.load(Path(checkpoint) / STATE_FILE, map_location="cpu", weights_only=False)


def capture_rng() -> dict[str, Any]:
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _write_model(directory: Path, model, tokenizer, *, merge_lora: bool) -> None:
    directory.mkdir(parents=True)
    to_save = model
    if is_lora(model) and merge_lora:
        from posttrain.models.lora import merged_copy

        to_save = merged_copy(model)
    to_save.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _replace_dir(tmp: Path, target: Path) -> None:
    # A directory rename cannot replace a non-empty directory: move the old one aside first, so that at
    # every instant either the old or the new complete directory stands at `target` (or its `.old` name).
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_weights_from_checkpoint(model: torch.nn.Module, checkpoint: Path) -> None:
    """Copy a checkpoint's weights into `model` in place (the optimizer's references stay valid).

    For a LoRA model this loads `adapter/`: loading the merged weights into a model that still has its
    adapter would count the adapter twice.
    """
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    if is_lora(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(checkpoint / "adapter" / "adapter_model.safetensors")))
        return
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])  # tied weights are saved once
    missing = [name for name in missing if name not in tied]
    if (missing or unexpected) and getattr(getattr(model, "config", None), "vision_config", None) is not None:
        # A model whose `save_pretrained` writes its weights under other names than its modules' (LLaVA and other
        # vision-language models keep the legacy `language_model.model.*` names on disk): let transformers read
        # the directory back, then copy in place.
        saved = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)
        missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
        missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"{checkpoint}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
