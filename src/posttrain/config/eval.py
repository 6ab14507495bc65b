"""The eval recipe: checkpoints x suites -> metrics, contamination check, bad cases, results JSON + HTML report.

    posttrain eval recipe.yaml checkpoints.0.path=runs/rl/final

Suites: a generated domain's held-out split (``suites.generated``; a fresh draw with new seeds beside it when
``fresh_draw.enabled``), a user JSONL / Parquet / saved Hugging Face dataset judged by a verifier through the
tasks room's ``dataset`` adapter (``suites.datasets``), and regression suites: a fixed JSONL of tasks
(``Task.to_dict()`` lines) with an optional pass-rate floor (``suites.regression``).

Tiers (``tiers.models``): checkpoints with the engine settings they are served with (standard, distilled,
speculative, quantized), each evaluated like a checkpoint and timed on the same prompts; the report's tier table
puts held-out accuracy against tokens/s and p50 latency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.common import Section, SpeculativeConfig
from posttrain.config.load import recipe
from posttrain.config.sft import DataSource


class EvalCheckpoint(Section):
    """A local Hugging Face model directory; `label` names its column in the report (default: the run's name)."""

    path: str
    label: str | None = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        path = Path(self.path)
        return path.parent.name if path.name == "final" and path.parent.name else path.name or str(path)


class GeneratedSuite(Section):
    """`n` held-out tasks of a generated domain at `levels` (drawn with `seed`)."""

    domain: str
    args: dict[str, Any] = {}
    levels: list[int] = [1]
    n: int = Field(100, gt=0)
    seed: int = 0
    name: str | None = None  # default: the domain's name
    heldout_fraction: float = Field(0.1, gt=0, lt=1)


class DatasetSuite(Section):
    """Every problem of a dataset file, judged by `args.verifier` (default ``math``); see the ``dataset`` domain."""

    name: str
    path: str
    args: dict[str, Any] = {}  # question_field, answer_field, answer_format, verifier, instruction, ...
    split: Literal["all", "heldout", "train"] = "all"
    limit: int | None = Field(None, gt=0)


class RegressionSuite(Section):
    """A regression suite, for the eval recipe (``suites.regression``) and the RL forgetting guard
    (``schedule.guard.suites``) alike: either a fixed set of tasks (`path`: JSONL of ``Task.to_dict()``) or
    held-out items drawn from a domain the run need not train on (`domain`, `args`, `levels`). With both, the
    items are the file's and the domain (`args`, `levels`) is only what the RL guard replays demonstrations of
    when the suite regresses (the demo's guard items: drawn apart from its test and validation sets).

    The eval recipe flags a pass rate below `min_pass_rate`; the guard watches the suite against its own best."""

    name: str
    path: str | None = None
    # a registered domain (posttrain.tasks): `count` of its held-out items; with `path`, only the replay's domain
    domain: str | None = None
    args: dict[str, Any] = {}  # keyword arguments of the domain's generator
    levels: list[int] = [1]  # levels drawn (and replayed by the RL guard); with `path`, replayed only
    count: int | None = Field(None, gt=0)  # a domain: items drawn (default 50); a path: the first `count` (all)
    min_pass_rate: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _one_source(self):
        if self.path is None and self.domain is None:
            raise ValueError(f"regression suite '{self.name}': set path (a JSONL of tasks) or domain (held-out "
                             "items drawn from it), or both (the file's items, the domain's demonstrations replayed)")
        return self

    @property
    def items(self) -> int | None:
        """How many tasks: `count`, or for a drawn domain 50 by default (None: every task of the file)."""
        return self.count if self.count is not None or self.path is not None else 50


class EvalSuites(Section):
    generated: list[GeneratedSuite] = []
    datasets: list[DatasetSuite] = []
    regression: list[RegressionSuite] = []


class EvalSampling(Section):
    """pass@1 from one greedy episode per item (`greedy`); pass@k from `n` sampled episodes per item."""

    max_new_tokens: int = Field(128, gt=0)
    greedy: bool = True
    n: int = Field(0, ge=0)  # sampled episodes per item (0: none)
    k: list[int] = [1]
    temperature: float = Field(0.8, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = 0

    @model_validator(mode="after")
    def _k_fits_n(self):
        if not self.greedy and self.n == 0:
            raise ValueError("sampling: nothing to run: set greedy: true or n > 0")
        too_big = [k for k in self.k if k < 1 or (self.n and k > self.n)]
        if self.n and too_big:
            raise ValueError(f"sampling.k: every k must be in 1..n (n = {self.n}), got {too_big}")
        return self


class EvalContamination(Section):
    """Training data to check the eval items against (token n-grams plus exact normalized prompts)."""

    sft: list[DataSource] = []  # chat samples (SFT JSONL)
    preferences: list[DataSource] = []  # preference pairs (prompt, chosen, rejected)
    rl_episodes: list[str] = []  # an RL run's episodes.jsonl (or its run directory): the task prompts it trained on
    ngram: int = Field(13, gt=0)
    exclude: bool = False  # drop contaminated items from the suites before running them


class EvalFreshDraw(Section):
    """Beside each generated held-out suite, as many new held-out items drawn with a new seed."""

    enabled: bool = True
    seed: int | None = None  # None: a new seed every run (recorded in the results)


class EvalRuntime(Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    batch_size: int = Field(128, gt=0)  # sequences per engine call
    max_concurrency: int | None = Field(None, gt=0)  # episodes in flight (default: batch_size)
    num_threads: int | None = Field(None, gt=0)  # torch threads for the engine (default on CPU: all but one)
    infra_retries: int = Field(1, ge=0)
    # Episode wall time counts generation: on a loaded CPU a batch can outlast a task's timeout_s. A scale > 1
    # keeps queueing from being reported as the model's timeout.
    timeout_scale: float = Field(1.0, gt=0)
    speculative: SpeculativeConfig = SpeculativeConfig()  # speculative decoding in the engine (docs/tiers.md)
    # A directory for the episode cache: an item's episodes already sampled for an unchanged checkpoint (same
    # files, device, precision, engine) under the same sampling are reused, not sampled again
    # (posttrain.evaluate.cache; a changed verifier of your own under the same name means clearing it). Unset: off.
    episode_cache: str | None = None


class EvalTrainingRun(Section):
    """A run directory (or its metrics.jsonl) whose training curves the report plots."""

    path: str
    label: str | None = None


class TierEngine(Section):
    """How a tier's engine runs, for its eval episodes and its speed measurement alike.

    `speculative` decodes the tier speculatively (a draft model directory or ``ngram``; unset: the runtime's
    setting). `options` are further `HFEngine` keyword arguments (``kv_cache_dtype``, ...): the hook through
    which an engine feature becomes a tier without a schema change here. A key the engine does not take is an
    error naming it."""

    runner: Literal["auto", "fast", "generic"] = "auto"
    speculative: SpeculativeConfig | None = None
    options: dict[str, Any] = {}


class EvalTier(Section):
    """One row of the tier table: a checkpoint (`path`) and the engine settings it is served with."""

    label: str
    path: str
    kind: Literal["standard", "distilled", "speculative", "quantized"] = "standard"
    engine: TierEngine = TierEngine()


class EvalTiers(Section):
    """The tier table: each tier runs every suite (its accuracy: held-out pass@1) and is timed on the same
    `prompts` held-out prompts, one request at a time, greedy, `max_new_tokens` each, `repeats` times after
    `warmup` untimed passes. Speed-up and accuracy change are against the first tier of kind ``standard``."""

    models: list[EvalTier] = []
    suite: str | None = None  # accuracy: pass@1 on this suite (default: the mean over held-out and dataset suites)
    prompts: int = Field(16, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    repeats: int = Field(3, gt=0)
    warmup: int = Field(1, ge=0)


class ReportTable(Section):
    """A table of figures a pipeline measured itself, which the evaluation does not compute (a training stage's
    sampled pass@k, where a run's step time went): shown as given in the report's "From the runs" section.
    Cells are text or numbers; the numbers of the `percent` columns (0-based) are fractions, shown as percentages."""

    title: str
    lead: str = ""
    head: list[str] = Field(min_length=1)
    rows: list[list[str | int | float | None]] = []
    percent: list[int] = []

    @model_validator(mode="after")
    def _rows_fit_head(self):
        for number, row in enumerate(self.rows):
            if len(row) != len(self.head):
                raise ValueError(f"report.tables '{self.title}': row {number} has {len(row)} cells, the head "
                                 f"{len(self.head)} ({', '.join(self.head)})")
        wrong = [column for column in self.percent if not 0 <= column < len(self.head)]
        if wrong:
            raise ValueError(f"report.tables '{self.title}': percent columns {wrong} are not columns of the head "
                             f"(0..{len(self.head) - 1})")
        return self


class EvalReport(Section):
    title: str = "posttrain evaluation"
    training_runs: list[EvalTrainingRun] = []
    tables: list[ReportTable] = []  # figures the runs measured themselves, shown as given
    # The checkpoint the headline cards describe, and the one they compare it with (labels; default: the last
    # checkpoint, and the one before the headline one). A pipeline that evaluates a control after its product
    # names the product here.
    headline: str | None = None
    headline_against: str | None = None
    transcripts_per_class: int = Field(3, ge=0)


@recipe("eval")
class EvalRecipe(Section):
    stage: Literal["eval"] = "eval"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/eval"
    checkpoints: list[EvalCheckpoint] = []
    suites: EvalSuites = EvalSuites()
    sampling: EvalSampling = EvalSampling()
    contamination: EvalContamination = EvalContamination()
    fresh_draw: EvalFreshDraw = EvalFreshDraw()
    runtime: EvalRuntime = EvalRuntime()
    report: EvalReport = EvalReport()
    tiers: EvalTiers = EvalTiers()

    @field_validator("checkpoints", mode="before")
    @classmethod
    def _paths_as_checkpoints(cls, value: Any) -> Any:
        """`checkpoints: [runs/sft/final]` is shorthand for `[{path: runs/sft/final}]`."""
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _names_unique(self):
        if not self.checkpoints and not self.tiers.models:
            raise ValueError("checkpoints: give at least one checkpoint (or a tier in tiers.models)")
        names = [c.name for c in self.checkpoints] + [t.label for t in self.tiers.models]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoints and tiers.models: labels must differ, got {names} (set `label` on each)")
        suites = ([s.name or s.domain for s in self.suites.generated] + [s.name for s in self.suites.datasets]
                  + [s.name for s in self.suites.regression])
        if len(set(suites)) != len(suites):
            raise ValueError(f"suites: names must differ, got {suites} (set `name` on generated suites)")
        if self.tiers.suite is not None and self.tiers.suite not in suites:
            raise ValueError(f"tiers.suite: no suite named {self.tiers.suite!r} (suites: {suites})")
        for key in ("headline", "headline_against"):
            label = getattr(self.report, key)
            if label is not None and label not in names:
                raise ValueError(f"report.{key}: '{label}' is not a checkpoint label (labels: {', '.join(names)})")
        return self
