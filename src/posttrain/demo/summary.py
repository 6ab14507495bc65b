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
