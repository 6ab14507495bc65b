"""The demo's closing figures beside the accuracy table: pass@1 and pass@k per level of the sampled domains (code),
why each stage stopped, RL's compute against the control's, the share of RL's step time spent judging, and each
stage against the one it is measured against, item by item (`stage_comparisons`)."""

from __future__ import annotations

from typing import Any

from posttrain.tracking import console, say

# (after, before): what each stage is measured against. RL against SFT (did it gain?) and against the control (did
# it gain more than the same compute of SFT?); the control and DPO against SFT.
COMPARISONS = [("rl", "sft"), ("rl", "sft_control"), ("sft_control", "sft"), ("dpo", "sft")]


def stage_comparisons(items: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of `COMPARISONS` whose stages both left their held-out items (`read_item_rates`): per domain the
    greedy difference on the same items with its paired standard error (`paired_difference`), the same for the
    sampled pass@1 of the sampled domains, and the mean over the domains (`pooled_difference`)."""
    from posttrain.evaluate import paired_difference, pooled_difference

    found = []
    for after, before in COMPARISONS:
        if after not in items or before not in items:
            continue
        greedy = {domain: paired_difference(items[before]["greedy"].get(domain, {}), rates)
                  for domain, rates in items[after]["greedy"].items()}
        greedy = {domain: figures for domain, figures in greedy.items() if figures["items"]}
        sampled = {domain: paired_difference(items[before]["sampled"].get(domain, {}), rates)
                   for domain, rates in items[after]["sampled"].items()}
        pooled = pooled_difference(list(greedy.values()))
        mean = {"gain": pooled["gain"], "standard_error": pooled["standard_error"], "domains": pooled["count"]} \
            if pooled else None
        found.append({"after": after, "before": before, "greedy": greedy, "mean": mean,
                      "sampled": {domain: figures for domain, figures in sampled.items() if figures["items"]}})
    return found


def _points(figures: dict[str, Any]) -> str:
    return f"{figures['gain'] * 100:+.1f} ± {figures['standard_error'] * 100:.1f}"


def _print_comparisons(comparisons: list[dict[str, Any]]) -> None:
    for c in comparisons:
        named = [(domain, g) for domain, g in sorted(c["greedy"].items())]
        named += [(f"{domain} sampled pass@1", g) for domain, g in sorted(c["sampled"].items())]
        named += [(f"mean of {c['mean']['domains']}", c["mean"])] if c["mean"] else []
        measured = [f"{name} {_points(g)}" for name, g in named if abs(g["gain"]) > 2 * g["standard_error"]]
        say(f"[demo] {c['after']} - {c['before']}, item by item (points, ± one standard error): "
            + ", ".join(f"{name} {_points(g)}" for name, g in named)
            + f"; beyond two standard errors: {', '.join(measured) or 'none'}")


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
    if summary.get("comparisons"):
        _print_comparisons(summary["comparisons"])
        say("[demo] a difference within two standard errors could come from which items were drawn: not a "
            "measured gain or loss")


def _print_guard(guard: dict[str, Any]) -> None:
    """What RL's forgetting guard watched (the domains only SFT trained): first and last pass rate per domain,
    its regressions and what they cost."""
    first, last, regressed = _guard_view(guard)
    watched = ", ".join(f"{name} ({count} items) {first.get(name, 0):.0%} -> {last.get(name, 0):.0%}"
                        for name, count in guard["items"].items())
    regressions = [f"{name} at step {step}" for name, steps in regressed.items() for step in steps]
    say(f"[demo] rl forgetting guard: {watched}; regressions: {', '.join(regressions) or 'none'}; "
        f"{guard['replay_samples']} demonstrations replayed; {len(guard['evaluations'])} evaluations, "
        f"{guard['eval_seconds']:.0f} s")


def _guard_view(guard: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], dict[str, list[str]]]:
    """The guard's first and last pass rate per suite, and the steps at which each suite regressed."""
    evaluations = guard["evaluations"]
    first, last = (evaluations[0]["pass_rate"], evaluations[-1]["pass_rate"]) if evaluations else ({}, {})
    regressed: dict[str, list[str]] = {}
    for event in guard["events"]:
        if event["kind"] == "regression":
            regressed.setdefault(event["suite"], []).append(str(event["step"]))
    return first, last, regressed


def report_tables(summary: dict[str, Any], samples: int, temperature: float) -> list[dict[str, Any]]:
    """The same figures as `print_details`, as `report.tables` for the demo's report.html: why each stage stopped,
    the sampled pass@k per level (`samples` episodes per held-out item at `temperature`), the share of RL's step
    time spent judging (for code: the unit cases in the sandbox), RL's compute against the control's, and what the
    forgetting guard saw."""
    stages = summary.get("stages", {})
    tables = []
    stopped = [[stage, figures.get("steps"), figures["stopped_by"], figures.get("seconds")]
               for stage, figures in stages.items() if figures.get("stopped_by")]
    if stopped:
        tables.append({"title": "The stages: steps and why each stopped", "rows": stopped,
                       "head": ["stage", "steps", "stopped by", "seconds"],
                       "lead": "Budgets are steps (or epochs); `time_cap` means a stage's max_minutes cut it short, "
                               "so its figures depend on the machine that ran it."})
    sampled = {stage: figures["pass_at_k_by_level"] for stage, figures in stages.items()
               if figures.get("pass_at_k_by_level")}
    keys = sorted({k for per_stage in sampled.values() for levels in per_stage.values() for values in levels.values()
                   for k in values}, key=lambda k: int(k.split("@")[1]))
    if sampled:
        rows = [[stage, domain, level, *[values.get(k) for k in keys]]
                for domain in sorted({d for per_stage in sampled.values() for d in per_stage})
                for stage, per_stage in sampled.items() for level, values in sorted(per_stage.get(domain, {}).items())]
        tables.append({"title": "Held-out pass@1 and pass@k per level (sampled)", "rows": rows,
                       "head": ["stage", "domain", "level", *keys], "percent": list(range(3, 3 + len(keys))),
                       "lead": f"{samples} sampled episodes per held-out item at temperature {temperature:g}, each "
                               "stage's own checkpoint; pass@k is the unbiased estimate from them."})
    rl, control = stages.get("rl", {}), stages.get("sft_control", {})
    if rl.get("judging"):
        judging = rl["judging"]
        tables.append({"title": "RL: the share of the step time spent judging",
                       "head": ["domain", "share of the step time", "RL step seconds", "RL steps"],
                       "rows": [[name, share, judging["step_seconds"], rl.get("steps")]
                                for name, share in sorted(judging["share"].items())], "percent": [1],
                       "lead": "Wall time during which a verifier was running (concurrent judgements counted once) "
                               "over the wall time of RL's training steps; code's verifier runs the unit cases in the "
                               "sandbox, so its share is the sandbox's."})
    if rl.get("compute"):
        compute = rl["compute"]
        rows = [["rl", compute["sampled_tokens"], compute["trained_tokens"], compute["train_token_equivalents"],
                 rl.get("steps")]]
        if control.get("compute"):
            rows.append(["sft_control", 0, control["compute"]["trained_tokens"],
                         control["compute"]["train_token_equivalents"], control.get("steps")])
        tables.append({"title": "Training compute: RL and its control", "rows": rows,
                       "head": ["stage", "tokens sampled", "tokens trained", "forward-and-backward token equivalents",
                                "steps"],
                       "lead": "A sampled token costs a forward (2N FLOPs), a trained token a forward and a backward "
                               "(6N), so equivalents = sampled / 3 + trained; the control's steps are chosen to match "
                               "RL's equivalents."})
    if summary.get("comparisons"):
        rows = []
        for c in summary["comparisons"]:  # a comparison's domains, their mean, then its sampled domains
            name = f"{c['after']} - {c['before']}"
            rows += [[name, domain, "greedy", _points(g), g["items"], g["better"], g["worse"]]
                     for domain, g in sorted(c["greedy"].items())]
            if c["mean"]:
                rows.append([name, f"mean of {c['mean']['domains']}", "greedy", _points(c["mean"]), None, None, None])
            rows += [[name, domain, "sampled pass@1", _points(g), g["items"], g["better"], g["worse"]]
                     for domain, g in sorted(c["sampled"].items())]
        tables.append({"title": "Stage against stage, item by item", "rows": rows,
                       "head": ["comparison", "domain", "pass rate", "difference (points, ± one standard error)",
                                "items", "better", "worse"],
                       "lead": "The same held-out items before and after, so the standard error is that of the "
                               "per-item difference (paired). A difference within two standard errors is noise, "
                               "not a gain or a loss. Better/worse count the items whose outcome (sampled: share "
                               "of passing samples) rose or fell."})
    if rl.get("guard"):
        guard = rl["guard"]
        first, last, regressed = _guard_view(guard)
        tables.append({"title": "RL's forgetting guard: the domains only SFT trained",
                       "head": ["domain", "items", "before RL", "after RL", "regressions (steps)"],
                       "rows": [[name, count, first.get(name), last.get(name),
                                 ", ".join(regressed.get(name, [])) or None]
                                for name, count in guard["items"].items()], "percent": [2, 3],
                       "lead": f"Greedy pass@1 on held-out items that are neither test nor validation items; "
                               f"{len(guard['evaluations'])} evaluations ({guard['eval_seconds']:.0f} s), "
                               f"{guard['replay_samples']} demonstrations replayed."})
    return tables
