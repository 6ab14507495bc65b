"""Recall, false accepts and time per judgement of the math verifier on the labelled equivalence set.

    .venv/bin/python bench/math_recall.py                       # this tree only
    .venv/bin/python bench/math_recall.py --baseline-src DIR    # and a baseline's src/ side by side

The set is tests/data/math_equivalence.yaml (competition-style (reference, completion, equal) pairs). Recall is the
share of equal pairs scored 1; a false accept is a not-equal pair scored 1 (the goal is 0). Each side runs in
its own process (``PYTHONPATH`` = that side's src), judges the whole set once to start its math-verify workers,
then ``--rounds`` more times; time per judgement is the median round's wall time over the number of pairs, and CPU
per judgement the median round's CPU time of this process and its math-verify workers (read from /proc; on a
shared machine wall time moves with the neighbours' load, CPU time much less). With a baseline the sides
alternate (ours, baseline, ours, ...) and ``"ratio"`` is the baseline's CPU per judgement over ours (higher is
better: 1.5 means ours judges 1.5x as fast; ``"wall_ratio"`` the same for wall time). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "data" / "math_equivalence.yaml"


def _cpu_s() -> float:
    """CPU seconds of this process plus its live math-verify workers."""
    from posttrain.verify.math_worker import math_workers

    total = time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    for worker in list(math_workers()._all):  # a bench may look inside: the workers are where the time goes
        try:
            fields = Path(f"/proc/{worker.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def measure(rounds: int) -> dict:
    """Judge the set `rounds` times in this process (after one warm-up pass); figures of the last pass."""
    import yaml

    from posttrain.verify import verify_math

    cases = yaml.safe_load(CASES.read_text())["cases"]
    verdicts = [verify_math(c["completion"], c["reference"]).passed for c in cases]  # warm-up: workers start
    times, cpu = [], []
    for _ in range(rounds):
        started, started_cpu = time.perf_counter(), _cpu_s()
        verdicts = [verify_math(c["completion"], c["reference"]).passed for c in cases]
        times.append(time.perf_counter() - started)
        cpu.append(_cpu_s() - started_cpu)
    equal = [v for c, v in zip(cases, verdicts) if c["equal"]]
    missed = Counter(c["kind"] for c, v in zip(cases, verdicts) if c["equal"] and not v)
    false_accepts = [c for c, v in zip(cases, verdicts) if not c["equal"] and v]
    return {"pairs": len(cases), "equal_pairs": len(equal), "recall": round(sum(equal) / len(equal), 4),
            "false_accepts": len(false_accepts),
            "ms_per_judgement": round(1000 * statistics.median(times) / len(cases), 3),
            "cpu_ms_per_judgement": round(1000 * statistics.median(cpu) / len(cases), 3),
            "missed_by_kind": dict(missed),
            "false_accepted": [(c["reference"], c["completion"]) for c in false_accepts]}


def run_side(src: Path, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--measure", "--rounds", str(rounds)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, help="a baseline checkout's src/ directory")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the set per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per side (alternating)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    if args.measure:
        print(json.dumps(measure(args.rounds)))
        return
    sides = {"ours": ROOT / "src"} | ({"baseline": args.baseline_src} if args.baseline_src else {})
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, src in sides.items():
            results[name].append(run_side(src, args.rounds))
    summary = {}
    for name, runs in results.items():
        last = runs[-1]
        summary[name] = {**{k: last[k] for k in ("pairs", "equal_pairs", "recall", "false_accepts", "missed_by_kind")},
                         "ms_per_judgement": statistics.median(r["ms_per_judgement"] for r in runs),
                         "cpu_ms_per_judgement": statistics.median(r["cpu_ms_per_judgement"] for r in runs)}
        print(f"{name}: recall {last['recall']:.1%} of {last['equal_pairs']} equal pairs, "
              f"{last['false_accepts']} false accepts, {summary[name]['ms_per_judgement']} ms/judgement "
              f"({summary[name]['cpu_ms_per_judgement']} ms CPU); "
              f"missed {last['missed_by_kind']}", file=sys.stderr)
        for reference, completion in last["false_accepted"]:
            print(f"  false accept: {reference!r} <- {completion!r}", file=sys.stderr)
    if "baseline" in summary:
        ours, baseline = summary["ours"], summary["baseline"]
        summary["ratio"] = round(baseline["cpu_ms_per_judgement"] / ours["cpu_ms_per_judgement"], 3)
        summary["wall_ratio"] = round(baseline["ms_per_judgement"] / ours["ms_per_judgement"], 3)
    summary["load_avg_1m"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # the machine is shared: load at start and end
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
