"""The model an RL run starts from: `model.path` (a local directory or a hub id), or the built-in tiny model.

With `model.path` unset the run starts from a fresh built-in tiny model whose tokenizer is trained on the text of
the recipe's domains (their prompts and, where a domain has them, demonstrations), so a packaged recipe runs as it
is on a laptop. A fresh model knows nothing: its rewards start near zero, and the run exercises the pipeline
(rollouts, verifiers, sandboxes, updates) rather than teaching much; start from a trained model
(`model.path=runs/.../final`) to learn. The corpus is drawn with fixed seeds, so a resumed run trains the same
tokenizer again.
"""

from __future__ import annotations

from typing import Any

from posttrain.config import RLRecipe
from posttrain.models import load_tokenizer
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.tracking import say

CORPUS_TASKS_PER_DOMAIN = 64


def starting_tokenizer(recipe: RLRecipe) -> Any:
    if recipe.model.path is not None or recipe.model.tokenizer_path is not None:
        return load_tokenizer(recipe.model)
    say(f"[rl] model.path is unset: starting from a fresh built-in {recipe.model.preset} model (it has learned "
        "nothing yet; set model.path to a trained model to learn from the rewards)")
    return load_tokenizer(recipe.model, corpus=domain_corpus(recipe))


def domain_corpus(recipe: RLRecipe) -> list[str]:
    """Prompts and demonstrations of every domain of the recipe (train split, fixed seeds)."""
    texts: list[str] = []
    for spec in recipe.domains:
        source = get_domain(spec.name, **spec.args)
        for task in sample_tasks(source, CORPUS_TASKS_PER_DOMAIN, level=spec.levels, split="train", seed=11,
                                 unique=False):
            texts += [str(m.get("content") or "") for m in task.messages]
            try:
                sample = source.demonstration(task)
            except (TaskError, KeyError, NotImplementedError):
                continue  # a dataset without solutions: its prompts only
            texts += [str(m.get("content") or "") for m in sample.messages]
            texts.append(sample.metadata.reasoning_trace or "")
    return texts
