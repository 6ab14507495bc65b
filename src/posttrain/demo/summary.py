"""The demo's closing figures beside the accuracy table: pass@1 and pass@k per level of the sampled domains (code),
why each stage stopped, RL's compute against the control's, and the share of RL's step time spent judging."""

from __future__ import annotations

from typing import Any

from posttrain.tracking import console, say


def print_details(summary: dict[str, Any]) -> None:
    from rich.table import Table

    stages = summary.get("stages", {})
    sampled = {stage: figures["pass_at_k_by_level"] for stage, figures in stages.items()
               if figures.get("pass_at_k_by_level")}
    for domain in sorted({d for per_stage in sampled.values() for d in per_stage}):
        rows = [(stage, level, values) for stage, per_stage in sampled.items()
                for level, values in sorted(per_stage.get(domain, {}).items())]
        keys = sorted({k for _, _, values in rows for k in values}, key=lambda k: int(k.split("@")[1]))
        table = Table(title=f"{domain}: held-out pass@k by level (sampled)")
        for column in ("stage", "level", *keys):
            table.add_column(column, justify="left" if column == "stage" else "right")
        for stage, level, values in rows:
            table.add_row(stage, level, *[f"{values[k]:.1%}" if values.get(k) is not None else "-" for k in keys])
        console.print(table)
    for stage, figures in stages.items():
        if figures.get("stopped_by"):
            say(f"[demo] {stage}: {figures.get('steps', '?')} steps, stopped by {figures['stopped_by']}"
                + (" (WARNING: a time cap; the figures depend on this machine)"
                   if figures["stopped_by"] == "time_cap" else ""))
    rl, control = stages.get("rl", {}), stages.get("sft_control", {})
    if rl.get("compute"):
        compute = rl["compute"]
        say(f"[demo] rl compute: {compute['sampled_tokens']:,} tokens sampled + {compute['trained_tokens']:,} trained"
            f" = {compute['train_token_equivalents']:,} forward-and-backward token equivalents"
            + (f"; the control trained on {control['compute']['trained_tokens']:,} tokens in {control.get('steps')}"
               " steps" if control.get("compute") else ""))
    if rl.get("judging"):
        shares = ", ".join(f"{name} {share:.1%}" for name, share in sorted(rl["judging"]["share"].items()))
        say(f"[demo] rl: share of the step time spent judging (wall, concurrent judgements once): {shares}"
            f" of {rl['judging']['step_seconds']:.0f} s")
    if rl.get("guard"):
        _print_guard(rl["guard"])


def _print_guard(guard: dict[str, Any]) -> None:
    """What RL's forgetting guard watched (the domains only SFT trained): first and last pass rate per domain,
    its regressions and what they cost."""
    evaluations = guard["evaluations"]
    first, last = (evaluations[0]["pass_rate"], evaluations[-1]["pass_rate"]) if evaluations else ({}, {})
    watched = ", ".join(f"{name} ({count} items) {first.get(name, 0):.0%} -> {last.get(name, 0):.0%}"
                        for name, count in guard["items"].items())
    regressions = [f"{e['suite']} at step {e['step']}" for e in guard["events"] if e["kind"] == "regression"]
    say(f"[demo] rl forgetting guard: {watched}; regressions: {', '.join(regressions) or 'none'}; "
        f"{guard['replay_samples']} demonstrations replayed; {len(evaluations)} evaluations, "
        f"{guard['eval_seconds']:.0f} s")
