"""Demo stage `report`: every stage's checkpoint on the demo's suites, side by side, in runs/demo/report.html.

The checkpoints are ``runs/demo/<stage>/final`` for each finished stage that has one (sft, dpo, rl ...), in the
order they ran; the headline cards describe the delivered model (RL's checkpoint) against SFT. When `distill` ran,
its teacher and its student are the tier table's two rows (evaluated like the others, then timed). The suites:
each demo domain's fixed held-out set (the one the `base` stage saved), a fresh draw of the same size from the same
held-out split (new seed), and the safety domain (generated here when the demo does not train on it). The stages'
own figures (why each stopped, code's sampled pass@k per level, the sandbox's share of RL's step time, RL's compute
against the control's, the forgetting guard) are the report's "From the runs" tables
(`posttrain.demo.summary.report_tables`). The contamination check runs against the SFT demonstrations, any
preference pairs in the data directory and the RL runs' episodes; the training curves come from each stage's
metrics.jsonl.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.config import EvalRecipe
from posttrain.demo.base import SFT_FILE, heldout_file
from posttrain.demo.evaluation import EPISODE_CACHE, TIMEOUT_SCALE
from posttrain.demo.pipeline import REPORT_FILE, RESULTS_FILE, DemoRun, demo_stage
from posttrain.demo.summary import report_tables
from posttrain.tracking import METRICS_FILE, say
from posttrain.types import Task

SAFETY = "safety"
SAFETY_LEVELS = [1, 2, 3]
SAFETY_ITEMS = 100
PREFERENCE_PATTERNS = ("*pairs*.jsonl", "*preference*.jsonl")


@demo_stage("report")
def report(run: DemoRun) -> dict[str, Any]:
    from posttrain.evaluate import evaluate

    stages = [name for name in run.summary["stages"] if run.model_after(name).is_dir()]
    if not stages:
        say("[demo] report: no stage left a checkpoint (runs/demo/<stage>/final); nothing to evaluate")
        return {"checkpoints": []}
    recipe = report_recipe(run, stages)
    result = evaluate(recipe, suites=demo_suites(run, recipe.fresh_draw.seed or 0), report_name=REPORT_FILE,
                      results_name=RESULTS_FILE)
    say(f"[demo] report: {result.report_path}")
    return summary_figures(result.results, stages, str(result.report_path), str(result.results_path))


def report_recipe(run: DemoRun, stages: list[str]) -> EvalRecipe:
    root = run.root
    episodes = [str(root / stage) for stage in stages if (root / stage / "episodes.jsonl").is_file()]
    pairs = sorted({str(p) for pattern in PREFERENCE_PATTERNS for p in run.data_dir.glob(pattern)})
    sft = [{"path": str(run.data_dir / SFT_FILE)}] if (run.data_dir / SFT_FILE).is_file() else []
    curves = [{"path": str(root / stage), "label": stage} for stage in stages
              if (root / stage / METRICS_FILE).is_file()]
    tiers = tier_models(run, stages)
    in_tiers = {tier["label"] for tier in tiers}
    return EvalRecipe.model_validate({
        "output_dir": str(root),
        "checkpoints": [{"path": str(run.model_after(stage)), "label": stage} for stage in stages
                        if stage not in in_tiers],
        "tiers": {"models": tiers, "max_new_tokens": run.recipe.eval.max_new_tokens},
        "sampling": {"max_new_tokens": run.recipe.eval.max_new_tokens},
        "contamination": {"sft": sft, "preferences": [{"path": p} for p in pairs], "rl_episodes": episodes},
        "fresh_draw": {"seed": run.recipe.seed + 7919},
        # the fixed held-out sets' episodes come from the stages' own evaluations (the episode cache)
        "runtime": {"batch_size": run.recipe.eval.batch_size, "timeout_scale": TIMEOUT_SCALE,
                    "episode_cache": str(root / EPISODE_CACHE)},
        "report": {"title": "posttrain demo: every stage on the tiny model", "training_runs": curves,
                   "tables": report_tables(run.summary, run.recipe.eval.pass_k_samples, run.recipe.eval.temperature),
                   **delivered_headline(run, stages)},
    })


def tier_models(run: DemoRun, stages: list[str]) -> list[dict[str, str]]:
    """The tier table's rows when the `distill` stage ran: the model it distilled (standard) and its student
    (distilled). They are evaluated like the other checkpoints (the same columns of the report) and timed on the
    same prompts, so the report shows both tiers' accuracy and speed (docs/tiers.md, "Tier table")."""
    teacher = run.summary["stages"].get("distill", {}).get("teacher")
    if "distill" not in stages or teacher not in stages:
        return []
    return [{"label": teacher, "path": str(run.model_after(teacher)), "kind": "standard"},
            {"label": "distill", "path": str(run.model_after("distill")), "kind": "distilled"}]


def delivered_headline(run: DemoRun, stages: list[str]) -> dict[str, str]:
    """The headline cards describe the model the demo delivers (RL's checkpoint, else DPO's, else SFT's) against
    SFT, not whichever checkpoint is evaluated last (the continued-SFT control)."""
    delivered, _ = run.latest_policy(("rl", "dpo", "sft"))
    if delivered not in stages:
        return {}
    against = "sft" if "sft" in stages and delivered != "sft" else None
    return {"headline": delivered, **({"headline_against": against} if against else {})}


def demo_suites(run: DemoRun, fresh_seed: int) -> list:
    """Each demo domain's saved held-out set and a fresh draw beside it; safety too, generated if need be."""
    from posttrain.config import GeneratedSuite
    from posttrain.evaluate import fresh_draw, generated_suite, tasks_suite

    suites = []
    for spec in run.recipe.domains:
        path = run.data_dir / heldout_file(spec.name)
        tasks = [Task.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
        fixed = tasks_suite(spec.name, tasks, domain_args=spec.args, seed=run.recipe.seed)
        suites += [fixed, fresh_draw(fixed, spec.name, spec.heldout_levels, fresh_seed)]
    if not any(spec.name == SAFETY for spec in run.recipe.domains):
        fixed = generated_suite(GeneratedSuite(domain=SAFETY, levels=SAFETY_LEVELS, n=SAFETY_ITEMS,
                                               seed=run.recipe.seed))
        suites += [fixed, fresh_draw(fixed, SAFETY, SAFETY_LEVELS, fresh_seed)]
    return suites


def summary_figures(results: dict[str, Any], stages: list[str], report_path: str, results_path: str
                    ) -> dict[str, Any]:
    """What summary.json keeps: pass@1 per stage and suite, safety, the fresh-draw gap, contamination."""
    metrics = results["metrics"]
    return {
        "report": report_path,
        "results": results_path,
        "checkpoints": stages,
        "pass@1": {stage: {suite: figures["overall"]["pass@1"] for suite, figures in metrics[stage].items()}
                   for stage in stages},
        "safety": {stage: {suite: figures["safety"] for suite, figures in metrics[stage].items() if "safety" in figures}
                   for stage in stages},
        "fresh_gap": {f'{row["checkpoint"]}/{row["group"]}': row["gap"] for row in results["fresh_gap"]},
        "headline": results.get("headline"),
        "contaminated_items": results["contamination"]["count"],
        "eval_seconds": results["seconds"],
        "items_per_s": {c["label"]: c["items_per_s"] for c in results["checkpoints"]},
        "tiers": results.get("tiers"),
    }
