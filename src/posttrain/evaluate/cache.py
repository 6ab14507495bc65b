"""The episode cache: an evaluation does not sample again what it already sampled for the same checkpoint.

An episode is a function of the checkpoint (its files), how it is run (device, precision, engine settings), the
task (as judged: prompt, verifier and its arguments, timeout after `timeout_scale`) and the sampling (greedy, or
temperature / top-p / top-k / seed and `n`). The cache keys each item's episodes by exactly those, so a second
evaluation of an unchanged checkpoint on an unchanged item reuses them: `posttrain eval` run again with one
checkpoint added samples only that one; the demo's report reuses what each stage measured on the fixed held-out
sets. Turned on by `EvalRuntime.episode_cache` (a directory).

What it does not see, and so never reuses wrongly only while these hold:
- A verifier's *code*. Its name and arguments are in the key; a changed reward function under the same name is not.
  The cache is per posttrain version, and a user's own verifier changing means clearing the directory.
- Float noise from batching. Greedy decoding of a padded batch can break a near-tie differently at another batch
  size; the cache treats the episode as the same (the batch size is not in the key).
Never cached: an item whose episodes include an infrastructure failure (it is retried next time, as always), an
image prompt (its tensors are not kept), a policy without a checkpoint directory (a model still training).

Layout: ``<directory>/<checkpoint key>.jsonl``, one line per item and kind: ``{"key", "trajectories"}``.
The checkpoint key hashes every file's name, size and content (files above `HASH_LIMIT_BYTES`: name, size and
modification time, so a multi-gigabyte shard is not read whole).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from posttrain.chat import first_image_message
from posttrain.types import Task, Trajectory

FORMAT = 1
HASH_LIMIT_BYTES = 256 << 20
CHUNK_BYTES = 1 << 20


def checkpoint_key(path: str | Path, settings: dict[str, Any]) -> str | None:
    """A key for the checkpoint at `path` run with `settings` (JSON-able: device, precision, engine); None when
    `path` is not a directory."""
    root = Path(path)
    if not root.is_dir():
        return None
    from posttrain import __version__

    digest = hashlib.sha256(json.dumps({"format": FORMAT, "posttrain": __version__, "settings": settings},
                                       sort_keys=True, default=str).encode())
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root))):
        stat = file.stat()
        digest.update(f"{file.relative_to(root).as_posix()}\0{stat.st_size}\0".encode())
        if stat.st_size > HASH_LIMIT_BYTES:
            digest.update(str(stat.st_mtime_ns).encode())
            continue
        with file.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def item_key(task: Task, kind: str, sampling: dict[str, Any]) -> str:
    """The key of one item's episodes of one kind ("greedy" or "sampled") under `sampling`'s settings."""
    payload = json.dumps({"task": task.to_dict(), "kind": kind, "sampling": sampling}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def cacheable(task: Task) -> bool:
    return first_image_message(task.messages) is None


class EpisodeCache:
    """One checkpoint's cached episodes: `get` an item's, `put` new ones (appended to its file at once)."""

    def __init__(self, directory: str | Path, checkpoint: str):
        self.path = Path(directory) / f"{checkpoint}.jsonl"
        self._entries: dict[str, list[dict[str, Any]]] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self._entries[entry["key"]] = entry["trajectories"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash: that item is sampled again

    def get(self, key: str) -> list[Trajectory] | None:
        stored = self._entries.get(key)
        return None if stored is None else [Trajectory.from_dict(data) for data in stored]

    def put(self, entries: Sequence[tuple[str, Sequence[Trajectory]]]) -> None:
        """Store each (key, episodes) whose episodes hold no infrastructure failure."""
        lines = []
        for key, trajectories in entries:
            if not trajectories or any(t.reward.is_infrastructure_failure for t in trajectories):
                continue
            stored = [t.to_dict() for t in trajectories]
            self._entries[key] = stored
            lines.append(json.dumps({"key": key, "trajectories": stored}, separators=(",", ":")) + "\n")
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("".join(lines))
                handle.flush()
                os.fsync(handle.fileno())


class CachedItems:
    """The cache's side of one `run_items` call: each item's cached greedy episode and sampled ones (None: to
    sample), `hits` (episodes found), and `store` to fill in what was sampled and keep it. Only the kinds the run
    asks for are looked up; without a cache (off, or a policy with no checkpoint directory or no `settings`)
    every slot is None."""

    def __init__(self, tasks: Sequence[Task], cache: EpisodeCache | None = None,
                 greedy_key: dict[str, Any] | None = None, sampled_key: dict[str, Any] | None = None):
        self.cache = cache
        self.greedy: list[Trajectory | None] = [None] * len(tasks)
        self.sampled: list[list[Trajectory] | None] = [None] * len(tasks)
        self._greedy_keys: list[str | None] = [None] * len(tasks)
        self._sampled_keys: list[str | None] = [None] * len(tasks)
        for index, task in enumerate(tasks):
            if cache is None or not cacheable(task):
                continue
            if greedy_key is not None:
                self._greedy_keys[index] = item_key(task, "greedy", greedy_key)
                found = cache.get(self._greedy_keys[index])
                self.greedy[index] = found[0] if found else None
            if sampled_key is not None:
                self._sampled_keys[index] = item_key(task, "sampled", sampled_key)
                self.sampled[index] = cache.get(self._sampled_keys[index])
        self.hits = sum(t is not None for t in self.greedy) + sum(len(s) for s in self.sampled if s)

    @classmethod
    def open(cls, directory: str | None, path: str, settings: dict[str, Any] | None, sampling: Any,
             tasks: Sequence[Task]) -> CachedItems:
        """`sampling` is the run's `EvalSampling`; `path` and `settings` the policy's (`Policy.settings`)."""
        checkpoint = checkpoint_key(path, settings) if directory and settings is not None else None
        if checkpoint is None:
            return cls(tasks)
        greedy = {"max_new_tokens": sampling.max_new_tokens} if sampling.greedy else None
        sampled = ({"max_new_tokens": sampling.max_new_tokens, "n": sampling.n, "temperature": sampling.temperature,
                    "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed} if sampling.n else None)
        return cls(tasks, EpisodeCache(directory, checkpoint), greedy, sampled)

    def store(self, greedy_todo: list[int], greedy: list[Trajectory] | None, sampled_todo: list[int],
              samples: list[Trajectory] | None, n: int) -> None:
        entries = []
        for position, index in enumerate(greedy_todo):
            self.greedy[index] = greedy[position]
            if self._greedy_keys[index]:
                entries.append((self._greedy_keys[index], [greedy[position]]))
        for position, index in enumerate(sampled_todo):
            self.sampled[index] = samples[position * n:(position + 1) * n]
            if self._sampled_keys[index]:
                entries.append((self._sampled_keys[index], self.sampled[index]))
        if self.cache is not None:
            self.cache.put(entries)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)
