"""The SFT recipe: chat data with metadata -> mixed, deduplicated, tokenized, packed -> fine-tuned model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.common import (
    ClusterConfig,
    ModelConfig,
    OptimConfig,
    RuntimeConfig,
    Section,
    TrackingConfig,
)
from posttrain.config.load import recipe


class DataSource(Section):
    """One data source: a local file or directory (`path`) or a dataset by name (`hf`).

    `path`: JSONL, Parquet, CSV or a directory written by datasets' `save_to_disk` (told apart by the name,
    or set `format`). A path starting with ``posttrain:`` is inside the installed package (the packaged
    recipes' samples). `hf`: anything `datasets.load_dataset` takes as its first argument (a hub id such as
    ``org/name``, a local dataset directory or loading script), with `subset` (its config name) and `split`.

    `record_format` says how a record reads (`auto`: detected per source, see docs/data.md); `columns` maps
    the fields posttrain reads to the columns holding them (``{messages: dialog}``) and `metadata` maps
    metadata keys to columns (``{domain: category, difficulty: level}``).
    """

    path: str | None = None
    hf: str | None = None
    subset: str | None = None  # the dataset's config name (`load_dataset(hf, subset)`)
    format: Literal["auto", "jsonl", "parquet", "csv", "hf_disk"] = "auto"
    split: str | None = None  # for a saved DatasetDict or a hub dataset (default there: train)
    source: str | None = None  # metadata.source for records that lack one (default: the file name)
    record_format: Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca"] = "auto"
    columns: dict[str, str] = {}
    metadata: dict[str, str] = {}

    @model_validator(mode="after")
    def _path_or_hf(self):
        if (self.path is None) == (self.hf is None):
            raise ValueError("a data source names exactly one of path (a file or directory) or hf (a dataset)")
        if self.hf is not None and self.format != "auto":
            raise ValueError("format applies to path sources; an hf dataset is read by datasets.load_dataset")
        return self

    @property
    def name(self) -> str:
        """How errors and reports name the source: the path, or ``hf:org/name[/subset]:split``."""
        if self.path is not None:
            return self.path
        subset = f"/{self.subset}" if self.subset else ""
        return f"hf:{self.hf}{subset}:{self.split or 'train'}"


class MixConfig(Section):
    """Target shares over metadata groups.

    `by: [domain]` with `weights: {arithmetic: 3, extraction: 1}` gives arithmetic 75% of each epoch.
    With several keys a group is named by its values joined with '/', e.g. `arithmetic/3`.
    Groups not named get `default_weight` (0 drops them). A group smaller than its share is repeated.
    """

    by: list[str] = []
    weights: dict[str, float] = {}
    default_weight: float = Field(1.0, ge=0)
    samples_per_epoch: int | None = None  # unset: the number of samples after dedup


class DedupConfig(Section):
    exact: bool = True
    near: bool = False  # MinHash near-duplicates
    threshold: float = Field(0.85, gt=0, le=1)  # estimated Jaccard similarity
    num_perm: int = 64
    shingle: int = 5  # characters per shingle


class DecontaminationConfig(Section):
    """Drop training samples that overlap evaluation items (n-gram on tokens, plus exact match)."""

    against: list[DataSource] = []  # eval sets (JSONL of chat samples or tasks)
    ngram: int = Field(13, gt=0)


class StreamConfig(Section):
    """Bounds of the streaming pipeline (`data.streaming: true`; docs/data.md, posttrain.data.stream)."""

    chunk_samples: int = Field(1024, gt=0)  # samples per tokenizer call
    mix_buffer: int = Field(4096, gt=0)  # samples held for the weighted mix
    pack_window: int = Field(2048, gt=0)  # samples packed together (best-fit decreasing)
    dedup_capacity: int = Field(10_000_000, gt=0)  # distinct samples the dedup filters are sized for
    dedup_error: float = Field(1e-4, gt=0, lt=1)  # their false-positive rate at that capacity
    heldout_max: int = Field(2000, gt=0)  # samples heldout_fraction keeps for the held-out loss
    tokenizer_texts: int = Field(200_000, gt=0)  # texts the built-in tokenizer is trained on


class SFTDataConfig(Section):
    train: list[DataSource] = []
    heldout: list[DataSource] = []
    heldout_fraction: float = Field(0.0, ge=0, lt=1)  # split by a hash of the prompt when no heldout is given
    mix: MixConfig = MixConfig()
    dedup: DedupConfig = DedupConfig()
    decontaminate: DecontaminationConfig = DecontaminationConfig()
    max_length: int = Field(512, gt=8)
    pack: bool = True
    on_invalid: Literal["error", "skip"] = "error"  # skip = count them and write a rejects file
    reasoning: Literal["include", "drop"] = "include"  # render metadata.reasoning_trace as <think>..</think>
    # Read, tokenize, mix and pack incrementally with bounded memory (a dataset larger than memory).
    streaming: bool = False
    stream: StreamConfig = StreamConfig()


class SFTTrainConfig(Section):
    batch_size: int = Field(32, gt=0)  # sequences (packed rows when packing) per optimizer step
    micro_batch_size: int | None = None  # gradient accumulation = batch_size / micro_batch_size
    max_steps: int | None = None
    epochs: float = Field(1.0, gt=0)
    max_minutes: float | None = None  # stop after this much training time (checked every step)
    log_every: int = Field(10, gt=0)
    eval_every: int | None = None  # held-out loss (and the run's evaluator, if any) every N steps
    # Stop once the held-out score (the evaluator's "score", else minus the held-out loss) has not improved
    # for this many evaluations in a row.
    early_stopping_patience: int | None = Field(None, gt=0)
    save_every: int | None = None  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = Field(2, gt=0)

    @model_validator(mode="after")
    def _micro_divides(self):
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size})"
            )
        return self


@recipe("sft")
class SFTRecipe(Section):
    stage: Literal["sft"] = "sft"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/sft"
    model: ModelConfig = ModelConfig()
    data: SFTDataConfig = SFTDataConfig()
    optim: OptimConfig = OptimConfig()
    train: SFTTrainConfig = SFTTrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()
    # backend ray: num_trainer_workers FSDP ranks as Ray actors (a torchrun launch needs no cluster section)
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _context_parallel_alone(self):
        """What context parallelism (cluster.context_parallel > 1) does not combine with, named up front."""
        if self.cluster.context_parallel == 1:
            return self
        unsupported = {
            "cluster.backend: ray (its ranks are started on this machine or by torchrun)":
                self.cluster.backend == "ray",
            "model.lora (LoRA adapters are not trained under context parallelism yet)": self.model.lora.enabled,
            "runtime.compile (the split attention and its collectives are not compiled)":
                self.runtime.compile is True,
            "cluster.data_parallel: fsdp (every context-parallel rank holds the whole model: replicate or auto)":
                self.cluster.data_parallel == "fsdp",
        }
        named = [what for what, on in unsupported.items() if on]
        if named:
            raise ValueError(f"cluster.context_parallel: {self.cluster.context_parallel} does not combine with "
                             f"{'; '.join(named)}: turn that off, or set cluster.context_parallel: 1")
        return self
