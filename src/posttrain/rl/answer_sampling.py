"""Verified answers to task prompts on the built-in engine: the `train.distill.AnswerSampler` the distillation
recipe is given (it sits below `rollout` and `tasks`, so it cannot build one itself).

    sampler = EngineAnswerSampler(recipe.tasks, seed=recipe.runtime.seed)
    answers = sampler(teacher, tokenizer, role="teacher", count=256, draw=0)     # list[Trajectory], verified

Each call draws `count` fresh tasks of the configured domains (spread by weight, at their levels, from `split`),
seeded by (seed, draw, domain), and runs one episode per task and sample through `envs.run_episodes`, so every
answer is judged by its task's own verifier, as in RL and eval. One `HFEngine` per role: the teacher's runs on the
teacher model itself (frozen); the student's on a copy, into which the student's current weights are pushed on
every call (version = draw), so an on-policy sample always comes from the weights being trained.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from posttrain.config import DistillTasksConfig
from posttrain.envs import run_episodes
from posttrain.models import is_lora, merged_copy
from posttrain.rollout import HFEngine, state_for_engine
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.types import SamplingParams, Task, Trajectory


class EngineAnswerSampler:
    def __init__(self, tasks: DistillTasksConfig, *, seed: int = 0, autocast: torch.dtype | None = None):
        self.config, self.seed, self.autocast = tasks, seed, autocast
        self.domains = [(spec, get_domain(spec.name, **spec.args)) for spec in tasks.domains]
        self._engines: dict[str, HFEngine] = {}

    def tasks(self, count: int, draw: int, split: str = "train") -> list[Task]:
        """`count` tasks spread over the domains by weight (largest remainders first), deterministic in the draw."""
        weights = [spec.weight for spec, _ in self.domains]
        shares = [count * w / max(sum(weights), 1e-12) for w in weights]
        counts = [int(share) for share in shares]
        for index in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: count - sum(counts)]:
            counts[index] += 1
        drawn: list[Task] = []
        for index, ((spec, domain), share) in enumerate(zip(self.domains, counts)):
            if not share:
                continue
            seed = self.seed * 1_000_003 + draw * 101 + index
            try:
                drawn += sample_tasks(domain, share, level=spec.levels, split=split, seed=seed)
            except TaskError:
                # Levels with fewer distinct problems than asked for (level 1 of arithmetic: ~10 held out):
                # repeats are still fresh samples of the answer, so draw with replacement.
                drawn += sample_tasks(domain, share, level=spec.levels, split=split, seed=seed, unique=False)
        return drawn

    def __call__(self, model: torch.nn.Module, tokenizer: Any, *, role: str, count: int, draw: int, n: int = 1,
                 split: str = "train") -> list[Trajectory]:
        engine = self._engine(role, model, tokenizer)
        if role == "student":
            engine.update_weights(state_for_engine(model), version=draw)
        sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                                  seed=self.seed * 1_000_003 + draw)
        return run_episodes(engine, self.tasks(count, draw, split), tokenizer, sampling, n=n)

    def _engine(self, role: str, model: torch.nn.Module, tokenizer: Any) -> HFEngine:
        if role not in self._engines:
            if role == "teacher":
                own = model  # frozen: the engine may share it with the loss
            else:
                own = merged_copy(model) if is_lora(model) else copy.deepcopy(model)
            self._engines[role] = HFEngine(own, tokenizer, autocast=self.autocast,
                                           max_batch_size=self.config.engine_batch_size)
        return self._engines[role]
