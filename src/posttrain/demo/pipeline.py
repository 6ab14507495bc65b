"""The demo pipeline: the whole system on the built-in tiny model, stage by stage, on a CPU in minutes.

    base   generate the demo domains' demonstrations and held-out tasks, train the tokenizer on that text,
           build the tiny model                                     -> runs/demo/base/, runs/demo/data/
    sft    supervised fine-tuning on the (deliberately limited) demonstrations, then held-out accuracy
    ...    later stages (dpo, rl, sft_control, report) register themselves in STAGES

Every stage writes its figures to runs/demo/summary.json as soon as it finishes:

    {"stages": {"sft": {"heldout": {"arithmetic": 0.97}, "seconds": 212.0, ...}}}

so a crash keeps what was done, and `posttrain demo --resume` skips the finished stages (the stage that was
running resumes from its last checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from posttrain.config import DataSource, DemoRecipe
from posttrain.tracking import console, say

SUMMARY = "summary.json"
REPORT_FILE = "report.html"  # the report stage's, beside the summary
RESULTS_FILE = "report.json"


@dataclass
class DemoRun:
    recipe: DemoRecipe
    root: Path
    summary: dict[str, Any] = field(default_factory=lambda: {"stages": {}})
    resume: bool = False  # a stage interrupted last time continues from its checkpoint

    @property
    def base_dir(self) -> Path:
        return self.root / "base"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def model_after(self, stage: str) -> Path:
        return self.root / stage / "final"

    def latest_policy(self, stages: tuple[str, ...] = ("rl", "dpo", "sft")) -> tuple[str, Path]:
        """The newest trained model among `stages` (in that order of preference) that has finished."""
        for stage in stages:
            if stage in self.summary["stages"] and self.model_after(stage).is_dir():
                return stage, self.model_after(stage)
        return "base", self.base_dir

    def record(self, stage: str, figures: dict[str, Any]) -> None:
        from posttrain.demo.evaluation import read_item_rates
        from posttrain.demo.summary import stage_comparisons

        self.summary["stages"][stage] = figures
        comparisons = stage_comparisons(read_item_rates(self.root, list(self.summary["stages"])))
        if comparisons:
            self.summary["comparisons"] = comparisons
        _write_json(self.root / SUMMARY, self.summary)


Stage = Callable[[DemoRun], dict[str, Any]]
STAGES: dict[str, Stage] = {}


def demo_stage(name: str):
    def register(function: Stage) -> Stage:
        STAGES[name] = function
        return function

    return register


def run_demo(recipe: DemoRecipe, *, resume: bool = False) -> dict[str, Any]:
    root = Path(recipe.output_dir)
    if not resume and root.exists():
        # The demo regenerates everything it writes; a fresh run must not resume a stale checkpoint.
        _require_demo_directory(root)
        say(f"[demo] starting fresh: clearing {root} (use --resume to continue it instead)")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    run = DemoRun(recipe, root, resume=resume)
    if resume and (root / SUMMARY).is_file():
        run.summary = json.loads((root / SUMMARY).read_text())
    for name in ["base", *recipe.stages]:
        if name not in STAGES:
            from posttrain.types import PosttrainError

            raise PosttrainError(f"demo: unknown stage '{name}' (known: {', '.join(STAGES)})")
        if resume and name in run.summary["stages"]:
            say(f"[demo] {name}: done before, skipped")
            continue
        console.rule(f"[bold]demo: {name}")
        started = time.perf_counter()
        figures = STAGES[name](run)
        figures.setdefault("seconds", round(time.perf_counter() - started, 1))
        run.record(name, figures)
    print_summary(run.summary)
    say(f"[demo] summary: {root / SUMMARY}")
    return run.summary


def print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    stages = {k: v for k, v in summary["stages"].items() if "heldout" in v}
    domains = sorted({d for figures in stages.values() for d in figures["heldout"]})
    table = Table(title="held-out accuracy by stage")
    table.add_column("stage")
    for domain in domains:
        table.add_column(domain, justify="right")
    table.add_column("mean", justify="right")
    table.add_column("seconds", justify="right")
    for stage, figures in stages.items():
        values = [figures["heldout"].get(d) for d in domains]
        present = [v for v in values if v is not None]
        mean = sum(present) / len(present) if present else 0.0
        table.add_row(stage, *[f"{v:.1%}" if v is not None else "-" for v in values], f"{mean:.1%}",
                      f"{figures.get('seconds', 0):.0f}")
    console.print(table)
    from posttrain.demo.summary import print_details

    print_details(summary)


def _require_demo_directory(root: Path) -> None:
    """A fresh demo clears its directory: refuse one that holds anything a demo does not write (`posttrain demo
    --output ~/work` must not delete the user's files), with nothing deleted."""
    from posttrain.demo.evaluation import EPISODE_CACHE
    from posttrain.types import PosttrainError

    if not root.is_dir():
        raise PosttrainError(f"demo: {root} is a file; give --output a directory path")
    ours = {"base", "data", EPISODE_CACHE, SUMMARY, f".{SUMMARY}.tmp", REPORT_FILE, RESULTS_FILE, *STAGES}
    foreign = sorted(entry.name for entry in root.iterdir() if entry.name not in ours)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise PosttrainError(f"demo: {root} holds files a demo does not write ({shown}); a fresh demo clears its "
                             "directory, so nothing was deleted: give --output a new path (or --resume a demo "
                             "run there)")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def source(path: Path) -> DataSource:
    return DataSource(path=str(path))
