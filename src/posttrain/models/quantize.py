"""`posttrain quantize CHECKPOINT --to int8|int4`: weight-only quantization of a causal LM through torchao.

What each target does (torchao's configs, applied by transformers' `TorchAoConfig` while the model loads):

- ``int8``: `Int8WeightOnlyConfig` — every linear layer's weight as int8 with one float scale per output row
  (symmetric, w ≈ scale[row] * q, q in [-127, 127]); activations stay in float, the weight is dequantized
  inside the matmul. A quarter of fp32's weight bytes.
- ``int4``: `IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))` — int4 values
  (q in [-8, 7]) with one scale per `group_size` consecutive input columns. torchao's packed int4 layouts
  (`Int4WeightOnlyConfig`) need its GPU kernel package (``mslk``) and fail on a CPU, so on this hardware the
  int4 values are stored one per byte (``unpacked_to_int8``): int4's rounding error, int8's storage size.

Embeddings and norms stay in float (weight-only quantization covers `nn.Linear`; the LM head is a linear layer
and is quantized too).

The result is an ordinary `save_pretrained` directory: ``model.safetensors`` holds torchao's tensors flattened
by transformers (the quantized values and their scales), ``config.json`` carries the ``quantization_config``
(``quant_method: torchao``) that tells `AutoModelForCausalLM.from_pretrained` to rebuild them. Loading it needs
`torchao` installed (the ``quantize`` extra) — with it, plain transformers loads it, and so do `load_model`,
`posttrain serve` and `posttrain eval`. ``quantization.json`` beside it records the target, the library and
its version and the source directory. A quantized model is for inference: it is not trained further.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from posttrain.models.checkpoint import save_model_dir
from posttrain.models.export import check_destination, export_model, resolve_export_source
from posttrain.models.load import QUANTIZE_HINT, ModelError

TARGETS = ("int8", "int4")
RECORD_FILE = "quantization.json"


def quantize_checkpoint(source: str | Path, destination: str | Path, *, to: str, group_size: int = 32) -> Path:
    """Write `source` (a model directory, a run directory or a LoRA adapter, as `export_model` resolves it)
    quantized to `to` at `destination`, atomically, with its tokenizer; returns `destination`."""
    if to not in TARGETS:
        raise ModelError(f"--to: expected one of {', '.join(TARGETS)}, got {to!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    if group_size < 1:
        raise ModelError(f"--group-size: must be >= 1, got {group_size}")
    source, destination = Path(source), Path(destination)
    check_destination(source, destination, "quantized")
    scheme = torchao_config(to, group_size)
    model_dir, adapter_dir = resolve_export_source(source)
    _check_quantizable(model_dir, to, group_size)
    scratch_parent = destination.parent if destination.parent.is_dir() else None  # a merge beside the result
    with tempfile.TemporaryDirectory(prefix=".quantize-", dir=scratch_parent) as scratch:
        if adapter_dir is not None:  # merge the adapter first: torchao quantizes the merged weights
            model_dir = export_model(source, Path(scratch) / "merged")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, quantization_config=TorchAoConfig(scheme))
        except RuntimeError as error:
            raise ModelError(f"{model_dir}: torchao could not quantize it to {to} on this machine "
                             f"({_first_line(error)})") from None
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        save_model_dir(destination, model, tokenizer, merge_lora=False)
    _write_record(destination, {"target": to, "group_size": group_size if to == "int4" else None,
                                "library": "torchao", "library_version": _torchao_version(),
                                "config": type(scheme).__name__, "source": str(source)})
    return destination


def torchao_config(to: str, group_size: int = 32) -> Any:
    """The torchao config for a target (see the module docstring); a `ModelError` when torchao is missing."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        raise ModelError(f"quantization needs torchao: {QUANTIZE_HINT}") from None
    if to == "int8":
        return Int8WeightOnlyConfig()
    if to == "int4":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    raise ModelError(f"--to: expected one of {', '.join(TARGETS)}, got {to!r}")


def quantization_of(directory: str | Path) -> dict[str, Any] | None:
    """What a model directory is quantized to: ``quantization.json`` (ours) or the config's
    ``quantization_config`` (any quantizer); None for a float model or a directory without a config."""
    directory = Path(directory)
    if (directory / RECORD_FILE).is_file():
        return json.loads((directory / RECORD_FILE).read_text())
    config = directory / "config.json"
    if not config.is_file():
        return None
    quantization = json.loads(config.read_text()).get("quantization_config")
    return {"target": None, "library": quantization.get("quant_method")} if quantization else None


def _check_quantizable(model_dir: Path, to: str, group_size: int) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ModelError(f"{model_dir}: already quantized ({method}); quantize the float checkpoint it came from")
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForCausalLM") for name in architectures):
        raise ModelError(f"{model_dir}: quantize takes a causal LM, this one is {architectures or 'unnamed'} "
                         "(config.json architectures)")
    if to == "int4":
        _check_group_fits(config, group_size)


def _check_group_fits(config: dict[str, Any], group_size: int) -> None:
    # The input widths of a decoder's linear layers: hidden (q/k/v, gate/up, the head), heads x head_dim
    # (the attention output), intermediate (the MLP's down projection).
    heads, head_dim = config.get("num_attention_heads"), config.get("head_dim")
    widths = {config.get("hidden_size"), config.get("intermediate_size"),
              heads * head_dim if heads and head_dim else None} - {None}
    misfit = sorted(w for w in widths if w % group_size)
    if misfit:
        raise ModelError(f"--group-size {group_size}: does not divide the input width of every linear layer "
                         f"({misfit}); choose a divisor such as 32")


def _write_record(directory: Path, record: dict[str, Any]) -> None:
    temporary = directory / f".{RECORD_FILE}.tmp-{os.getpid()}"
    temporary.write_text(json.dumps(record, indent=1))
    os.replace(temporary, directory / RECORD_FILE)


def _torchao_version() -> str:
    from importlib.metadata import version

    return version("torchao")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__

