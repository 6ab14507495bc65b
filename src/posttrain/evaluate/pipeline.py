"""The eval recipe, top to bottom: recipe -> suites (+ fresh draws) -> contamination check -> for each checkpoint:
one engine, every episode of every suite -> metrics and bad cases -> results.json + report.html.

    posttrain eval recipe.yaml
    result = evaluate(load_recipe("recipe.yaml", schema=EvalRecipe)); print(result.report_path)

The results JSON is the whole record (the report is rendered from it alone, so it can be re-rendered):

    {"format": "posttrain-eval/1", "checkpoints": [{label, path, seconds, items_per_s, ...}],
     "suites": [{name, kind, group, items, levels, ...}],
     "metrics": {label: {suite: {"overall": {items, mean_reward, pass@1, pass@k...}, "levels": {"3": {...}},
                                 "process": {...}, "failures": {class: count}, "safety": {...}}}},
     "examples": {label: {suite: {class: [transcript, ...]}}},
     "images": {label: {suite: {pass@1, per_domain, items, samples: [case], bad_cases: [case]}}} (image suites),
     "fresh_gap": [...], "regressions": [...], "contamination": {...}, "hygiene": [...], "curves": [...],
     "tiers": null | {baseline, accuracy_suites, settings, rows: [{label, kind, accuracy, tokens_per_s,
                      p50_latency_ms, speedup, accuracy_delta, runner, ...}]},
     "tables": [{title, lead, head, rows, percent}] (`report.tables`: figures the runs measured themselves)}

Tiers (``tiers.models``) run after the checkpoints, each like a checkpoint (a row in ``checkpoints`` with its
``tier`` kind, its metrics beside theirs) and then timed; see `posttrain.evaluate.tiers`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from posttrain.config import EvalRecipe, EvalRuntime
from posttrain.evaluate.contamination import check_contamination, exclude_contaminated, training_samples
from posttrain.evaluate.curves import training_curves
from posttrain.evaluate.failures import failure_examples
from posttrain.evaluate.image_report import image_suite_json
from posttrain.evaluate.images import image_suite_scores
from posttrain.evaluate.metrics import ItemEpisodes, item_pass_rates, paired_difference, suite_metrics
from posttrain.evaluate.runner import Policy, engine_threads, load_policy, run_items
from posttrain.evaluate.suites import Suite, build_suites, by_suite, hygiene, new_fresh_seed
from posttrain.evaluate.tiers import measure_tier, tier_accuracy, tier_prompts, tier_row, tier_table
from posttrain.tracking import say

FORMAT = "posttrain-eval/1"
RESULTS_FILE = "results.json"
REPORT_FILE = "report.html"


@dataclass
class EvalResult:
    results: dict[str, Any]
    results_path: Path | None
    report_path: Path | None

    def figure(self, checkpoint: str, suite: str, name: str = "pass@1") -> float | None:
        """One overall figure (``pass@1``, ``mean_reward``, ``pass@4`` ...) of a checkpoint on a suite."""
        return self.results["metrics"].get(checkpoint, {}).get(suite, {}).get("overall", {}).get(name)


def evaluate(recipe: EvalRecipe, *, suites: Sequence[Suite] | None = None, write: bool = True,
             report_name: str = REPORT_FILE, results_name: str = RESULTS_FILE,
             loader: Callable[..., Policy] = load_policy) -> EvalResult:
    """Run every checkpoint of `recipe` over its suites (or over `suites`, when given) and write the results
    JSON and the HTML report into ``recipe.output_dir`` (unless `write` is false). `loader(path, runtime)` turns a
    checkpoint path into a `Policy` (another engine, a scripted one in tests); a tier's is loaded with
    ``loader(path, runtime, engine=tier.engine)``."""
    started = time.perf_counter()
    fresh_seed = recipe.fresh_draw.seed if recipe.fresh_draw.seed is not None else new_fresh_seed()
    suites = list(suites) if suites is not None else build_suites(recipe, fresh_seed)
    say(f"[eval] {len(suites)} suites, {sum(len(s.tasks) for s in suites)} items, "
        f"{len(recipe.checkpoints)} checkpoint(s)" + (f", {len(recipe.tiers.models)} tier(s)" if recipe.tiers.models
                                                       else ""))

    loading = time.perf_counter()
    first_path = recipe.checkpoints[0].path if recipe.checkpoints else recipe.tiers.models[0].path
    first = loader(first_path, recipe.runtime)  # its tokenizer counts the n-grams
    first_load_s = time.perf_counter() - loading
    samples = training_samples(recipe.contamination)
    contamination = check_contamination(suites, samples, first.tokenizer, recipe.contamination.ngram)
    if recipe.contamination.exclude and contamination["count"]:
        exclude_contaminated(suites, contamination)
    if contamination["count"]:
        say(f"[eval] contamination: {contamination['count']} eval items overlap the training data"
            + (" (excluded)" if contamination["excluded"] else ""))

    tasks = [task for suite in suites for task in suite.tasks]
    checkpoints, metrics, examples, images, rates = [], {}, {}, {}, {}
    for position, checkpoint in enumerate(recipe.checkpoints):
        loading = time.perf_counter()
        policy, first = first or loader(checkpoint.path, recipe.runtime), None
        load_s = first_load_s if position == 0 else time.perf_counter() - loading
        checkpoints.append(_run_checkpoint(checkpoint.name, checkpoint.path, policy, load_s, suites, tasks, recipe,
                                           metrics, examples, images, rates))
        del policy  # one engine in memory at a time
    first = None  # a tier-only eval: loaded for the tokenizer alone
    tiers = _run_tiers(recipe, loader, suites, tasks, checkpoints, metrics, examples, images, rates)
    shown = headline(recipe)

    results = {
        "format": FORMAT,
        "title": recipe.report.title,
        "headline": shown,
        # the headline checkpoint against the one it is compared with, item by item on every suite
        "paired": paired_suites(shown, rates),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": None,
        "recipe": recipe.model_dump(mode="json"),
        "fresh_seed": fresh_seed,
        "sampling": recipe.sampling.model_dump(mode="json"),
        "checkpoints": checkpoints,
        "suites": [suite.describe() for suite in suites],
        "metrics": metrics,
        "examples": examples,
        "images": images,  # {checkpoint: {suite: image_suite_json}}: suites of image tasks only
        "fresh_gap": fresh_gap(suites, metrics),
        "regressions": regressions(suites, metrics),
        "contamination": contamination,
        "hygiene": hygiene(suites),
        "curves": training_curves([(run.label or Path(run.path).name, run.path)
                                   for run in recipe.report.training_runs]),
        "tiers": tiers,
        "tables": [table.model_dump(mode="json") for table in recipe.report.tables],
    }
    results["seconds"] = round(time.perf_counter() - started, 2)
    if not write:
        return EvalResult(jsonable(results), None, None)
    return write_results(jsonable(results), Path(recipe.output_dir), results_name, report_name)


def _run_checkpoint(label: str, path: str, policy: Policy, load_s: float, suites: Sequence[Suite],
                    tasks: list, recipe: EvalRecipe, metrics: dict[str, Any], examples: dict[str, Any],
                    images: dict[str, Any], rates: dict[str, Any]) -> dict[str, Any]:
    """Every suite's episodes for one checkpoint: its metrics, examples, image cases (suites of image tasks:
    sample images with the answers, per-domain pass@1) and per-item pass rates filled in, its results row
    returned."""
    items, stats = run_items(policy, tasks, recipe.sampling, recipe.runtime)
    metrics[label], examples[label] = _score(suites, items, recipe)
    rates[label] = {suite.name: item_pass_rates(mine) for suite, mine in by_suite(suites, items)}
    image_scores = image_suite_scores(suites, items)
    if image_scores:
        images[label] = {name: image_suite_json(score) for name, score in image_scores.items()}
    cached = f" ({stats.cached_episodes} more from the episode cache)" if stats.cached_episodes else ""
    say(f"[eval] {label}: {stats.episodes} episodes in {stats.seconds:.1f}s{cached}")
    # items/s counts the items this run sampled: one whose episodes all came from the cache took no time here
    return {"label": label, "path": path, "seconds": round(stats.seconds, 2), "load_seconds": round(load_s, 2),
            "episodes": stats.episodes, "cached_episodes": stats.cached_episodes, "items": len(tasks),
            "items_per_s": round(stats.items_run / stats.seconds, 2) if stats.seconds and stats.items_run else None,
            "policy_tokens": stats.policy_tokens}


def _run_tiers(recipe: EvalRecipe, loader: Callable[..., Policy], suites: Sequence[Suite], tasks: list,
               checkpoints: list[dict[str, Any]], metrics: dict[str, Any], examples: dict[str, Any],
               images: dict[str, Any], rates: dict[str, Any]) -> dict[str, Any] | None:
    """Each tier evaluated like a checkpoint (its row marked with its kind), then timed (`tiers.measure_tier`)."""
    settings = recipe.tiers
    if not settings.models:
        return None
    from posttrain.models import quantization_of

    accuracy_suites = ([settings.suite] if settings.suite
                       else [s.name for s in suites if s.kind in ("heldout", "dataset")])
    timed_tasks = [task for suite in suites if suite.name in accuracy_suites for task in suite.tasks] or tasks
    rows = []
    for tier in settings.models:
        loading = time.perf_counter()
        policy = loader(tier.path, recipe.runtime, engine=tier.engine)
        row = _run_checkpoint(tier.label, tier.path, policy, time.perf_counter() - loading, suites, tasks, recipe,
                              metrics, examples, images, rates)
        checkpoints.append({**row, "tier": tier.kind})
        if not settings.suite:  # safety suites score refusals, not the capability a tier trades for speed
            accuracy_suites = [n for n in accuracy_suites if "safety" not in metrics[tier.label].get(n, {})]
        prompts = tier_prompts(timed_tasks, policy.tokenizer, settings.prompts)
        with engine_threads(policy, recipe.runtime):
            speed = measure_tier(policy.engine, prompts, max_new_tokens=settings.max_new_tokens,
                                 repeats=settings.repeats, warmup=settings.warmup)
        say(f"[eval] tier {tier.label}: {speed.tokens_per_s:.1f} tokens/s, p50 {speed.p50_latency_ms:.0f} ms "
            f"({speed.runner or 'engine'} runner)")
        rows.append(tier_row(tier, tier_accuracy(metrics[tier.label], accuracy_suites), speed,
                             quantization_of(tier.path)))
        del policy
    return tier_table(rows, settings, accuracy_suites)


def headline(recipe: EvalRecipe) -> dict[str, str | None]:
    """The checkpoint the report's headline cards describe and the one they compare it with."""
    labels = [c.name for c in recipe.checkpoints] or [t.label for t in recipe.tiers.models]
    shown = recipe.report.headline or labels[-1]
    against = recipe.report.headline_against
    if against is None:  # the checkpoint before it
        position = labels.index(shown)
        against = labels[position - 1] if position > 0 else None
    return {"checkpoint": shown, "against": against if against != shown else None}


def write_results(results: dict[str, Any], output_dir: Path, results_name: str = RESULTS_FILE,
                  report_name: str = REPORT_FILE) -> EvalResult:
    """Write the results JSON and the report rendered from it (each atomically)."""
    from posttrain.evaluate.report import render_report

    output_dir.mkdir(parents=True, exist_ok=True)
    results_path, report_path = output_dir / results_name, output_dir / report_name
    _atomic_write(results_path, json.dumps(results, indent=1))
    _atomic_write(report_path, render_report(results))
    return EvalResult(results, results_path, report_path)


def _score(suites: Sequence[Suite], items: list[ItemEpisodes], recipe: EvalRecipe
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    metrics, examples = {}, {}
    for suite, mine in by_suite(suites, items):
        metrics[suite.name] = suite_metrics(mine, recipe.sampling.k if recipe.sampling.n else ())
        examples[suite.name] = failure_examples([t for item in mine for t in item.primary],
                                                recipe.report.transcripts_per_class)
    return metrics, examples


def paired_suites(shown: dict[str, str | None], rates: dict[str, Any]) -> dict[str, Any] | None:
    """The headline checkpoint against the one it is compared with, per suite on the items both scored: the
    pass@1 difference with its paired standard error (`paired_difference`). None without a checkpoint to compare."""
    checkpoint, against = shown["checkpoint"], shown["against"]
    if against is None or checkpoint not in rates or against not in rates:
        return None
    return {"checkpoint": checkpoint, "against": against,
            "suites": {name: paired_difference(rates[against].get(name, {}), after)
                       for name, after in rates[checkpoint].items()}}


def fresh_gap(suites: Sequence[Suite], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Fixed held-out pass@1 minus fresh-draw pass@1, per domain and checkpoint (memorisation shows as > 0).

    ``noise`` is two standard errors of that difference, sqrt(a(1-a)/n_a + b(1-b)/n_b) * 2: a gap inside it is
    what two independent samples of the same split differ by anyway."""
    rows = []
    fixed = {s.group: s for s in suites if s.kind == "heldout"}
    for fresh in (s for s in suites if s.kind == "fresh"):
        heldout = fixed.get(fresh.group)
        if heldout is None:
            continue
        for label, by_suite in metrics.items():
            a = by_suite.get(heldout.name, {}).get("overall", {}).get("pass@1")
            b = by_suite.get(fresh.name, {}).get("overall", {}).get("pass@1")
            both = a is not None and b is not None and heldout.tasks and fresh.tasks
            noise = 2 * math.sqrt(a * (1 - a) / len(heldout.tasks) + b * (1 - b) / len(fresh.tasks)) if both else None
            rows.append({"group": fresh.group, "checkpoint": label, "heldout": a, "fresh": b,
                         "gap": a - b if both else None, "noise": noise,
                         "heldout_items": len(heldout.tasks), "fresh_items": len(fresh.tasks)})
    return rows


def regressions(suites: Sequence[Suite], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for suite in suites:
        if suite.kind != "regression":
            continue
        for label, by_suite in metrics.items():
            rate = by_suite.get(suite.name, {}).get("overall", {}).get("pass@1")
            ok = None if suite.min_pass_rate is None or rate is None else rate >= suite.min_pass_rate
            rows.append({"suite": suite.name, "checkpoint": label, "pass_rate": rate,
                         "min_pass_rate": suite.min_pass_rate, "ok": ok})
    return rows


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats as None (strict JSON has no NaN) and tuples as lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
