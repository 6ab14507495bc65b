"""Sandbox cost, measured side by side with plain subprocesses in one run (alternating, medians).

    .venv/bin/python bench/sandbox.py            # ~1 minute on 2 cores; prints one JSON line at the end

1. Start overhead: ``python3 -c pass`` in a jail minus the same command as a plain subprocess, in alternating
   pairs on one thread (p50 and p95 of the paired differences), plus where the jail's time goes (the
   launcher's per-phase trace: set-up before fork, fork to exec, bubblewrap's set-up, the program, reaping).
2. Throughput: a small program with five asserts, run on all cores (one worker thread per CPU), sandboxed
   (one slot per CPU) and unsandboxed, in alternating rounds; ratio = sandboxed / unsandboxed runs per second.
   On a shared machine wall-clock figures move with the neighbours' load, so the CPU each side spends per run
   is measured too - every process involved: this one, the runs, and (sandboxed) the launchers - and
   cpu_ratio = unsandboxed CPU per run / sandboxed CPU per run is what the throughput ratio tends to on a
   quiet, saturated machine.
Both sides use the same interpreter (the jail's ``python3``, i.e. /usr/bin/python3 on Debian).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from posttrain.sandbox import Limits, Sandbox, SandboxPool  # noqa: E402

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
FIVE_ASSERTS = """
def solution(xs):
    return sorted(set(xs))
assert solution([3, 1, 2]) == [1, 2, 3]
assert solution([]) == []
assert solution([5, 5, 5]) == [5]
assert solution([-1, 0, 1, 0]) == [-1, 0, 1]
assert solution(list(range(50, 0, -1))) == list(range(1, 51))
"""
PAIRS = int(os.environ.get("BENCH_PAIRS", 80))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
RUNS_PER_ROUND = int(os.environ.get("BENCH_RUNS", 60))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def plain(argv: list[str]) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True)


def start_overhead(sandbox: Sandbox) -> dict:
    plain_ms, jail_ms, traces = [], [], []
    for _ in range(PAIRS):
        started = time.perf_counter()
        plain([PYTHON, "-c", "pass"])
        plain_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        result = sandbox.run(["python3", "-c", "pass"], trace=True)
        jail_ms.append((time.perf_counter() - started) * 1000)
        assert result.ok, (result.status, result.error, result.stderr)
        traces.append(result.trace)
    overhead = [j - p for j, p in zip(jail_ms, plain_ms)]
    phases = {name: statistics.median(t[name] for t in traces) for name in traces[0]}
    return {
        "plain_p50_ms": statistics.median(plain_ms),
        "sandboxed_p50_ms": statistics.median(jail_ms),
        "overhead_p50_ms": statistics.median(overhead),
        "overhead_p95_ms": percentile(overhead, 0.95),
        "phases_ms": {name: round(value, 2) for name, value in phases.items()},
    }


def cpu_seconds(pids: list[int]) -> float:
    """CPU used so far by this process, its reaped children, and `pids` (from schedstat: nanoseconds)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as handle:
            total += int(handle.read().split()[0]) / 1e9
    return total


def throughput(run_one, workers: int, launchers: list[int]) -> tuple[float, float]:
    """(runs per second, CPU seconds per run) for one round; run_one returns the CPU its jail used, if any."""
    cpu_before = cpu_seconds(launchers)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as executor:
        jail_cpu = sum(executor.map(lambda _: run_one(), range(RUNS_PER_ROUND)))
    elapsed = time.perf_counter() - started
    return RUNS_PER_ROUND / elapsed, (cpu_seconds(launchers) - cpu_before + jail_cpu) / RUNS_PER_ROUND


def main() -> None:
    cpus = os.cpu_count() or 1
    with SandboxPool(cpus) as pool:
        sandbox = Sandbox(Limits(timeout_s=30), pool=pool)
        for _ in range(2 * cpus):  # start every launcher, warm the page cache
            sandbox.run(["python3", "-c", "pass"])
            plain([PYTHON, "-c", "pass"])
        overhead = start_overhead(sandbox)

        def jailed() -> float:
            result = sandbox.run(["python3", "-c", FIVE_ASSERTS])
            assert result.ok, (result.status, result.error, result.stderr)
            return result.cpu_s  # the jail's processes, reaped by the launcher, not by us

        def unjailed() -> float:
            plain([PYTHON, "-c", FIVE_ASSERTS])
            return 0.0  # counted in our RUSAGE_CHILDREN

        launchers = [slot.process.pid for slot in pool._slots]
        unsandboxed, sandboxed = [], []
        for _ in range(ROUNDS):
            unsandboxed.append(throughput(unjailed, cpus, []))
            sandboxed.append(throughput(jailed, cpus, launchers))
        stats = pool.stats()
        capabilities = pool.capabilities()

    figures = {
        "cpus": cpus,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in overhead.items()},
        "unsandboxed_runs_per_s": round(statistics.median(r for r, _ in unsandboxed), 1),
        "sandboxed_runs_per_s": round(statistics.median(r for r, _ in sandboxed), 1),
        "ratio": round(statistics.median(r for r, _ in sandboxed) / statistics.median(r for r, _ in unsandboxed), 3),
        "unsandboxed_cpu_ms_per_run": round(statistics.median(c for _, c in unsandboxed) * 1000, 2),
        "sandboxed_cpu_ms_per_run": round(statistics.median(c for _, c in sandboxed) * 1000, 2),
        "infra_errors": stats.infra_errors,
        "memory_cgroup": capabilities["memory_limit"],
        "seccomp": capabilities["seccomp"],
    }
    print(f"start overhead over `python3 -c pass`: p50 {figures['overhead_p50_ms']} ms, "
          f"p95 {figures['overhead_p95_ms']} ms (plain {figures['plain_p50_ms']} ms, "
          f"sandboxed {figures['sandboxed_p50_ms']} ms)")
    print(f"where a jailed run's time goes (ms from the launcher's start of the run): {figures['phases_ms']}")
    print(f"five-assert programs on {cpus} cores: unsandboxed {figures['unsandboxed_runs_per_s']}/s, "
          f"sandboxed {figures['sandboxed_runs_per_s']}/s, ratio {figures['ratio']} "
          f"(load average {figures['load_avg_1m']})")
    figures["cpu_ratio"] = round(figures["unsandboxed_cpu_ms_per_run"] / figures["sandboxed_cpu_ms_per_run"], 3)
    print(f"CPU per run (every process involved): unsandboxed {figures['unsandboxed_cpu_ms_per_run']} ms, "
          f"sandboxed {figures['sandboxed_cpu_ms_per_run']} ms, cpu_ratio {figures['cpu_ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
