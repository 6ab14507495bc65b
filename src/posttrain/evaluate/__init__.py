"""Evaluation: checkpoints over held-out, fresh-draw, dataset and regression suites, with process metrics,
bad-case attribution, a contamination check and a self-contained HTML report.

    from posttrain.config import EvalRecipe, load_recipe
    from posttrain.evaluate import evaluate
    result = evaluate(load_recipe("eval.yaml", schema=EvalRecipe))     # or: posttrain eval eval.yaml
    print(result.figure("sft", "arithmetic"), result.report_path)

Pieces for other rooms (the demo): `load_policy` + `run_items` run tasks through one engine, `suite_metrics` /
`pass_at_k` score them, `render_report` renders a results dict, `measure_tier` times an engine for the tier
table (tokens/s, p50 latency). A training loop (the RL forgetting guard) calls a
`SuiteEvaluator`: ``evaluate(model, version) -> {suite: SuiteScore}``, the same episodes and the same pass@1
(infrastructure failures counted, never scored).
See docs/evaluate.md.
"""

from posttrain.evaluate.contamination import check_contamination, exclude_contaminated, training_samples
from posttrain.evaluate.curves import training_curves
from posttrain.evaluate.errors import EvalError
from posttrain.evaluate.failures import FAILURE_LABELS, failure_examples, transcript
from posttrain.evaluate.metrics import (
    FAILURE_CLASSES,
    ItemEpisodes,
    by_level,
    failure_counts,
    item_pass_rates,
    length_depth_metrics,
    outcome_metrics,
    paired_difference,
    pass_at_k,
    pooled_difference,
    process_metrics,
    SuiteScore,
    safety_metrics,
    suite_metrics,
)
from posttrain.evaluate.pipeline import EvalResult, evaluate, write_results
from posttrain.evaluate.report import render_report
from posttrain.evaluate.image_report import image_section, image_suite_json
from posttrain.evaluate.images import (
    ImageAnswer,
    ImageCase,
    ImageSuiteScore,
    ProcessorRenderer,
    image_case,
    image_sample,
    image_suite_scores,
    sample_image_tasks,
    score_image_suite,
    thumbnail,
)
from posttrain.evaluate.runner import (
    Policy,
    RunStats,
    SuiteEvaluator,
    load_policy,
    load_vision_checkpoint,
    run_items,
    score_suites,
)
from posttrain.evaluate.suites import (
    Suite,
    build_suites,
    fresh_draw,
    generated_suite,
    hygiene,
    regression_suite,
    tasks_suite,
)
from posttrain.evaluate.console import print_results
from posttrain.evaluate.tiers import TierSpeed, measure_tier, tier_prompts, tier_table

__all__ = [
    "ImageAnswer",
    "ImageCase",
    "ImageSuiteScore",
    "ProcessorRenderer",
    "image_case",
    "image_sample",
    "image_suite_scores",
    "image_section",
    "image_suite_json",
    "sample_image_tasks",
    "score_image_suite",
    "thumbnail",
    "EvalError",
    "EvalResult",
    "FAILURE_CLASSES",
    "FAILURE_LABELS",
    "ItemEpisodes",
    "Policy",
    "load_vision_checkpoint",
    "RunStats",
    "Suite",
    "SuiteEvaluator",
    "SuiteScore",
    "TierSpeed",
    "build_suites",
    "by_level",
    "check_contamination",
    "evaluate",
    "exclude_contaminated",
    "failure_counts",
    "failure_examples",
    "fresh_draw",
    "generated_suite",
    "hygiene",
    "item_pass_rates",
    "length_depth_metrics",
    "load_policy",
    "measure_tier",
    "outcome_metrics",
    "paired_difference",
    "pass_at_k",
    "pooled_difference",
    "print_results",
    "process_metrics",
    "regression_suite",
    "render_report",
    "run_items",
    "safety_metrics",
    "score_suites",
    "suite_metrics",
    "tasks_suite",
    "tier_prompts",
    "tier_table",
    "training_curves",
    "training_samples",
    "transcript",
    "write_results",
]
