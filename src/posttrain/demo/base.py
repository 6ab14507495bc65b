"""Demo stage `base`: the demo's data, a tokenizer trained on it, and a freshly built tiny model.

For each demo domain: `demos` SFT demonstrations drawn from the train split at `sft_levels`, and `heldout`
tasks drawn from the held-out split at `heldout_levels` (the split is by a hash of the problem, so the two
never share one). The tokenizer is trained on the text of both, plus the tool and format strings the
later stages use, so no stage meets an unseen word. Domains that measure lengths in tokens (the long-context ones:
a `tokenizer` argument the recipe leaves unset) are then drawn again with that tokenizer, so their levels'
lengths are the model's own tokens.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Collection, Iterable

from posttrain.data import SFTSample
from posttrain.demo.pipeline import DemoRun, demo_stage
from posttrain.models import build_tiny_model, count_parameters, save_model_dir, train_tokenizer
from posttrain.tasks import DOMAINS, get_domain, sample_tasks
from posttrain.types import Task

SFT_FILE = "sft_train.jsonl"


def heldout_file(domain: str) -> str:
    return f"heldout_{domain}.jsonl"


def validation_file(domain: str) -> str:
    return f"validation_{domain}.jsonl"


def guard_file(domain: str) -> str:
    return f"guard_{domain}.jsonl"


@demo_stage("base")
def base(run: DemoRun) -> dict[str, Any]:
    recipe = run.recipe
    run.data_dir.mkdir(parents=True, exist_ok=True)
    demos, heldout, validation = _draw(recipe)
    tokenizer = train_tokenizer(_corpus(demos, heldout), vocab_size=recipe.vocab_size)
    if any(counts_tokens(spec) for spec in recipe.domains):
        # Long-context domains size their levels in tokens: drawn again, counted by the tokenizer just trained
        # on the first draw's text (the same vocabulary), so a level's length is the model's own.
        demos, heldout, validation = _draw(recipe, tokenizer)
    for name, tasks in validation.items():
        write_jsonl(run.data_dir / validation_file(name), (task.to_dict() for task in tasks))
    write_jsonl(run.data_dir / SFT_FILE, (sample.to_dict() for sample in demos))
    for name, tasks in heldout.items():
        write_jsonl(run.data_dir / heldout_file(name), (task.to_dict() for task in tasks))

    model = build_tiny_model(recipe.preset, tokenizer, seed=recipe.seed)
    save_model_dir(run.base_dir, model, tokenizer)
    return {
        "preset": recipe.preset,
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "demonstrations": {spec.name: spec.demo_count for spec in recipe.domains},
        "heldout_items": {name: len(tasks) for name, tasks in heldout.items()},
    }


def _draw(recipe, tokenizer=None) -> tuple[list[SFTSample], dict[str, list[Task]], dict[str, list[Task]]]:
    """Every domain's demonstrations, held-out tasks and validation tasks (`tokenizer` to the domains that count
    tokens and were given none)."""
    demos: list[SFTSample] = []
    heldout: dict[str, list[Task]] = {}
    validations: dict[str, list[Task]] = {}
    for index, spec in enumerate(recipe.domains):
        domain = get_domain(spec.name, **domain_args(spec, tokenizer))
        tasks = sample_tasks(domain, spec.demos, level=spec.sft_levels, split="train", seed=recipe.seed + index)
        for level, count in sorted(spec.level_demos.items()):
            tasks += sample_tasks(domain, count, level=level, split="train", seed=recipe.seed + 1000 * level + index)
        demos += [domain.demonstration(task) for task in tasks]
        heldout[spec.name] = sample_tasks(domain, spec.heldout, level=spec.heldout_levels, split="heldout",
                                          seed=recipe.seed + index)
        # Validation (early stopping) comes from the held-out split too, but never shares a problem with the test set.
        test_keys = {task.metadata["problem_key"] for task in heldout[spec.name]}
        candidates = sample_tasks(domain, 2 * spec.validation, level=spec.heldout_levels,
                                  split="heldout", seed=recipe.seed + 100 + index) if spec.validation else []
        fresh = [t for t in candidates if t.metadata["problem_key"] not in test_keys]
        validations[spec.name] = fresh[: spec.validation]
    return demos, heldout, validations


def domain_args(spec, tokenizer: str | None) -> dict[str, Any]:
    """A demo domain's arguments, with `tokenizer` added where the domain counts tokens and was given none."""
    return {**spec.args, "tokenizer": tokenizer} if tokenizer is not None and counts_tokens(spec) else spec.args


def counts_tokens(spec) -> bool:
    """Whether the domain takes a `tokenizer` to measure lengths with, and the recipe left it unset."""
    factory = DOMAINS.get(spec.name)
    if factory is None or "tokenizer" in spec.args:
        return False
    try:
        return "tokenizer" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def load_heldout(run: DemoRun) -> list[Task]:
    """The demo's test set: every domain's held-out tasks."""
    return _load_tasks(run, heldout_file)


def load_validation(run: DemoRun) -> list[Task]:
    """Every domain's validation tasks (held-out split, disjoint from the test set)."""
    return _load_tasks(run, validation_file)


def write_guard_items(run: DemoRun, rl_domains: Collection[str], tokenizer: str | None = None) -> dict[str, Path]:
    """The RL forgetting guard's items (data/guard_<domain>.jsonl) for every domain SFT trained and RL does not
    (`rl_domains`): `guard_items` of the domain's held-out split at its `heldout_levels`, sharing no problem
    (`problem_key`) with the test and validation files on disk -- fewer where the split runs out (fractions' level
    1 has 224 held-out problems, 130 of them test and validation). Drawn when RL starts, from the files, so a run
    whose data came before this draw gets them too; `tokenizer` to the domains that count tokens. {domain: path}
    of the files with at least one item."""
    recipe = run.recipe
    paths: dict[str, Path] = {}
    for index, spec in enumerate(recipe.domains):
        if not recipe.guard_items or spec.demo_count == 0 or spec.name in rl_domains:
            continue
        used = {task.metadata["problem_key"] for name in (heldout_file, validation_file)
                for task in _read_tasks(run.data_dir / name(spec.name))}
        domain = get_domain(spec.name, **domain_args(spec, tokenizer))
        tasks = sample_tasks(domain, recipe.guard_items, level=spec.heldout_levels, split="heldout",
                             seed=recipe.seed + 200 + index, exclude=used, fewer_ok=True,
                             max_tries_per_task=5000)  # most held-out draws now miss: look longer
        if tasks:
            paths[spec.name] = run.data_dir / guard_file(spec.name)
            write_jsonl(paths[spec.name], (task.to_dict() for task in tasks))
    return paths


def _load_tasks(run: DemoRun, name) -> list[Task]:
    tasks: list[Task] = []
    for spec in run.recipe.domains:
        tasks += _read_tasks(run.data_dir / name(spec.name))
    return tasks


def _read_tasks(path: Path) -> list[Task]:
    if not path.is_file():
        return []
    return [Task.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    tmp.replace(path)


def _corpus(demos: list[SFTSample], heldout: dict[str, list[Task]]) -> list[str]:
    texts = []
    for sample in demos:
        texts += [m.get("content") or "" for m in sample.messages]
        texts += [json.dumps(call.get("function", call)) for m in sample.messages for call in m.get("tool_calls", [])]
        if sample.metadata.reasoning_trace:
            texts.append(sample.metadata.reasoning_trace)
    for tasks in heldout.values():
        texts += [m.get("content") or "" for task in tasks for m in task.messages]
    return texts
