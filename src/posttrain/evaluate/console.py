"""The terminal summary of an evaluation: pass@1 per suite, checkpoints side by side, then where the report is."""

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
    contamination = results["contamination"]
    if contamination["count"]:
        say(f"[eval] {contamination['count']} contaminated eval items "
            f"({'excluded' if contamination['excluded'] else 'kept'}; listed in the report)")
    for row in results["regressions"]:
        if row["ok"] is False:
            say(f"[eval] regression: {row['suite']} on {row['checkpoint']}: pass@1 {row['pass_rate']:.1%} "
                f"below the floor {row['min_pass_rate']:.1%}")
