"""Code-verifier judgements per second: the harness shipped as bytecode (the default where the pool's self-test
accepts it) against the harness shipped as source, side by side in one run (alternating rounds, medians).

    .venv/bin/python bench/code_judging.py [--repeats 5] [--items 80] [--threads 4]

Each round judges the same level-1 `code` demonstrations (all pass: the harness runs every case) from
`--threads` threads over the default sandbox pool (a slot per CPU), as RL's judging does, with `reuse: false`:
every round runs its jails (the verifier would otherwise hand each round after the first its verdicts from
`posttrain.verify.memo` and the bench would time a cache). Prints one JSON line:
per-second medians of both, "ratio" = bytecode / source, and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--items", type=int, default=80)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    from posttrain.sandbox import Sandbox
    from posttrain.tasks import get_domain, sample_tasks
    from posttrain.verify import code_tests, verify

    domain = get_domain("code")
    tasks = [dataclasses.replace(task, verifier_args={**task.verifier_args, "reuse": False})
             for task in sample_tasks(domain, args.items, level=[1], split="train", seed=3)]
    answers = [domain.demonstration(task).messages[-1]["content"] for task in tasks]
    verify(tasks[0], answers[0], {"answer": answers[0]})  # start the pool; its self-test decides on bytecode
    pool = Sandbox().pool
    accepted = bool(code_tests._runs_bytecode.get(pool))
    load_before = os.getloadavg()[0]
    rates: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for bytecode in (True, False) if repeat % 2 == 0 else (False, True):
            code_tests._runs_bytecode[pool] = bytecode
            started = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as workers:
                rewards = list(workers.map(lambda pair: verify(pair[0], pair[1], {"answer": pair[1]}),
                                           zip(tasks, answers)))
            rates[bytecode].append(len(tasks) / (time.perf_counter() - started))
            if not all(reward.passed for reward in rewards):
                raise SystemExit(f"a demonstration failed with bytecode={bytecode}: the bench measures nothing")
    code_tests._runs_bytecode[pool] = accepted
    bytecode_rate, source_rate = statistics.median(rates[True]), statistics.median(rates[False])
    print(json.dumps({"bench": "code_judging", "self_test_accepts_bytecode": accepted, "items": args.items,
                      "threads": args.threads, "slots": pool.size, "repeats": args.repeats,
                      "bytecode_per_s": round(bytecode_rate, 1), "source_per_s": round(source_rate, 1),
                      "ratio": round(bytecode_rate / source_rate, 3),
                      "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
