"""Demo stage `sft`: fine-tune the base model on the demonstrations, then measure held-out accuracy."""

from __future__ import annotations

from typing import Any

from posttrain.demo.base import SFT_FILE, load_heldout
from posttrain.demo.evaluation import heldout_accuracy
from posttrain.demo.pipeline import DemoRun, demo_stage, source


@demo_stage("sft")
def sft(run: DemoRun) -> dict[str, Any]:
    from posttrain.train.sft import run_sft

    recipe = run.recipe.sft.model_copy(deep=True)
    recipe.output_dir = str(run.root / "sft")
    recipe.model.path = str(run.base_dir)
    recipe.data.train = [source(run.data_dir / SFT_FILE)]
    recipe.runtime.seed = run.recipe.seed
    result = run_sft(recipe, resume=run.resume)
    accuracy, _ = heldout_accuracy(result.final_dir, load_heldout(run),
                                   max_new_tokens=run.recipe.eval.max_new_tokens,
                                   batch_size=run.recipe.eval.batch_size)
    return {
        "heldout": accuracy,
        "seconds": round(result.seconds, 1),
        "steps": result.steps,
        "train_loss": round(result.train_loss, 4),
        "tokens_per_s": round(result.tokens_per_s),
    }
