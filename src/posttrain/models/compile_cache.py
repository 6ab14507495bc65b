"""Where torch.compile keeps what it compiled, so a model shape is compiled in full once per machine, and the rule
behind ``runtime.compile: auto``.

torch's inductor caches its compiled graphs (the FX graph cache) and their autograd halves (the AOT autograd
cache) on disk, both on by default, but under ``/tmp/torchinductor_<user>``: gone at every reboot, and on a
container's fresh ``/tmp`` at every start. `use_compile_cache` points them at a directory that persists:

    $TORCHINDUCTOR_CACHE_DIR when the user set it, else
    $POSTTRAIN_CACHE_DIR/compile/inductor, else $XDG_CACHE_HOME/posttrain/compile/inductor,
    else ~/.cache/posttrain/compile/inductor

(torch writes its own ``/tmp`` default into ``TORCHINDUCTOR_CACHE_DIR`` as soon as ``torch._inductor`` is imported,
which transformers' imports do: a value equal to that default is torch's, not the user's, and is replaced).
Nothing in the cache is trusted beyond what torch itself trusts: its entries are keyed by a hash of the graph,
the torch version and the compiler settings.

Measured on a 2-core AMD EPYC (AVX2, fp32), tiny-3m, RL steps of 8 x 8 completions (the trainer's decoder stack
and the engine's decode step compiled), 1 thread, load ~4: a cold compile costs ~106 s of CPU (of which 28 s in
the C++ compiler), the same in a second process from the warm cache ~27 s (the graphs re-traced, their code
loaded); a steady step then takes 1.07 CPU-s against 1.17 eager (docs/benchmarks.md).

The cache cannot be asked whether it holds a model shape without tracing it, so a run that compiled leaves a
small record beside the cache (`CompileMeter`: ``<inductor dir>/posttrain-shapes/<key>.json``, the key a hash of
the model's architecture, precision, device and the torch and transformers versions: `compile_shape_key`), with
what this machine measured: the compile's cost cold and warm, and a steady step's CPU time compiled and eager (an
eager run records its step too). `compile_pays` decides ``compile: auto`` from it: a shape compiled here before is
warm, and compiles when the run is long enough for the measured saving per step to win the warm compile back.

A steady step is recorded per token it ran (sampled plus trained): the eager figure and the compiled one come
from different runs, and a run whose completions are a tenth as long takes a tenth of the CPU a step (an eager
bench run of 3-token answers once recorded 0.20 CPU-s a step against 1.20 compiled from 32-token ones, and
``auto`` then judged compiling ~6x slower). Each figure is the median of the last `RUNS_KEPT` runs' (one run's
median over 7 steps swung the saving 2-5x); the saving per step is the two rates' difference times the tokens a
step of the latest runs ran.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The architecture fields a compiled graph specializes on (shapes, activation, rotary layout, attention kernel).
_SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "hidden_act", "tie_word_embeddings",
                 "rope_scaling", "rope_parameters", "_attn_implementation", "dtype")


def compile_cache_dir() -> Path:
    """posttrain's compile cache directory (not created); inductor's own cache is its ``inductor`` folder."""
    root = os.environ.get("POSTTRAIN_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "compile"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "posttrain" / "compile"


def _users_inductor_dir() -> Path | None:
    """A ``TORCHINDUCTOR_CACHE_DIR`` that is not torch's own ``/tmp`` default (which torch sets on import)."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.path.abspath(value) == os.path.abspath(default_cache_dir()):
        return None
    return Path(value)


def use_compile_cache() -> Path | None:
    """Point torch's compile caches at a directory that persists (before the process compiles); returns the
    inductor cache directory in use, or None when it cannot be created (torch's default stays)."""
    users = _users_inductor_dir()
    if users is not None:  # the user's choice, or one this process already made
        return users
    directory = compile_cache_dir()
    try:
        (directory / "inductor").mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory / "triton"))
    return directory / "inductor"


def prepare_compile() -> Path | None:
    """What every compile of posttrain's does first: `use_compile_cache`, and shapes that stay apart.

    torch's "duck sizing" gives dimensions of equal size one symbol when it first traces a graph, and guards on
    their equality: the engine's decode step compiled with 64 rows and a head size of 64 was recompiled (~31
    CPU-s cold) when a batch first had fewer rows. With it off, one graph serves every row count."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    return use_compile_cache()


def compile_shape_key(model_config: Any, precision: str, device_type: str, **details: Any) -> str:
    """A hash of what a compiled model's graphs depend on: its architecture (`model_config`, a transformers
    config), the precision, the device and the library versions; `details` adds the recipe's switches that change
    the graph (LoRA, activation checkpointing)."""
    import torch
    import transformers

    fields = {name: getattr(model_config, name, None) for name in _SHAPE_FIELDS}
    fields.update(precision=precision, device=device_type, torch=torch.__version__,
                  transformers=transformers.__version__, **details)
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _record_path(key: str) -> Path:
    inductor = _users_inductor_dir() or compile_cache_dir() / "inductor"
    return inductor / "posttrain-shapes" / f"{key}.json"


RUNS_KEPT = 5  # runs whose step figures a record keeps (each figure used is their median)


@dataclass(frozen=True)
class CompileRecord:
    """What this machine measured for a model shape (CPU seconds of the process, the C++ compiler's included):
    the compile from an empty cache, the latest one that found it warm, and, for the latest `RUNS_KEPT` runs of
    each kind, a steady step's CPU seconds per thousand tokens compiled and eager, and the thousands of tokens a
    steady step ran (sampled plus trained)."""

    cold_cpu_s: float | None = None  # None: never compiled here (the cache is cold for this shape)
    warm_cpu_s: float | None = None
    compiled_s_per_ktoken: tuple[float, ...] = ()
    eager_s_per_ktoken: tuple[float, ...] = ()
    ktokens_per_step: tuple[float, ...] = ()

    @property
    def warm(self) -> bool:
        return self.cold_cpu_s is not None

    def saving_per_step(self) -> tuple[float, str] | None:
        """CPU seconds a compiled step saves over an eager one (negative: it costs), and the figures it came from;
        None until this machine has measured both."""
        if not (self.compiled_s_per_ktoken and self.eager_s_per_ktoken and self.ktokens_per_step):
            return None
        eager, compiled = statistics.median(self.eager_s_per_ktoken), statistics.median(self.compiled_s_per_ktoken)
        ktokens = statistics.median(self.ktokens_per_step)
        figures = (f"{eager:.3f} CPU-s per 1k tokens eager / {compiled:.3f} compiled (medians of "
                   f"{len(self.eager_s_per_ktoken)} / {len(self.compiled_s_per_ktoken)} runs), "
                   f"~{ktokens:.1f}k tokens a step")
        return (eager - compiled) * ktokens, figures

    def with_step(self, compiled: bool, s_per_ktoken: float, ktokens: float) -> CompileRecord:
        """This record with one more run's steady step."""
        def kept(figures: tuple[float, ...], value: float) -> tuple[float, ...]:
            return (*figures, round(value, 6))[-RUNS_KEPT:]

        rate = "compiled_s_per_ktoken" if compiled else "eager_s_per_ktoken"
        return replace(self, **{rate: kept(getattr(self, rate), s_per_ktoken),
                                "ktokens_per_step": kept(self.ktokens_per_step, ktokens)})


def read_compile_record(key: str) -> CompileRecord | None:
    """The record of `key`, or None when this machine has no figures for that shape (or its cache was wiped). A
    record written before steps were counted per token keeps its compile costs and drops its step figures."""
    try:
        data = json.loads(_record_path(key).read_text())
        fields = {}
        for name, spec in CompileRecord.__dataclass_fields__.items():
            value = data.get(name)
            if isinstance(spec.default, tuple):  # a figure per run
                fields[name] = tuple(float(v) for v in value) if isinstance(value, list) else ()
            else:
                fields[name] = float(value) if value is not None else None
        return CompileRecord(**fields)
    except (OSError, ValueError, TypeError):
        return None


def _write_record(key: str, record: CompileRecord) -> None:
    """Atomically; a failure to write only costs the next run the default estimate."""
    path = _record_path(key)
    data = dict(record.__dict__, updated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data))
        partial.replace(path)
    except OSError as error:
        log.warning("could not record the compile figures of shape %s (%s)", key, error)


_COMPILED_IN_PROCESS: set[str] = set()  # the shapes this process has compiled (and recorded)


class CompileMeter:
    """Measures a run's compiles and its steady step, and records them for its shape (`read_compile_record`).

    The compile cost is the CPU time spent inside torch's compiles (the process's, every thread, and the C++
    compiler's child processes), timed by dynamo's compile callbacks, which fire around each compile, the lazily
    compiled backward included, wherever it happens: the self-test, a batch sampled ahead, the first update.
    The steady step is the median over steps 2 to `window` of each step's CPU time per thousand tokens, with the
    median tokens a step ran. Recorded after `window` steps, and again at `close` when a later compile added to
    the cost (the steps are recorded once a run).
    """

    def __init__(self, key: str | None, compiled: bool, window: int = 8):
        self.key, self.compiled, self.window = key, compiled, window
        self.was_warm = bool(key and (read_compile_record(key) or CompileRecord()).warm)
        # A second compiled run in one process reuses what torch compiled in memory (~0 CPU-s): not what a new
        # process pays, so only the first run of a shape in a process records its compile cost.
        self.first_in_process = key not in _COMPILED_IN_PROCESS
        self.steps: list[tuple[float, float]] = []  # (CPU seconds, tokens) per step
        self.compile_cpu_s = 0.0
        self._recorded_cpu_s: float | None = None
        self._started: float | None = None
        self._handler = None
        if key and compiled:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._compile_started)
            callback_handler.register_end_callback(self._compile_ended)
            self._handler = callback_handler

    def _compile_started(self, _args: Any) -> None:
        self._started = time.process_time() + _children_cpu_s()

    def _compile_ended(self, _args: Any) -> None:
        if self._started is not None:
            self.compile_cpu_s += time.process_time() + _children_cpu_s() - self._started
            self._started = None

    def observe(self, step_cpu_s: float, tokens: float) -> None:
        """One step's CPU time (the process's) and the tokens it ran (sampled plus trained)."""
        self.steps.append((step_cpu_s, tokens))
        if len(self.steps) == self.window:
            self._record()

    def close(self) -> None:
        """At the run's end: record what the steps seen say (if not yet, or if compiling cost more since)."""
        if self._handler is not None:
            self._handler.remove_start_callback(self._compile_started)
            self._handler.remove_end_callback(self._compile_ended)
            self._handler = None
        if self._recorded_cpu_s is None or self.compile_cpu_s > self._recorded_cpu_s:
            self._record()

    def _record(self) -> None:
        steady = [(cpu_s, tokens) for cpu_s, tokens in self.steps[1 : self.window] if tokens > 0]
        if self.key is None or len(steady) < 2:  # fewer steps say nothing steady
            return
        rate = statistics.median(1000 * cpu_s / tokens for cpu_s, tokens in steady)
        ktokens = statistics.median(tokens for _, tokens in steady) / 1000
        before = read_compile_record(self.key) or CompileRecord()
        stepped = before if self._recorded_cpu_s is not None else before.with_step(self.compiled, rate, ktokens)
        self._recorded_cpu_s = self.compile_cpu_s
        if not self.compiled or not self.first_in_process:
            record = stepped
        elif self.was_warm and before.warm:
            record = replace(stepped, warm_cpu_s=self.compile_cpu_s)
        else:
            record = replace(stepped, cold_cpu_s=self.compile_cpu_s)
        if self.compiled:
            _COMPILED_IN_PROCESS.add(self.key)
        _write_record(self.key, record)
        if self.compiled:
            log.info("runtime.compile: compiling took %.0f CPU-s (%s cache); a steady step %.3f CPU-s per 1k "
                     "tokens", self.compile_cpu_s, "warm" if self.was_warm else "cold", rate)


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


# Measured defaults (docs/benchmarks.md), used until this machine has its own figures for a shape. The run length
# from which a cold compile pays back: bf16 (AVX512-BF16 machine, tiny-3m RL step 0.265 -> 0.165 s wall, ~60 s of
# compiling) 500 steps; fp32 (2-core AVX2 machine, 1.17 -> 1.07 CPU-s a step, ~106 CPU-s cold) 1,000. A warm
# compile's CPU seconds there: ~27.
COLD_MIN_STEPS = {"bf16": 500, "fp32": 1000}
WARM_COMPILE_CPU_S = 30.0


def compile_pays(max_steps: int | None, min_steps: int | None, device_type: str, *, precision: str = "fp32",
                 record: CompileRecord | None = None) -> tuple[bool, str]:
    """Whether ``runtime.compile: auto`` compiles a run of `max_steps` steps, and why (for the log).

    Cold (this machine has not compiled the shape), the run must have `min_steps` steps (None: the measured
    default for `precision`, `COLD_MIN_STEPS`). Warm, it must have enough steps for the saving per step to win
    back a warm compile: this machine's own figures from `record` (the warm compile's CPU-s over
    `CompileRecord.saving_per_step`) once it has them; until then `min_steps` scaled by the warm compile's share
    of the cold one.
    """
    if min_steps is None:
        min_steps = COLD_MIN_STEPS.get(precision, COLD_MIN_STEPS["fp32"])
    if device_type == "cpu" and not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        return False, "no C++ compiler on the PATH (inductor needs one on CPU)"
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed (inductor needs it on CUDA)"
    if max_steps is None:
        return False, "the run has no step count (train.max_steps) to win a compile back over"
    record = record or CompileRecord()
    if not record.warm:
        if max_steps < min_steps:
            return False, (f"no warm compile cache for this model shape, and {max_steps} steps is under "
                           f"runtime.compile_min_steps ({min_steps}): a cold compile would not pay back")
        return True, f"{max_steps} steps >= runtime.compile_min_steps ({min_steps}): a cold compile pays back"
    cost = record.warm_cpu_s if record.warm_cpu_s is not None else min(WARM_COMPILE_CPU_S, record.cold_cpu_s)
    warm = f"warm {cost:.0f}" if record.warm_cpu_s is not None else f"warm ~{cost:.0f} (not measured yet)"
    figures = f"this machine: cold compile {record.cold_cpu_s:.0f} CPU-s, {warm}"
    measured = record.saving_per_step()
    if measured is not None:
        saving, steps = measured
        figures += f", {steps}"
        if saving <= 0:
            return False, f"the compiled step is no faster than the eager one here ({figures})"
        needed = max(1, math.ceil(cost / saving - 1e-9))
    else:
        needed = max(1, math.ceil(min_steps * cost / max(record.cold_cpu_s, cost, 1e-9)))
    if max_steps < needed:
        return False, f"warm cache, but {max_steps} steps is under the {needed} a warm compile needs ({figures})"
    return True, f"warm compile cache for this model shape and {max_steps} steps >= {needed} ({figures})"
