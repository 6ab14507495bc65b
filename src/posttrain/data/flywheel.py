"""The data flywheel: verified episodes (from RL runs or sampling) -> preference pairs and SFT samples.

An episode record is one line of a run's `episodes.jsonl` (`posttrain.rl.episode_record`): the task id,
domain, difficulty, the verdict (`passed`, `score`, `failure`) and the full transcript (`messages`).

* `episodes_to_pairs`: for each task with both a verified success and a model failure, pairs a success
  (chosen) with a failure (rejected). Infrastructure failures are not the model's answers and never become
  a rejected response. The prompt is the transcript up to the first assistant turn; each response is the
  rest (a multi-turn response keeps its tool results).
* `episodes_to_sft`: every verified success becomes an SFT sample (one per distinct response of a task),
  with `metadata.source` naming where it came from.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

INFRASTRUCTURE = {"infra", "sandbox_failure"}


def read_episodes(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    from posttrain.data.readers import read_jsonl_records

    return [record for path in paths for _, record in read_jsonl_records(path)]


def _split(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return messages[:index], messages[index:]
    return messages, []


def _is_success(record: dict[str, Any]) -> bool:
    return bool(record.get("passed")) and record.get("failure", "none") == "none"


def _is_model_failure(record: dict[str, Any]) -> bool:
    return not record.get("passed") and record.get("failure") not in INFRASTRUCTURE


def episodes_to_pairs(
    episodes: Iterable[dict[str, Any]], *, per_task: int = 2, seed: int = 0, source: str = "episodes"
) -> list[dict[str, Any]]:
    """Preference records (the `posttrain.data.preference` format) from success/failure episodes of a task."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in episodes:
        by_task[record["task_id"]].append(record)
    rng = random.Random(seed)
    pairs = []
    for task_id in sorted(by_task):
        records = by_task[task_id]
        wins = _distinct([r for r in records if _is_success(r)])
        losses = _distinct([r for r in records if _is_model_failure(r)])
        rng.shuffle(wins)
        rng.shuffle(losses)
        for chosen, rejected in list(zip(wins * per_task, losses))[:per_task]:
            prompt, chosen_response = _split(chosen["messages"])
            _, rejected_response = _split(rejected["messages"])
            if not chosen_response or not rejected_response:
                continue
            pairs.append({
                "prompt": prompt,
                "chosen": chosen_response,
                "rejected": rejected_response,
                "metadata": {
                    "domain": chosen.get("domain", "general"),
                    "difficulty": chosen.get("difficulty"),
                    "source": source,
                    "task_id": task_id,
                    "rejected_failure": rejected.get("failure"),
                },
            })
    return pairs


def episodes_to_sft(episodes: Iterable[dict[str, Any]], *, source: str = "episodes") -> list[dict[str, Any]]:
    """SFT records from verified successes (one per distinct response of a task)."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in episodes:
        if _is_success(record):
            by_task[record["task_id"]].append(record)
    samples = []
    for task_id in sorted(by_task):
        for record in _distinct(by_task[task_id]):
            samples.append({
                "messages": record["messages"],
                "metadata": {"domain": record.get("domain", "general"), "difficulty": record.get("difficulty"),
                             "source": source, "task_id": task_id},
            })
    return samples


def write_records(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


def _distinct(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen, kept = set(), []
    for record in records:
        key = json.dumps(_split(record["messages"])[1], sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept
