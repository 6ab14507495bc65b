"""`posttrain export RUN_DIR DEST`: a run's model as one plain safetensors directory, LoRA merged, dtype cast.

What is exported, from what `RUN_DIR` names:

- a run directory: its `final/`; when `final/` is a LoRA adapter alone (`model.lora.merge_on_save: false`) and the
  adapter's base model is not a local directory (the built-in tiny model has none), the run's newest checkpoint,
  which holds the merged weights of the same last step;
- a LoRA adapter directory (`adapter_config.json`) whose base is a local directory: base + adapter, merged;
- a checkpoint or any Hugging Face model directory: as it is (a causal LM, or a reward model saved as an
  `AutoModelForSequenceClassification`, with its `reward_stats.json`).

The destination is written atomically (a crash leaves no half directory) with the tokenizer beside the weights. It
replaces an earlier model directory there, never a directory of anything else (`check_destination`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from posttrain.models.checkpoint import latest_checkpoint, save_model_dir
from posttrain.models.load import ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ADAPTER = "adapter_config.json"
_CARRIED_FILES = ("reward_stats.json",)  # files of ours a model directory keeps beside its weights


def export_model(source: str | Path, destination: str | Path, *, dtype: str | None = None) -> Path:
    """Write the model `source` names (see the module docstring) to `destination`; returns it."""
    from transformers import AutoTokenizer

    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    source, destination = Path(source), Path(destination)
    check_destination(source, destination, "exported from")
    model_dir, adapter_dir = resolve_export_source(source)
    model = _load(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir or model_dir)
    save_model_dir(destination, model, tokenizer, merge_lora=True)
    for name in _CARRIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, destination / name)
    return destination


def check_destination(source: Path, destination: Path, verb: str) -> None:
    """Refuse a destination whose replacement would lose something: the source itself or a directory above it,
    a file, or a directory that holds anything but a model (`posttrain export runs/sft ~/models` must not
    delete every other model there). An empty directory, or a model directory (config.json: an earlier
    export), is replaced."""
    if destination.resolve() == source.resolve() or destination.resolve() in source.resolve().parents:
        raise ModelError(f"{destination}: the destination would replace what is {verb} ({source})")
    if destination.exists() and not destination.is_dir():
        raise ModelError(f"{destination}: a file is there; give a directory path for the model")
    if destination.is_dir() and any(destination.iterdir()) and not (destination / "config.json").is_file():
        raise ModelError(f"{destination}: a directory that is not empty and holds no model (no config.json); the "
                         "model would replace everything in it, so nothing was written: give a new directory "
                         f"path (e.g. {destination / 'model'})")


def resolve_export_source(source: Path) -> tuple[Path, Path | None]:
    """(model directory, LoRA adapter to merge into it or None) for what `source` names."""
    if not source.is_dir():
        raise ModelError(f"{source}: no such directory (expected a run directory or a model directory)")
    run_dir = source if (source / "final").is_dir() or (source / "checkpoints").is_dir() else None
    candidate = source / "final" if (source / "final").is_dir() else source
    if run_dir is not None and not (candidate / "config.json").is_file() and not (candidate / _ADAPTER).is_file():
        candidate = latest_checkpoint(run_dir) or candidate  # a run that has not finished: its newest checkpoint
    if (candidate / _ADAPTER).is_file():
        base = json.loads((candidate / _ADAPTER).read_text()).get("base_model_name_or_path") or ""
        if base and (Path(base) / "config.json").is_file():
            return Path(base), candidate
        checkpoint = latest_checkpoint(run_dir) if run_dir is not None else None
        if checkpoint is None:
            raise ModelError(f"{candidate}: a LoRA adapter whose base model {base!r} is not a local directory, and "
                             "no run checkpoint with merged weights beside it: pass the run directory, or "
                             "set base_model_name_or_path in its adapter_config.json to the base model")
        return checkpoint, None
    if not (candidate / "config.json").is_file():
        raise ModelError(f"{candidate}: not a model directory (no config.json) and not a posttrain run directory")
    return candidate, None


def _load(directory: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(directory)
    architectures = list(getattr(config, "architectures", None) or [])
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return AutoModelForSequenceClassification.from_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory)
