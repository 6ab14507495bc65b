"""The distillation recipe, top to bottom: recipe -> teacher + student (one tokenizer) -> data -> loop -> checkpoint.

    posttrain distill recipe.yaml teacher.path=runs/rl/final [--resume]

Three modes (`config.distill`; the divergences and their formulas in `train.distill_losses`):

- ``logit``: the student learns the teacher's whole next-token distribution at every completion token (the
  assistant tokens of SFT data, or the teacher's own sampled answers to task prompts); loss = the divergence
  summed over those tokens / their count, as the SFT loss is normalized.
- ``on_policy`` (GKD, Agarwal et al. 2024): each step the student samples answers to fresh task prompts with the
  built-in engine, the teacher scores every sampled token, and the divergence is taken on the student's own
  samples; a `data_fraction` of each batch comes from SFT data instead (GKD's λ = 1 - data_fraction). As in GKD
  no gradient flows through the sampling: the samples are data, re-drawn each step from the current student.
- ``sequence`` (Kim & Rush, 2016): the teacher answers task prompts, the task's verifier judges each answer, and
  the verified ones become SFT data (``sequence_sft.jsonl`` in the run directory, usable with `posttrain sft`);
  the student is fine-tuned on them with the SFT cross-entropy, through the same data pipeline SFT uses.

Every mode reports the student's distance to the teacher on held-out completions: ``eval/kl`` (forward KL at
temperature 1, per token) and ``eval/agreement`` (how often the student's top token is the teacher's), at the
start, every `train.eval_every` steps and at the end. The held-out completions are the data's held-out rows, else
the teacher's answers to held-out-split task prompts.

`train` sits below `rollout` and `tasks`, so the recipe takes task answers from an `AnswerSampler` it is
given (`posttrain.rl.EngineAnswerSampler`, on the built-in engine; `posttrain distill` and the demo pass one).
A resumed run is exact: the teacher's answers are re-drawn with the same seeds, the student's on-policy samples
are seeded by the step, and the checkpoint holds the optimizer, schedule, RNG and cursor (`train.checkpoint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from posttrain.config import ConfigError, DataSource, DistillRecipe
from posttrain.data import Row, collate, episodes_to_sft, model_inputs, prepare_sft_data, write_records
from posttrain.models import (
    check_same_tokenizer,
    count_parameters,
    load_model,
    load_tokenizer,
    load_weights_from_checkpoint,
    save_model_dir,
)
from posttrain.tracking import Tracker, say
from posttrain.train.checkpoint import find_checkpoint, open_run_dir, restore_training, save_training
from posttrain.train.distill_losses import forward_kl, token_divergence
from posttrain.train.forward import selected_logits
from posttrain.train.losses import sft_loss_sum
from posttrain.train.loop import Cursor, StepFigures, count_items, train_loop
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.step import Runtime, optimizer_step, prepare_model, setup_runtime
from posttrain.types import Trajectory

SEQUENCE_FILE = "sequence_sft.jsonl"
TEACHER_FILE = "teacher_answers.jsonl"
HELDOUT_PROMPTS = 64  # held-out task prompts the teacher answers for eval/kl when the data has no held-out rows


class AnswerSampler(Protocol):
    """Verified answers of `model` to `count` task prompts of `split`, `n` per prompt, as trajectories.

    `draw` picks the prompts and the sampling seed (the same draw gives the same prompts and, for the same weights,
    the same answers); `role` is "teacher" or "student" (a sampler keeps one engine per role and pushes the
    student's current weights into its engine on every call)."""

    def __call__(self, model: torch.nn.Module, tokenizer: Any, *, role: str, count: int, draw: int, n: int = 1,
                 split: str = "train") -> list[Trajectory]: ...


@dataclass
class DistillResult:
    output_dir: Path
    final_dir: Path
    mode: str
    steps: int
    seconds: float
    tokens_per_s: float
    train_loss: float
    heldout_start: dict[str, float] = field(default_factory=dict)  # eval/kl, eval/agreement before training
    heldout: dict[str, float] = field(default_factory=dict)  # ... and after
    teacher_answers: dict[str, int] = field(default_factory=dict)  # sampled, verified (task-based modes)


def run_distill(
    recipe: DistillRecipe,
    *,
    resume: bool = False,
    sampler: AnswerSampler | None = None,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> DistillResult:
    recipe.check_sources()
    if recipe.tasks.domains and sampler is None:
        raise ConfigError("tasks.domains: task prompts need an AnswerSampler (posttrain distill passes one; in a "
                          "library call pass sampler=posttrain.rl.EngineAnswerSampler(recipe.tasks))")
    output_dir = open_run_dir(recipe, "distill", resume)
    runtime = setup_runtime(recipe.runtime)

    # Teacher and student, one tokenizer. A student without a path is built on the teacher's tokenizer.
    student_config = recipe.model
    if student_config.path is None and student_config.tokenizer_path is None:
        student_config = student_config.model_copy(update={"tokenizer_path": recipe.teacher.path})
    teacher_tokenizer = load_tokenizer(recipe.teacher)
    tokenizer = load_tokenizer(student_config)
    check_same_tokenizer(teacher_tokenizer, tokenizer, names=("teacher", "student"),
                         where=(recipe.teacher.path, student_config.path or student_config.tokenizer_path),
                         fix="Distillation compares the two next-token distributions id by id: build the student "
                             "on the teacher's tokenizer (leave model.path unset, or set model.tokenizer_path to "
                             "the teacher's directory)")
    teacher = load_model(recipe.teacher, tokenizer, runtime.device).eval().requires_grad_(False)
    student = prepare_model(load_model(student_config, tokenizer, runtime.device), recipe.model, recipe.runtime)
    checkpoint = find_checkpoint(output_dir, "distill") if resume else None
    if checkpoint is not None:
        load_weights_from_checkpoint(student, checkpoint)
    vocab = len(tokenizer)  # both heads are compared over the tokenizer's ids (an embedding may be padded past them)

    # Data: what the student trains on, and the held-out completions its distance to the teacher is measured on.
    seed = recipe.runtime.seed
    teacher_counts: dict[str, int] = {}
    data_rows: Callable[[int], Sequence[Any]] | None = None
    heldout_rows: list[Row] = []
    if recipe.data.train:
        prepared = prepare_sft_data(recipe.data, tokenizer, seed=seed, rejects_dir=output_dir)
        data_rows, heldout_rows = prepared.epoch_rows, prepared.heldout_rows()
    if recipe.mode == "logit" and recipe.tasks.domains:
        answers = sampler(teacher, tokenizer, role="teacher", count=recipe.tasks.prompts, draw=0)
        write_records(output_dir / TEACHER_FILE, _transcripts(answers))
        teacher_counts = {"sampled": len(answers), "verified": sum(t.reward.passed for t in answers)}
        rows = [_row(t, recipe.data.max_length) for t in answers]
        data_rows = lambda epoch: _shuffled(rows, seed, epoch)  # noqa: E731
    elif recipe.mode == "sequence":
        answers = sampler(teacher, tokenizer, role="teacher", count=recipe.tasks.prompts, draw=0,
                          n=recipe.tasks.samples_per_prompt)
        records = episodes_to_sft([_episode(t) for t in answers], source="teacher")
        teacher_counts = {"sampled": len(answers), "verified": sum(t.reward.passed for t in answers),
                          "sft_samples": len(records)}
        if not records:
            raise ConfigError(f"mode sequence: none of the teacher's {len(answers)} answers passed its verifier, so "
                              "there is no SFT data (a stronger teacher, more tasks.prompts or samples_per_prompt)")
        write_records(output_dir / SEQUENCE_FILE, records)
        sequence_data = recipe.data.model_copy(update={"train": [DataSource(path=str(output_dir / SEQUENCE_FILE))]})
        prepared = prepare_sft_data(sequence_data, tokenizer, seed=seed, rejects_dir=output_dir)
        data_rows = prepared.epoch_rows
        heldout_rows = prepared.heldout_rows() or heldout_rows
    if not heldout_rows and recipe.tasks.domains:
        probes = sampler(teacher, tokenizer, role="teacher", count=HELDOUT_PROMPTS, draw=0, split="heldout")
        heldout_rows = [_row(t, recipe.data.max_length) for t in probes]

    batch_size = recipe.train.batch_size
    if recipe.mode == "on_policy":
        total_steps = recipe.train.max_steps
        epoch_items = lambda epoch: range(total_steps * batch_size)  # noqa: E731  (slots; samples come per step)
    else:
        total_steps = recipe.train.max_steps or math.ceil(
            recipe.train.epochs * max(1, math.ceil(count_items(data_rows(0)) / batch_size)))
        epoch_items = data_rows
    optimizer = build_optimizer(student, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)
    state = restore_training(checkpoint, "distill", optimizer=optimizer, scheduler=scheduler) if checkpoint else None
    cursor = Cursor(**state["cursor"]) if state else Cursor()

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="distill")
    say(f"[distill] {recipe.mode}: student {count_parameters(student):,} parameters, teacher "
        f"{count_parameters(teacher):,}; {total_steps} steps, {runtime.precision} on {runtime.device}"
        + (f"; teacher answers: {teacher_counts}" if teacher_counts else ""))
    if teacher_counts and cursor.step == 0:
        tracker.log({f"teacher/{k}": v for k, v in teacher_counts.items()}, step=0)

    def measure() -> dict[str, float]:
        metrics = teacher_distance(student, teacher, heldout_rows, tokenizer.pad_token_id, runtime, batch_size,
                                   vocab) if heldout_rows else {}
        if evaluate is not None:
            metrics.update({f"eval/{k}": v for k, v in evaluate(student).items()})
        student.train()
        return metrics

    heldout_start = state["heldout_start"] if state else measure()
    if not state and heldout_start:
        tracker.log(heldout_start, step=0)

    def student_samples(count: int) -> list[Row]:
        """This step's on-policy rows: the student's answers to fresh prompts, seeded by the step."""
        answers = sampler(student, tokenizer, role="student", count=count, draw=cursor.step + 1)
        student.train()
        return [_row(t, recipe.data.max_length) for t in answers]

    def step(items: list) -> StepFigures:
        if recipe.mode == "on_policy":
            from_data = round(recipe.distill.data_fraction * len(items))
            rows = student_samples(len(items) - from_data)
            if from_data:
                pool = data_rows(0)
                rows += [pool[(cursor.step * from_data + i) % len(pool)] for i in range(from_data)]
            items = rows
        return _distill_step(student, teacher, items, recipe, tokenizer.pad_token_id, optimizer, scheduler, runtime,
                             vocab)

    def save() -> None:
        save_training(output_dir, student, tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=recipe.train.keep_checkpoints, extra_state={"heldout_start": heldout_start})

    def evaluate_and_log() -> bool:
        tracker.log(measure(), step=cursor.step)
        return False

    student.train()
    train_loss = train_loop(
        "distill", recipe.train, cursor, total_steps, epoch_items=epoch_items, step=step, scheduler=scheduler,
        tracker=tracker, save=save, evaluate=evaluate_and_log if (heldout_rows or evaluate) else None,
        on_step=on_step, progress=lambda m: f"loss {m['train/loss']:.4f} {m['train/tokens_per_s']:,.0f} tok/s",
    )
    heldout = measure()
    if heldout:
        tracker.log(heldout, step=cursor.step)
    save()
    final_dir = output_dir / "final"
    save_model_dir(final_dir, student, tokenizer, merge_lora=recipe.model.lora.merge_on_save)
    tracker.close()
    return DistillResult(
        output_dir=output_dir, final_dir=final_dir, mode=recipe.mode, steps=cursor.step, seconds=cursor.train_seconds,
        tokens_per_s=cursor.tokens / max(cursor.train_seconds, 1e-9), train_loss=train_loss,
        heldout_start=heldout_start, heldout=heldout, teacher_answers=teacher_counts,
    )


def _distill_step(student, teacher, rows: list[Row], recipe: DistillRecipe, pad_id: int, optimizer, scheduler,
                  runtime: Runtime, vocab: int) -> StepFigures:
    """One optimizer step over `rows`, in micro-batches; the loss summed over the step's scored tokens and divided
    by their count (the SFT normalization), gradients accumulated."""
    micro = recipe.train.micro_batch_size or recipe.train.batch_size
    batches = [collate(rows[i : i + micro], pad_id, device=runtime.device) for i in range(0, len(rows), micro)]
    scored = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    loss_sum, kl_sum, agree_sum, tokens = 0.0, 0.0, 0.0, 0
    for batch in batches:
        with runtime.autocast():
            if recipe.mode == "sequence":
                summed, _ = sft_loss_sum(student, batch)
                stats = None
            else:
                student_logits, teacher_logits = _scored_logits(student, teacher, batch, vocab)
                summed = token_divergence(recipe.distill.loss, student_logits, teacher_logits,
                                          beta=recipe.distill.beta, temperature=recipe.distill.temperature).sum()
                stats = _distance_sums(student_logits.detach(), teacher_logits)
        (summed / max(scored, 1)).backward()
        loss_sum += float(summed.detach())
        if stats is not None:
            kl_sum, agree_sum = kl_sum + stats[0], agree_sum + stats[1]
        tokens += batch["num_tokens"]
    grad_norm = optimizer_step(student, optimizer, scheduler, recipe.optim.max_grad_norm)
    sums = {"loss": loss_sum}
    if recipe.mode != "sequence":
        sums.update({"kl": kl_sum, "agreement": agree_sum})
    return StepFigures(loss=loss_sum / max(scored, 1), grad_norm=grad_norm, weight=scored, tokens=tokens, sums=sums)


def _scored_logits(student, teacher, batch: dict[str, Any], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Student (with gradient) and teacher (without) logits ``[N, vocab]`` at the positions whose next token is
    trained: the completion / assistant tokens."""
    inputs = model_inputs(batch)
    labels = inputs.pop("labels")
    input_ids = inputs.pop("input_ids")
    select = labels[:, 1:] != -100
    with torch.no_grad():
        teacher_logits = selected_logits(teacher, input_ids, select, **inputs)[:, :vocab]
    return selected_logits(student, input_ids, select, **inputs)[:, :vocab], teacher_logits


def _distance_sums(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[float, float]:
    """Summed forward KL (temperature 1) and summed top-1 agreement over the rows."""
    kl = float(forward_kl(student_logits, teacher_logits).sum())
    agree = float((student_logits.argmax(-1) == teacher_logits.argmax(-1)).sum())
    return kl, agree


@torch.no_grad()
def teacher_distance(student, teacher, rows: Sequence[Row], pad_id: int, runtime: Runtime, batch_size: int,
                     vocab: int) -> dict[str, float]:
    """``eval/kl`` (mean forward KL(teacher ‖ student) per completion token, temperature 1) and ``eval/agreement``
    (the share of those tokens where both models' most likely next token is the same) over `rows`."""
    student.eval()
    kl, agree, count = 0.0, 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = collate(list(rows[start : start + batch_size]), pad_id, device=runtime.device)
        with runtime.autocast():
            student_logits, teacher_logits = _scored_logits(student, teacher, batch, vocab)
        sums = _distance_sums(student_logits, teacher_logits)
        kl, agree, count = kl + sums[0], agree + sums[1], count + student_logits.shape[0]
    return {"eval/kl": kl / max(count, 1), "eval/agreement": agree / max(count, 1)}


def _row(trajectory: Trajectory, max_length: int) -> Row:
    """A trajectory as one training row: the exact sampled ids (never re-tokenized), its own tokens trained."""
    ids, mask = trajectory.token_ids[:max_length], trajectory.loss_mask[:max_length]
    return Row(input_ids=list(ids), loss_mask=list(mask), position_ids=list(range(len(ids))),
               document_ids=[0] * len(ids))


def _shuffled(rows: list[Row], seed: int, epoch: int) -> list[Row]:
    order = np.random.default_rng([seed % (1 << 64), epoch, 0xD157]).permutation(len(rows))
    return [rows[int(i)] for i in order]


def _episode(trajectory: Trajectory) -> dict[str, Any]:
    """The episode-record fields the data flywheel (`data.episodes_to_sft`) reads."""
    return {"task_id": trajectory.task_id, "domain": trajectory.domain, "difficulty": trajectory.difficulty,
            "passed": trajectory.reward.passed, "failure": trajectory.reward.failure.value,
            "messages": trajectory.messages}


def _transcripts(answers: list[Trajectory]) -> list[dict[str, Any]]:
    return [{**_episode(t), "score": t.reward.score} for t in answers]
