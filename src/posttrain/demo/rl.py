"""Demo stages `rl` and `sft_control`: RL on fresh verifiable tasks, and the honest control for it.

`rl` starts from the newest trained model (after DPO when that stage ran, else after SFT; `rl_from: sft`: from
SFT even after DPO) and trains on
tasks generated fresh every step and scored by the domains' verifiers — no demonstrations — for
`rl.train.max_steps` steps. Domains that measure lengths in tokens get the policy's tokenizer. `sft_control`
continues SFT from the SFT checkpoint on the *same* demonstrations, at the learning rate SFT ended with, for the
same training compute as RL: if RL's gain were only "more training", the control would match it.

The compute is counted in FLOPs, the usual 2N per token through a forward and 6N per token through a forward
and a backward (N parameters, attention ignored; the model is the same, so N cancels): RL spends 2N on every
token the engine sampled or read (every episode of every group, the filtered ones too) and 6N on every token of
the trajectories it trained on, and of the forgetting guard's replayed demonstrations; the control gets as many
SFT steps as make up that many forward-and-backward tokens, at the tokens per step SFT itself took. Both are
counts of a seeded run, so the control's steps are the same on every machine; the minutes in the recipe are
only a safety cap (it warns when it cuts a stage short).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from posttrain.demo.base import SFT_FILE, counts_tokens, domain_args, write_guard_items
from posttrain.demo.pipeline import DemoRun, demo_stage, source
from posttrain.demo.sft import evaluate_stage


@demo_stage("rl")
def rl(run: DemoRun) -> dict[str, Any]:
    from posttrain.rl import run_rl

    started_from, policy = rl_start(run)
    recipe = run.recipe.rl.model_copy(deep=True)
    recipe.output_dir = str(run.root / "rl")
    recipe.model.path = str(policy)
    recipe.runtime.seed = run.recipe.seed
    for spec in recipe.domains:  # long-context domains measure their lengths in the policy's own tokens
        if counts_tokens(spec):
            spec.args = {**spec.args, "tokenizer": str(policy)}
    watched = guard_suites(run, recipe, tokenizer=str(policy))
    recipe.schedule.guard.suites = [*recipe.schedule.guard.suites, *watched]
    result = run_rl(recipe, resume=run.resume)
    last = result.history[-1] if result.history else {}
    return evaluate_stage(run, result.final_dir, seconds=result.seconds, steps=result.steps, started_from=started_from,
                          stopped_by=result.stopped_by, final_train_reward=round(last.get("reward/mean", 0.0), 4),
                          curriculum=result.curriculum, mix_trained=result.mix_trained,
                          compute=rl_compute(result.history), judging=judging_share(result.history),
                          **({"guard": guard_figures(result, watched)} if watched else {}))


def guard_suites(run: DemoRun, recipe, tokenizer: str | None = None) -> list:
    """The forgetting guard's suites for the domains SFT trained and RL (`recipe`) does not: each domain's guard
    items (`demo.base.write_guard_items`), named by the domain, replaying demonstrations at the levels SFT's
    demonstrations had. Those domains are outside RL's mix, so a regression replays (``action: replay`` or
    ``both``) and boosts nothing: there is no share to boost (``action: weight`` only logs it)."""
    from posttrain.config import RegressionSuite

    taken = {suite.name for suite in recipe.schedule.guard.suites}
    specs = {spec.name: spec for spec in run.recipe.domains}
    suites = []
    for name, path in write_guard_items(run, {spec.name for spec in recipe.domains}, tokenizer).items():
        if name in taken:  # the recipe's own suite of that name wins
            continue
        spec = specs[name]
        levels = sorted({*spec.sft_levels, *(level for level, count in spec.level_demos.items() if count)})
        suites.append(RegressionSuite(name=name, path=str(path), domain=name, args=domain_args(spec, tokenizer),
                                      levels=levels))
    return suites


def guard_figures(result, suites: list) -> dict[str, Any]:
    """What the guard saw of the demo's suites: items per suite, every evaluation's pass rates (baseline, every N
    steps, final) with its seconds, the regression and recovery events, and the demonstrations it replayed."""
    names = [suite.name for suite in suites]
    counts = {suite.name: sum(1 for line in Path(suite.path).read_text().splitlines() if line.strip())
              for suite in suites}
    evaluations = [{"step": int(e["step"]), "seconds": round(e["seconds"], 3), "final": bool(e.get("final")),
                    "pass_rate": {name: e[f"regression/{name}"] for name in names if f"regression/{name}" in e}}
                   for e in result.evaluations]
    return {"items": counts, "evaluations": evaluations,
            "eval_seconds": round(sum(e["seconds"] for e in result.evaluations), 3),
            "events": [e for e in result.events if e.get("suite") in names],
            "replay_samples": int(sum(m.get("guard/replay_samples", 0.0) for m in result.history)),
            "replay_tokens": int(sum(m.get("guard/replay_tokens", 0.0) for m in result.history))}


def rl_start(run: DemoRun) -> tuple[str, Path]:
    """The stage RL starts from and its model: the newest of DPO and SFT, or SFT's with ``rl_from: sft``."""
    return run.latest_policy(("sft",) if run.recipe.rl_from == "sft" else ("dpo", "sft"))


def rl_compute(history: list[dict[str, float]]) -> dict[str, float]:
    """RL's compute over the run, in tokens: sampled (one forward each), trained (forward and backward: the
    policy's trajectories and the guard's replayed demonstrations), and the total as forward-and-backward token
    equivalents (2N + 6N per token -> tokens x 2/6 + tokens)."""
    sampled = sum(m.get("tokens/sampled", 0.0) for m in history)
    trained = sum(m.get("tokens/trained", 0.0) + m.get("guard/replay_tokens", 0.0) for m in history)
    return {"sampled_tokens": int(sampled), "trained_tokens": int(trained),
            "train_token_equivalents": int(round(sampled * 2 / 6 + trained))}


def judging_share(history: list[dict[str, float]]) -> dict[str, float]:
    """The share of RL's step time its verifiers were busy (wall time, concurrent judgements counted once),
    over all domains and per domain: for `code`, the sandbox's share of the step."""
    step_s = sum(m.get("time/step_s", 0.0) for m in history)
    keys = sorted({k for m in history for k in m if k.startswith("time/judge_s")})
    shares = {}
    for key in keys:
        name = key.removeprefix("time/judge_s").removeprefix("/") or "all"
        shares[name] = round(sum(m.get(key, 0.0) for m in history) / step_s, 4) if step_s else 0.0
    return {"step_seconds": round(step_s, 1), "share": shares}


@demo_stage("sft_control")
def sft_control(run: DemoRun) -> dict[str, Any]:
    from posttrain.train import run_sft

    rl_compute_figures = run.summary["stages"].get("rl", {}).get("compute")
    sft_figures = run.summary["stages"].get("sft", {})
    if rl_compute_figures is None or not sft_figures.get("tokens_per_step"):
        from posttrain.types import PosttrainError

        raise PosttrainError("demo: sft_control matches the RL stage's compute; put it after 'sft' and 'rl' in stages")
    steps = control_steps(rl_compute_figures["train_token_equivalents"], sft_figures["tokens_per_step"])
    recipe = run.recipe.sft.model_copy(deep=True)
    recipe.output_dir = str(run.root / "sft_control")
    recipe.model.path = str(run.model_after("sft"))
    recipe.data.train = [source(run.data_dir / SFT_FILE)]
    recipe.runtime.seed = run.recipe.seed + 1  # a new epoch order, not a replay of SFT's
    recipe.optim.lr = recipe.optim.lr * recipe.optim.min_lr_ratio  # where SFT's schedule ended
    recipe.optim.schedule, recipe.optim.warmup_steps = "constant", 0
    recipe.train.max_steps = steps
    recipe.train.eval_every = None  # no early stopping: the control gets all of RL's compute
    recipe.train.max_minutes = run.recipe.rl.train.max_minutes  # the same safety cap as RL
    result = run_sft(recipe, resume=run.resume)
    return evaluate_stage(run, result.final_dir, seconds=result.seconds, steps=result.steps,
                          stopped_by=result.stopped_by,
                          compute={"trained_tokens": result.tokens, "train_token_equivalents": result.tokens,
                                   "matched": rl_compute_figures["train_token_equivalents"]})


def control_steps(train_token_equivalents: float, tokens_per_step: float) -> int:
    """SFT steps that make up RL's compute at SFT's own tokens per step (at least one)."""
    return max(1, math.ceil(train_token_equivalents / tokens_per_step))
