"""Recipe sections shared by every stage: model, optimisation, tracking.

Every section is a strict pydantic model: an unknown key or a wrong type is an error that names the key
(see `posttrain.config.load`). Defaults are the embedded default: the tiny built-in model on a CPU.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TINY_PRESETS = ("tiny-1m", "tiny-3m", "tiny-10m", "tiny-30m")


class Section(BaseModel):
    """Base for recipe sections: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    enabled: bool = False
    r: int = Field(8, gt=0)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # The final checkpoint is the base with the adapter merged in (a plain HF directory); intermediate
    # checkpoints also keep `adapter/` so a resume continues the same adapter exactly.
    merge_on_save: bool = True


class RopeScalingConfig(Section):
    """Extend a model's context by rescaling its rotary position embedding (`posttrain.models.apply_rope_scaling`).

    The new maximum length is ``original_max_position_embeddings * factor`` and is saved in the checkpoint's
    config. "linear" divides every position by `factor`; "dynamic" (NTK-aware) raises the rotary base with the
    sequence length once it passes the original length; "yarn" interpolates the low frequencies only, with an
    attention temperature; "llama3" is Llama 3.1's wavelength-banded interpolation.
    """

    type: Literal["linear", "dynamic", "yarn", "llama3"]
    factor: float = Field(gt=1.0)
    original_max_position_embeddings: int | None = Field(None, gt=0)  # default: the model's current maximum
    # yarn: the correction range in rotations, and the attention temperature (default 0.1 ln(factor) + 1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    attention_factor: float | None = Field(None, gt=0)
    # llama3: wavelengths above original / low_freq_factor are interpolated, below original / high_freq_factor kept
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)


class ModelConfig(Section):
    path: str | None = None  # a local Hugging Face directory or a hub id (org/name); unset = the built-in tiny model
    preset: Literal["tiny-1m", "tiny-3m", "tiny-10m", "tiny-30m"] = "tiny-3m"
    tokenizer_path: str | None = None  # defaults to `path`, or the built-in tokenizer
    chat_template: str | None = None  # a Jinja template (or a file holding one) to use instead
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # how parameters are stored
    # "auto": posttrain's variable-length attention on CPU (packed samples cost only their own scores),
    # sdpa elsewhere; or any implementation transformers knows (eager, sdpa, flash_attention_2 ...).
    attn_implementation: str = "auto"
    lora: LoraConfig = LoraConfig()
    rope_scaling: RopeScalingConfig | None = None  # context extension (docs/long-context.md)
    seed: int = 0  # initialisation of the built-in model
    # A vision-language model and its processor (docs/multimodal.md): `path` loads as image-text-to-text (a local
    # `path` whose config has a `vision_config` is one anyway); unset `path`: the built-in tiny VLM on `preset`.
    # Read by the sft, dpo and rl recipes (their data then hold images); eval finds a VLM checkpoint by its config.
    vision: bool = False


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0


class RuntimeConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": bf16 autocast where the device runs it fast (CUDA with bf16, x86 CPUs with AVX512-BF16/AMX),
    # fp32 otherwise. Parameters and optimizer state stay in `model.dtype` either way.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    activation_checkpointing: bool = False
    # torch.compile the decoder stack (needs a C++ compiler on CPU): ~1.35x tokens/s on the tiny models in bf16,
    # ~9% less CPU per RL step in fp32 on an AVX2 CPU, after a compile that costs ~106 CPU-s there cold and ~27
    # warm (the compiled code is cached on disk once per machine and model shape, posttrain.models.compile_cache).
    # "auto" (RL's default) compiles when a compiler is there and the run is long enough to win the compile back:
    # with a warm cache, from this machine's own figures for the model's shape; cold, `compile_min_steps` steps
    # (unset: the measured default for the precision, 500 in bf16, 1,000 in fp32).
    compile: bool | Literal["auto"] = False
    compile_min_steps: int | None = Field(None, gt=0)
    num_threads: int | None = None  # torch intra-op threads; unset = torch's default
    seed: int = 0
    debug: bool = False


class SpeculativeConfig(Section):
    """Speculative decoding in the built-in engine (docs/tiers.md): the draft proposes `num_tokens` tokens per
    round, the model verifies them in one pass; outputs and logprobs stay the model's own."""

    # unset: off. "ngram": prompt lookup (drafts what followed the last n-gram earlier in the sequence); a tiny
    # preset (an untrained fresh model: tests only); or a model directory whose tokenizer equals the model's
    draft: str | None = None
    num_tokens: int = Field(4, gt=0)  # k: tokens drafted per round
    ngram: int = Field(3, gt=0)  # prompt lookup: the longest n-gram matched


class TrackingConfig(Section):
    tensorboard: bool = True
    wandb: bool = False
    mlflow: bool = False
    progress: bool = True  # a rich progress bar with tokens/s and ETA on a terminal
    project: str = "posttrain"
    run_name: str | None = None


class ActorResources(Section):
    """What one Ray actor of a kind reserves, and the torch threads it runs with."""

    num_cpus: float = Field(1.0, ge=0)  # fractions are allowed: actors that take turns can share a core
    num_gpus: float = Field(0.0, ge=0)
    threads: int = Field(1, gt=0)  # torch intra-op threads (two 2-thread processes on 2 cores run ~50x slower)


class ClusterConfig(Section):
    """Where a run executes. ``local`` (the default) is this process and needs no Ray; ``ray`` places rollout
    engines, sandbox workers and a data-parallel FSDP trainer group on a Ray cluster (docs/distributed.md)."""

    backend: Literal["local", "ray"] = "local"
    # unset: start a private Ray instance on this machine; "auto" or "host:port": join a running cluster
    address: str | None = None
    local_cpus: int | None = Field(None, gt=0)  # CPUs of the private instance (default: all of them)
    num_rollout_workers: int = Field(2, gt=0)  # engine actors, each with its own copy of the weights (RL)
    num_trainer_workers: int = Field(1, gt=0)  # data-parallel trainer ranks (`data_parallel`)
    # How the trainer ranks split the model (torchrun SFT reads it too). "fsdp": parameters, gradients and
    # optimizer state sharded with FSDP2, one unit per decoder layer (the least memory: for big models).
    # "replicate": every rank holds the whole model and optimizer, and one all-reduce per step sums the
    # gradients (the least traffic; no gather for the engines' weights). "auto": replicate under 1 GiB of
    # parameters, else fsdp
    data_parallel: Literal["auto", "fsdp", "replicate"] = "auto"
    # SFT only: ranks that split every packed row's tokens between them (context parallelism, zigzag layout:
    # docs/long-context.md), each holding the whole model. `posttrain sft` starts them on this machine (gloo on
    # CPU, NCCL on one GPU each); under torchrun the group must have exactly this many processes. 1: off
    context_parallel: int = Field(1, gt=0)
    num_sandbox_workers: int = Field(0, ge=0)  # 0: sandboxes run in each rollout worker's own pool
    sandbox_slots: int = Field(1, gt=0)  # concurrent jails per sandbox worker
    sandbox_backend: Literal["bubblewrap", "unsafe-local"] = "bubblewrap"
    rollout: ActorResources = ActorResources()
    trainer: ActorResources = ActorResources()
    sandbox: ActorResources = ActorResources(num_cpus=0.5)
    max_restarts: int = Field(3, ge=0)  # restarts of one rollout or sandbox worker before the run gives up
    placement_timeout_s: float = Field(60.0, gt=0)  # how long to wait for the cluster to fit the actors
    worker_imports: list[str] = []  # modules every worker imports first (your @domain / @verifier registrations)
