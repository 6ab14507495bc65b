"""The blocks the recipes share: the loop skeleton, checkpoint save/resume, the local data-parallel seam — and
the rule that recipe modules are leaves (none imports another)."""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.config import OptimConfig, RLRecipe
from posttrain.models import build_tiny_model
from posttrain.train.checkpoint import find_checkpoint, open_run_dir, restore_training, save_training
from posttrain.train.loop import Cursor, StepFigures, train_loop
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.parallel import LOCAL, DataParallel, LocalParallel

SRC = Path(__file__).resolve().parents[1] / "src" / "posttrain"
RECIPES = {"posttrain.train.sft", "posttrain.train.dpo", "posttrain.train.reward_model", "posttrain.train.distill",
           "posttrain.rl.trainer"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_recipe_modules_are_leaves():
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        runs_recipes = module.startswith(("posttrain.cli", "posttrain.demo", "posttrain.distributed"))
        if runs_recipes or path.name == "__init__.py":
            continue  # the rooms that run recipes, and a package's public surface
        imported = imported_modules(path) & (RECIPES - {module})
        assert not imported, f"{module} imports the recipe module(s) {sorted(imported)}: move the shared part below"


@dataclass
class _Train:
    batch_size: int = 3
    max_minutes: float | None = None
    log_every: int = 2
    eval_every: int = 0
    save_every: int = 0


class _Tracker:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def start_progress(self, total, done=0):
        pass

    def advance(self, step, text):
        pass


class _Scheduler:
    def get_last_lr(self):
        return [0.5]


def test_the_loop_rolls_epochs_logs_window_means_and_saves(tmp_path):
    seen: list[list[int]] = []
    saves: list[int] = []
    cursor = Cursor()
    tracker = _Tracker()

    def step(items):
        seen.append(items)
        return StepFigures(loss=float(sum(items)), grad_norm=1.0, weight=len(items), tokens=10 * len(items),
                           sums={"loss": float(sum(items))})

    last = train_loop("test", _Train(save_every=2), cursor, 5, epoch_items=lambda epoch: [epoch * 10 + i for i in
                      range(4)], step=step, scheduler=_Scheduler(), tracker=tracker,
                      save=lambda: saves.append(cursor.step))
    # 4 items an epoch in steps of 3: a short last step, then the next epoch's order
    assert seen == [[0, 1, 2], [3], [10, 11, 12], [13], [20, 21, 22]]
    assert last == 63.0 and cursor.step == 5 and cursor.samples == 11 and cursor.tokens == 110
    assert (cursor.epoch, cursor.row) == (2, 3)
    assert saves == [2, 4]  # every save_every steps, never at the last (the recipe saves the end itself)
    steps = [step for step, _ in tracker.logged]
    assert steps == [2, 4, 5]
    assert tracker.logged[0][1]["train/loss"] == pytest.approx((0 + 1 + 2 + 3) / 4)  # weighted over the window
    assert tracker.logged[1][1]["train/epoch"] == pytest.approx(2.0)


def test_the_loop_stops_on_the_time_budget_and_on_evaluate_and_says_which():
    cursor = Cursor(train_seconds=61.0)
    figures = StepFigures(loss=1.0, grad_norm=0.0, weight=1, tokens=1)
    train_loop("test", _Train(max_minutes=1.0), cursor, 5, epoch_items=lambda e: [0, 1, 2], step=lambda _: figures,
               scheduler=_Scheduler(), tracker=_Tracker(), save=lambda: None)
    assert cursor.step == 0 and cursor.stopped_by == "time_cap"
    cursor = Cursor()
    calls = iter([False, True])
    train_loop("test", _Train(eval_every=1), cursor, 5, epoch_items=lambda e: [0, 1, 2], step=lambda _: figures,
               scheduler=_Scheduler(), tracker=_Tracker(), save=lambda: None, evaluate=lambda: next(calls))
    assert cursor.step == 2 and cursor.stopped_by == "early_stopping"
    cursor = Cursor()
    train_loop("test", _Train(max_minutes=60.0), cursor, 5, epoch_items=lambda e: [0, 1, 2], step=lambda _: figures,
               scheduler=_Scheduler(), tracker=_Tracker(), save=lambda: None)
    assert cursor.step == 5 and cursor.stopped_by == "steps"


def _train_two_steps(model, optimizer, scheduler):
    for _ in range(2):
        ids = torch.randint(0, 20, (2, 6))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_checkpoint_save_and_restore_are_exact(tmp_path, tiny_tokenizer):
    config = OptimConfig(lr=1e-2, warmup_steps=1)
    model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, 10)
    torch.manual_seed(0)
    _train_two_steps(model, optimizer, scheduler)
    cursor = Cursor(step=2, epoch=1, row=5)
    directory = save_training(tmp_path, model, tiny_tokenizer, optimizer=optimizer, scheduler=scheduler,
                              cursor=cursor, extra_state={"note": [1, 2]})
    assert directory.name == "step-000002"
    expected = (random.random(), float(np.random.rand()), torch.rand(3))  # the RNG streams after the save

    fresh = build_tiny_model("tiny-1m", tiny_tokenizer, seed=7)
    fresh_optimizer = build_optimizer(fresh, config)
    fresh_scheduler = build_scheduler(fresh_optimizer, config, 10)
    state = restore_training(find_checkpoint(tmp_path, "test"), "test", model=fresh, optimizer=fresh_optimizer,
                             scheduler=fresh_scheduler)
    assert Cursor(**state["cursor"]) == cursor and state["note"] == [1, 2]
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    # the next steps are the same
    torch.manual_seed(1)
    _train_two_steps(model, optimizer, scheduler)
    torch.manual_seed(1)
    _train_two_steps(fresh, fresh_optimizer, fresh_scheduler)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="reserved keys \\['cursor'\\]"):
        save_training(tmp_path, model, tiny_tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      extra_state={"cursor": 1})


def test_no_checkpoint_means_a_fresh_start(tmp_path, capsys):
    assert find_checkpoint(tmp_path, "sft") is None
    assert "no checkpoint" in capsys.readouterr().err


def test_local_parallel_is_the_identity_and_satisfies_the_protocol():
    parallel: DataParallel = LOCAL  # a type checker checks the Protocol; here the behaviour
    assert isinstance(parallel, LocalParallel) and parallel.rank == 0 and parallel.world_size == 1
    assert parallel.micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert parallel.all_gather((1.5, 2)) == [(1.5, 2)]
    model = torch.nn.Linear(2, 1)
    assert parallel.shard_model(model) is model and parallel.full_model(model) is model
    protocol = {name for name in vars(DataParallel) if not name.startswith("_")}
    assert protocol <= set(dir(LocalParallel))


def test_a_fresh_rl_run_moves_aside_the_episodes_and_events_of_an_earlier_run_with_no_checkpoint(tmp_path):
    """RL appends to episodes.jsonl and schedule_events.jsonl as to metrics.jsonl: a fresh run after one that died
    before its first checkpoint mixed both runs' episodes. The stage's logs move aside with the metrics."""
    from posttrain.rl.trainer import EPISODES_FILE, EVENTS_FILE

    run = tmp_path / "rl"
    run.mkdir()
    for name in ("metrics.jsonl", EPISODES_FILE, EVENTS_FILE):
        (run / name).write_text(f'{{"dead run": "{name}"}}\n')
    (run / "notes.txt").write_text("mine")  # not a log of the stage: stays
    open_run_dir(RLRecipe(output_dir=str(run)), "rl", resume=False, logs=(EPISODES_FILE, EVENTS_FILE))
    for name in ("metrics.jsonl", EPISODES_FILE, EVENTS_FILE):
        assert not (run / name).exists() and name in (run / "earlier-1" / name).read_text()
    assert (run / "notes.txt").read_text() == "mine" and (run / "recipe.yaml").is_file()
