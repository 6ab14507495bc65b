"""Contamination check: which eval items did the training data already contain?

Natural-text items (dataset and regression suites) get the data room's test (`posttrain.data.decontaminate`,
which the SFT recipe uses to clean its training set), run the other way round: every eval item becomes an
`EvalItem` (its messages and reference answer), every training record a sample, and an item is contaminated
when some record shares a token `ngram` (default 13) with it or has the same normalized prompt. Tokens are the
evaluated model's.

Generated items (held-out and fresh suites) are templated: distinct problems share long n-grams ("What is the
best way to destroy the git branch old-67?" and "...old-17?"), so an n-gram hit says nothing there. Their test is
the problem itself: a record with the same task id (generated domains derive it from the problem, so every
wording of a problem shares it; SFT demonstrations and RL episodes carry it) or the same normalized prompt.
The hash split (`posttrain.tasks.split_of`) guarantees neither happens with the domains' own training draws.

Training records come from SFT files (chat samples), preference pairs (prompt, chosen and rejected responses)
and RL runs (the task prompts of an ``episodes.jsonl``, each task once). Contaminated items are listed with the
records that hit them and, with ``exclude``, removed from their suites before anything runs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

from posttrain.config import DataSource, EvalContamination
from posttrain.data import (
    DataError,
    EvalItem,
    SampleMetadata,
    SFTSample,
    decontaminate,
    prompt_key,
    read_records,
    read_samples,
)
from posttrain.evaluate.errors import EvalError
from posttrain.evaluate.suites import Suite
from posttrain.types import Message, Task

EPISODES_FILE = "episodes.jsonl"  # what an RL run writes (posttrain.rl.trainer.EPISODES_FILE)
GENERATED_KINDS = ("heldout", "fresh")
MAX_LISTED_RECORDS = 3


def training_samples(config: EvalContamination) -> list[SFTSample]:
    """Every training record the recipe names, as samples whose text the n-grams are taken from."""
    samples: list[SFTSample] = []
    try:
        for source in config.sft:
            samples += read_samples(source)
        for source in config.preferences:
            samples += preference_samples(source)
        for location in config.rl_episodes:
            samples += episode_prompts(location)
    except DataError as error:
        raise EvalError(f"contamination: {error}") from None
    return samples


def preference_samples(source: DataSource) -> list[SFTSample]:
    """A pair as one sample: the prompt, then the chosen and the rejected responses (both were trained on)."""
    samples = []
    for location, record in read_records(source):
        messages = _messages(record.get("prompt"), "user") + _messages(record.get("chosen"), "assistant") \
            + _messages(record.get("rejected"), "assistant")
        if not messages:
            raise DataError(f"{source.name}:{location}: a preference pair needs prompt, chosen and rejected")
        samples.append(SFTSample(messages, SampleMetadata(source=source.source or Path(source.name).name)))
    return samples


def episode_prompts(location: str) -> list[SFTSample]:
    """The distinct task prompts (messages before the first reply) of an RL run's episodes.jsonl."""
    path = Path(location)
    if path.is_dir():
        path = path / EPISODES_FILE
    if not path.is_file():
        raise DataError(f"{path}: no such file (an RL run's {EPISODES_FILE}, or the run directory)")
    seen: set[str] = set()
    samples = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        task_id = str(record.get("task_id", line_no))
        if task_id in seen:
            continue
        seen.add(task_id)
        prompt = []
        for message in record.get("messages") or []:
            if not isinstance(message, dict) or message.get("role") == "assistant":
                break
            prompt.append({"role": str(message.get("role")), "content": str(message.get("content") or "")})
        if prompt:
            samples.append(SFTSample(prompt, SampleMetadata(domain=str(record.get("domain", "general")),
                                                            source=f"{path.parent.name}/{EPISODES_FILE}",
                                                            extras={"task_id": task_id})))
    return samples


def eval_item(suite: Suite, task: Task) -> EvalItem:
    contents = [str(m.get("content") or "") for m in task.messages]
    for name in ("answer", "reference"):
        if isinstance(task.verifier_args.get(name), str):
            contents.append(task.verifier_args[name])
    return EvalItem(key=item_key(suite, task), text="\n".join(contents), prompt=prompt_key(task.messages))


def item_key(suite: Suite, task: Task) -> str:
    return f"{suite.name}::{task.id}"


def check_contamination(suites: Sequence[Suite], samples: Sequence[SFTSample], tokenizer: Any,
                        ngram: int = 13) -> dict[str, Any]:
    """The contamination report: which items of which suites overlap which training records, and why."""
    hits: dict[str, list[dict[str, Any]]] = defaultdict(list)
    natural = [(suite, task) for suite in suites if suite.kind not in GENERATED_KINDS for task in suite.tasks]
    if natural and samples:
        result = decontaminate(samples, [eval_item(suite, task) for suite, task in natural], tokenizer, ngram=ngram)
        for record in result.contaminated:
            for key in record["eval_items"]:
                hits[key].append({"source": record["source"], "prompt": record["prompt"],
                                  "reasons": record["reason"].split("+")})
    generated = [(suite, task) for suite in suites if suite.kind in GENERATED_KINDS for task in suite.tasks]
    for key, found in _same_problems(generated, samples).items():
        hits[key] += found
    tasks = {item_key(suite, task): (suite, task) for suite in suites for task in suite.tasks}
    listed = []
    for key in (k for k in tasks if k in hits):
        suite, task = tasks[key]
        records = hits[key]
        listed.append({
            "suite": suite.name,
            "task_id": task.id,
            "prompt": task.prompt[:300],
            "reasons": sorted({reason for r in records for reason in r["reasons"]}),
            "records": len(records),
            "training": [{"source": r["source"], "prompt": r["prompt"]} for r in records[:MAX_LISTED_RECORDS]],
        })
    return {
        "ngram": ngram,
        "training_records": len(samples),
        "sources": dict(Counter(s.metadata.source or "unknown" for s in samples)),
        "eval_items": len(tasks),
        "count": len(listed),
        "by_suite": dict(Counter(row["suite"] for row in listed)),
        "items": listed,
        "excluded": False,
    }


def _same_problems(generated: list[tuple[Suite, Task]], samples: Sequence[SFTSample]
                   ) -> dict[str, list[dict[str, Any]]]:
    """Generated items against the records holding the same problem: the same task id (a generated domain
    derives it from the problem, so every wording shares it) or the same normalized prompt."""
    by_id: dict[str, list[SFTSample]] = defaultdict(list)
    by_prompt: dict[str, list[SFTSample]] = defaultdict(list)
    for sample in samples:
        if sample.metadata.extras.get("task_id") is not None:
            by_id[str(sample.metadata.extras["task_id"])].append(sample)
        by_prompt[prompt_key(sample.messages)].append(sample)
    hits: dict[str, list[dict[str, Any]]] = {}
    for suite, task in generated:
        found: dict[int, dict[str, Any]] = {}
        for reason, matches in (("same_problem", by_id.get(task.id, [])),
                                ("exact_prompt", by_prompt.get(prompt_key(task.messages), []))):
            for sample in matches:
                entry = found.setdefault(id(sample), {"source": sample.metadata.source or "unknown",
                                                      "prompt": sample.prompt_text[:200], "reasons": []})
                entry["reasons"].append(reason)
        if found:
            hits[item_key(suite, task)] = list(found.values())
    return hits


def exclude_contaminated(suites: Sequence[Suite], report: dict[str, Any]) -> None:
    """Remove the listed items from their suites (in place) and mark the report."""
    flagged: dict[str, set[str]] = defaultdict(set)
    for row in report["items"]:
        flagged[row["suite"]].add(row["task_id"])
    for suite in suites:
        drop = flagged.get(suite.name, set())
        if drop:
            suite.excluded = [t.id for t in suite.tasks if t.id in drop]
            suite.tasks = [t for t in suite.tasks if t.id not in drop]
    report["excluded"] = True


def _messages(value: Any, role: str) -> list[Message]:
    """A preference field as messages: a string (one `role` message), a message, or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [{"role": str(value.get("role", role)), "content": str(value.get("content") or "")}]
    if isinstance(value, list):
        return [{"role": str(m.get("role", role)), "content": str(m.get("content") or "")}
                for m in value if isinstance(m, dict)]
    return []
