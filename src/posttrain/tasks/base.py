"""Task domains: generators of `Task`s at difficulty levels, with a held-out split that never overlaps.

A domain is registered with `@domain("name")` on a class (or factory) taking keyword arguments; it
produces tasks with `make_task(rng, level)` and, for SFT, correct demonstrations with reasoning traces
with `demonstration(task)`. Every task carries `metadata["problem_key"]`: the canonical identity of the
problem, which decides its split by a salted hash. Train and held-out draws therefore never share a
problem, however many are drawn, and a "fresh" draw with new seeds still respects the split.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
from typing import Any, Callable, Collection, Iterable, Iterator, Protocol, runtime_checkable

from posttrain.data import DataError, SFTSample, SampleMetadata, read_records
from posttrain.types import Message, PosttrainError, Task

SPLITS = ("train", "heldout")


class TaskError(PosttrainError):
    """An unknown domain, a bad level, or a domain that cannot produce what was asked."""


@runtime_checkable
class Domain(Protocol):
    name: str
    max_level: int

    def make_task(self, rng: random.Random, level: int) -> Task: ...

    def demonstration(self, task: Task) -> SFTSample: ...


DOMAINS: dict[str, Callable[..., Domain]] = {}


def domain(name: str):
    """Register a domain class or factory under `name`."""

    def register(factory: Callable[..., Domain]) -> Callable[..., Domain]:
        DOMAINS[name] = factory
        return factory

    return register


# Domain families registered on first use, because importing their package is slow (name prefix -> module).
LAZY_DOMAINS = {"reasoning_gym/": "posttrain.tasks.reasoning_gym"}


def get_domain(name: str, **kwargs: Any) -> Domain:
    """The domain registered as `name`, built with `kwargs`.

    ``base/label`` (``tasks/humaneval``) is the domain ``base`` under a name of its own, for a recipe that uses one
    file-backed domain twice: it is built with ``domain_name=name``, so its tasks, statistics, curriculum and logs
    carry the label. Only domains that take ``domain_name`` (``tasks``, ``dataset``) can be labelled."""
    for prefix, module in LAZY_DOMAINS.items():
        if name.startswith(prefix) and name not in DOMAINS:
            import importlib

            importlib.import_module(module).register_all()
    base, _, label = name.partition("/")
    if name not in DOMAINS and label and base in DOMAINS:
        if not _labelable(DOMAINS[base]):
            raise TaskError(f"domain '{name}': '{base}' cannot be labelled (only domains that take domain_name can: "
                            f"{', '.join(sorted(n for n, f in DOMAINS.items() if _labelable(f)))})")
        if kwargs.get("domain_name", name) != name:
            raise TaskError(f"domain '{name}': args.domain_name {kwargs['domain_name']!r} contradicts the label")
        return get_domain(base, **{**kwargs, "domain_name": name})
    if name not in DOMAINS:
        import difflib

        close = difflib.get_close_matches(name, list(DOMAINS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise TaskError(f"unknown task domain '{name}'{hint}; known: {', '.join(sorted(DOMAINS))}")
    try:
        return DOMAINS[name](**kwargs)
    except TypeError as error:
        raise TaskError(f"domain '{name}': bad arguments {kwargs} ({error})") from None


def _labelable(factory: Callable[..., Domain]) -> bool:
    try:
        return "domain_name" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def split_of(problem_key: str, heldout_fraction: float = 0.1, salt: str = "posttrain") -> str:
    """'heldout' for a stable `heldout_fraction` of problem keys, 'train' for the rest."""
    digest = hashlib.sha256(f"{salt}:{problem_key}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "heldout" if bucket < heldout_fraction else "train"


def sample_tasks(
    source: Domain,
    count: int,
    *,
    level: int | Iterable[int],
    split: str = "train",
    seed: int = 0,
    heldout_fraction: float = 0.1,
    unique: bool = True,
    max_tries_per_task: int = 200,
    exclude: Collection[str] = (),
    fewer_ok: bool = False,
) -> list[Task]:
    """`count` tasks of `split` at `level` (or cycling over several levels), deterministic in `seed`.

    A level that runs out of distinct problems (level 1 of arithmetic has only 100) stops being drawn from
    once `max_tries_per_task` draws in a row fail, and the other levels fill the rest. Problems whose
    `problem_key` is in `exclude` (a test set's, say) are never drawn. When every level has run out it is an
    error, or with `fewer_ok` the tasks drawn so far (fewer than `count`).
    """
    if split not in SPLITS:
        raise TaskError(f"split must be one of {SPLITS}, got {split!r}")
    levels = [level] if isinstance(level, int) else list(level)
    for lvl in levels:
        if not 1 <= lvl <= source.max_level:
            raise TaskError(f"domain '{source.name}': level {lvl} outside 1..{source.max_level}")
    rng = random.Random(f"{source.name}:{split}:{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    misses = {lvl: 0 for lvl in levels}
    turn = 0
    while len(tasks) < count:
        open_levels = [lvl for lvl in levels if misses[lvl] < max_tries_per_task]
        if not open_levels:
            if fewer_ok:
                break
            raise TaskError(
                f"domain '{source.name}': could only draw {len(tasks)} of {count} distinct {split} tasks at "
                f"levels {levels} (the levels have too few problems)"
            )
        lvl = open_levels[turn % len(open_levels)]
        task = source.make_task(rng, lvl)
        key = task.metadata["problem_key"]
        if split_of(key, heldout_fraction) != split or (unique and key in seen) or key in exclude:
            misses[lvl] += 1
            continue
        misses[lvl] = 0
        turn += 1
        seen.add(key)
        task.metadata["split"] = split
        tasks.append(task)
    return tasks


def demonstrations(source: Domain, tasks: Iterable[Task]) -> list[SFTSample]:
    return [source.demonstration(task) for task in tasks]


def user_messages(content: str, system_prompt: str | None = None) -> list[Message]:
    """A single-turn prompt: the user's message, after the domain's system prompt when it has one."""
    messages: list[Message] = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def task_id(domain_name: str, problem_key: str) -> str:
    return f"{domain_name}-{hashlib.sha1(problem_key.encode()).hexdigest()[:12]}"


def demo_sample(task: Task, answer: str, trace: str | None, source: str = "generated") -> SFTSample:
    """An SFT sample answering `task` with `answer`, its trace kept as metadata (rendered by the data room)."""
    return SFTSample(
        messages=[*task.messages, {"role": "assistant", "content": answer}],
        metadata=SampleMetadata(
            domain=task.domain,
            difficulty=task.difficulty,
            reasoning_trace=trace,
            source=source,
            extras={"task_id": task.id},
        ),
    )


def demo_conversation(task: Task, turns: list[Message], trace: str | None = None,
                      source: str = "generated", tools: list[dict[str, Any]] | None = None) -> SFTSample:
    """A multi-turn SFT sample: the task's messages, then `turns` (assistant tool calls, tool results, the answer).

    `tools` (the tool schemas the prompt showed, if any) is kept in the metadata so a tokenizer that renders
    tools in the prompt can render the demonstration the way the environment renders the episode.
    """
    extras: dict[str, Any] = {"task_id": task.id}
    if tools:
        extras["tools"] = tools
    return SFTSample(
        messages=[*task.messages, *turns],
        metadata=SampleMetadata(
            domain=task.domain, difficulty=task.difficulty, reasoning_trace=trace, source=source, extras=extras
        ),
    )


def tool_call_message(name: str, arguments: dict[str, Any], content: str = "") -> Message:
    """An assistant turn that calls one tool, in the Hugging Face message form."""
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def tool_result_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}


def task_records(path: str) -> Iterator[tuple[str, int, Any]]:
    """(where, row, record) for a JSONL file or a saved Hugging Face dataset directory (`posttrain.data`'s reader)."""
    try:
        for location, record in read_records(path):  # the reader's own format detection (JSONL, Parquet, CSV, ...)
            yield f"{path}:{location}", int(str(location).removeprefix("row ")), record
    except DataError as error:
        raise TaskError(str(error)) from None


# ---- tasks read from a file, by level (the `dataset` and `tasks` domains) ------------------------------------


def tasks_by_level(tasks: Iterable[Task], source: str) -> dict[int, list[Task]]:
    """A file's tasks grouped by difficulty: the levels a curriculum climbs. An empty file is an error."""
    by_level: dict[int, list[Task]] = {}
    for task in tasks:
        by_level.setdefault(task.difficulty, []).append(task)
    if not by_level:
        raise TaskError(f"{source}: no tasks (the file holds no records)")
    return by_level


def draw_task(by_level: dict[int, list[Task]], rng: random.Random, level: int, source: str) -> Task:
    """One task of `level`, as a copy the caller may mutate."""
    pool = by_level.get(level)
    if not pool:
        raise TaskError(f"{source}: no tasks at level {level} (levels: {sorted(by_level)})")
    return Task.from_dict(json.loads(json.dumps(rng.choice(pool).to_dict())))


def file_tasks(by_level: dict[int, list[Task]], split: str | None, heldout_fraction: float) -> list[Task]:
    """Every task of the file (of one split, if given), in file order: what an evaluation suite runs."""
    every = sorted((t for pool in by_level.values() for t in pool), key=lambda t: t.metadata["row"])
    if split is None:
        return every
    return [t for t in every if split_of(t.metadata["problem_key"], heldout_fraction) == split]
