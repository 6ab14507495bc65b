"""The terminal summary of an evaluation: pass@1 per suite, checkpoints side by side, the tier table when there is
one, then where the report is."""

from __future__ import annotations

from typing import Any

from posttrain.tracking import console, say


def print_results(results: dict[str, Any]) -> None:
    from rich.table import Table

    labels = [c["label"] for c in results["checkpoints"]]
    table = Table(title="pass@1 by suite")
    table.add_column("suite")
    table.add_column("items", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    for suite in results["suites"]:
        cells = []
        for label in labels:
            figures = results["metrics"][label].get(suite["name"], {})
            value = figures.get("overall", {}).get("pass@1")
            text = "-" if value is None else f"{value:.1%}"
            safety = figures.get("safety")
            if safety and safety.get("refusal_accuracy") is not None and safety.get("over_refusal_rate") is not None:
                text += f" (refuse {safety['refusal_accuracy']:.0%}, over {safety['over_refusal_rate']:.0%})"
            cells.append(text)
        table.add_row(suite["name"], str(suite["items"]), *cells)
    console.print(table)
    _print_tiers(results.get("tiers") or {})
    contamination = results["contamination"]
    if contamination["count"]:
        say(f"[eval] {contamination['count']} contaminated eval items "
            f"({'excluded' if contamination['excluded'] else 'kept'}; listed in the report)")
    for row in results["regressions"]:
        if row["ok"] is False:
            say(f"[eval] regression: {row['suite']} on {row['checkpoint']}: pass@1 {row['pass_rate']:.1%} "
                f"below the floor {row['min_pass_rate']:.1%}")


def _print_tiers(tiers: dict[str, Any]) -> None:
    if not tiers.get("rows"):
        return
    from rich.table import Table

    table = Table(title=f"tiers (against {tiers.get('baseline')})")
    for column in ("tier", "kind", "accuracy", "tokens/s", "speed-up", "p50 ms", "runner"):
        table.add_column(column, justify="left" if column in ("tier", "kind", "runner") else "right")
    for row in tiers["rows"]:
        accuracy, speedup = row.get("accuracy"), row.get("speedup")
        table.add_row(row["label"], row["kind"], "-" if accuracy is None else f"{accuracy:.1%}",
                      f"{row['tokens_per_s']:.1f}", "-" if speedup is None else f"{speedup:.2f}x",
                      f"{row['p50_latency_ms']:.0f}", str(row.get("runner") or "-"))
    console.print(table)
