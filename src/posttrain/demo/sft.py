"""Demo stage `sft`: fine-tune the base model on the (scarce) demonstrations until held-out accuracy on the
validation tasks stops improving, then measure the test set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from posttrain.demo.base import SFT_FILE, load_heldout, load_validation
from posttrain.demo.evaluation import (EPISODE_CACHE, TIMEOUT_SCALE, accuracy_by_level, greedy_pass_rates,
                                      heldout_accuracy, policy_accuracy, sampled_pass_at_k, write_item_rates)
from posttrain.demo.pipeline import DemoRun, demo_stage, source


@demo_stage("sft")
def sft(run: DemoRun) -> dict[str, Any]:
    from posttrain.train import run_sft

    recipe = run.recipe.sft.model_copy(deep=True)
    recipe.output_dir = str(run.root / "sft")
    recipe.model.path = str(run.base_dir)
    recipe.data.train = [source(run.data_dir / SFT_FILE)]
    recipe.runtime.seed = run.recipe.seed
    result = run_sft(recipe, resume=run.resume, evaluate=validation_accuracy(run))
    return evaluate_stage(run, result.final_dir, seconds=result.seconds, steps=result.steps,
                          stopped_by=result.stopped_by, validation=result.evaluation.get("eval/score"),
                          train_loss=round(result.train_loss, 4), tokens_per_s=round(result.tokens_per_s),
                          tokens=result.tokens, tokens_per_step=round(result.tokens / max(result.steps, 1), 2))


def evaluate_stage(run: DemoRun, model_dir, **figures: Any) -> dict[str, Any]:
    """A stage's summary entry: held-out accuracy per domain and per level, and its own figures."""
    cache = {"episode_cache": str(run.root / EPISODE_CACHE), "timeout_scale": TIMEOUT_SCALE}  # the report reuses them
    accuracy, trajectories = heldout_accuracy(model_dir, load_heldout(run),
                                              max_new_tokens=run.recipe.eval.max_new_tokens,
                                              batch_size=run.recipe.eval.batch_size, **cache)
    if "seconds" in figures:
        figures["seconds"] = round(figures["seconds"], 1)
    settings = run.recipe.eval
    sampled, sampled_rates = [task for task in load_heldout(run) if task.domain in settings.pass_k_domains], {}
    if settings.pass_k_samples and sampled:
        figures["pass_at_k_by_level"], sampled_rates = sampled_pass_at_k(
            model_dir, sampled, n=settings.pass_k_samples, ks=settings.pass_k, max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature, seed=run.recipe.seed, batch_size=settings.batch_size, **cache)
    write_item_rates(Path(model_dir).parent, greedy_pass_rates(trajectories), sampled_rates)  # <stage>/final -> <stage>
    return {"heldout": accuracy, "heldout_by_level": accuracy_by_level(trajectories), **figures}


def validation_accuracy(run: DemoRun) -> Callable[[Any], dict[str, float]] | None:
    """An SFT `evaluate` callback: greedy accuracy on the validation tasks, on an engine kept in step with the
    model in training (its weights pushed in memory), as "score" (the mean over domains) and per domain. The
    engine's model is extended as the SFT recipe extends the base (`model.rope_scaling`), so it holds the
    validation prompts the trained model does."""
    tasks = load_validation(run)
    if not tasks:
        return None
    from posttrain.config import EvalRuntime
    from posttrain.evaluate import load_policy
    from posttrain.rollout import state_for_engine

    policy = load_policy(run.base_dir, EvalRuntime(batch_size=run.recipe.eval.batch_size),
                         rope_scaling=run.recipe.sft.model.rope_scaling)
    policy.settings = None  # its weights become the model's in training: never the base checkpoint's episodes
    version = iter(range(1, 1 << 30))

    def evaluate(model) -> dict[str, float]:
        policy.engine.update_weights(state_for_engine(model), next(version))
        accuracy, _ = policy_accuracy(policy, tasks, max_new_tokens=run.recipe.eval.max_new_tokens,
                                      batch_size=run.recipe.eval.batch_size)
        return {"score": sum(accuracy.values()) / len(accuracy), **{f"accuracy/{k}": v for k, v in accuracy.items()}}

    return evaluate
