"""Sandbox cost, measured side by side with plain subprocesses in one run (alternating, medians).

    .venv/bin/python bench/sandbox.py            # ~1-2 minutes on 2 cores; prints one JSON line at the end

1. Start overhead: ``python3 -c pass`` in a jail minus the same command as a plain subprocess, in alternating
   pairs on one thread (p50 and p95 of the paired differences), plus where the jail's time goes (the
   launcher's per-phase trace: set-up before the spawn, the spawn with its limits, bubblewrap's set-up, the program,
   reaping).
2. Throughput: a small program with five asserts, run on all cores (one worker thread per CPU), sandboxed
   (one slot per CPU) and unsandboxed, in alternating rounds; ratio = sandboxed / unsandboxed runs per second.
   Measured twice: as the machine is ("quiet": no load of the bench's own), and with `BENCH_BUSY` (default 2)
   background processes that spin on the CPU the whole time ("busy"), since a trainer's machine is rarely idle.
   The JSON line's "ratio" is the smaller of the two; the 1-minute load average is reported before and after
   each phase (other jobs on a shared machine move every wall-clock figure).
   The CPU each side spends per run is measured too - every process involved: this one, the runs, and
   (sandboxed) the launchers - and cpu_ratio = unsandboxed CPU per run / sandboxed CPU per run is what the
   throughput ratio tends to on a quiet, saturated machine.
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
BUSY = int(os.environ.get("BENCH_BUSY", 2))
SPIN = "while True:\n    pass\n"


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


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def alternate(rounds: int, jailed, unjailed, cpus: int, launchers: list[int]) -> dict:
    """Alternating rounds of both sides; medians of runs/s and of CPU ms per run, and the load around them."""
    before = load_1m()
    unsandboxed, sandboxed = [], []
    for _ in range(rounds):
        unsandboxed.append(throughput(unjailed, cpus, []))
        sandboxed.append(throughput(jailed, cpus, launchers))
    plain_rate = statistics.median(r for r, _ in unsandboxed)
    jail_rate = statistics.median(r for r, _ in sandboxed)
    plain_cpu = statistics.median(c for _, c in unsandboxed) * 1000
    jail_cpu = statistics.median(c for _, c in sandboxed) * 1000
    return {"unsandboxed_runs_per_s": round(plain_rate, 1), "sandboxed_runs_per_s": round(jail_rate, 1),
            "ratio": round(jail_rate / plain_rate, 3), "unsandboxed_cpu_ms_per_run": round(plain_cpu, 2),
            "sandboxed_cpu_ms_per_run": round(jail_cpu, 2), "cpu_ratio": round(plain_cpu / jail_cpu, 3),
            "load_avg_1m_before": before, "load_avg_1m_after": load_1m()}


def main() -> None:
    cpus = os.cpu_count() or 1
    load_at_start = load_1m()
    with SandboxPool(cpus) as pool:
        sandbox = Sandbox(Limits(timeout_s=30), pool=pool)
        def warm(_: int) -> None:
            sandbox.run(["python3", "-c", "pass"])
            plain([PYTHON, "-c", "pass"])

        with ThreadPoolExecutor(max_workers=cpus) as executor:  # concurrent, so that every slot's launcher starts
            list(executor.map(warm, range(2 * cpus)))
        overhead = start_overhead(sandbox)

        def jailed() -> float:
            result = sandbox.run(["python3", "-c", FIVE_ASSERTS])
            assert result.ok, (result.status, result.error, result.stderr)
            return result.cpu_s  # the jail's processes, reaped by the launcher, not by us

        def unjailed() -> float:
            plain([PYTHON, "-c", FIVE_ASSERTS])
            return 0.0  # counted in our RUSAGE_CHILDREN

        launchers = [slot.process.pid for slot in pool._slots if slot.process is not None]
        quiet = alternate(ROUNDS, jailed, unjailed, cpus, launchers)
        spinners = [subprocess.Popen([PYTHON, "-c", SPIN]) for _ in range(BUSY)]
        try:
            time.sleep(1.0)
            busy = alternate(ROUNDS, jailed, unjailed, cpus, launchers)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        stats = pool.stats()
        capabilities = pool.capabilities()

    figures = {
        "cpus": cpus,
        "load_avg_1m_at_start": load_at_start,
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in overhead.items()},
        "ratio": min(quiet["ratio"], busy["ratio"]),
        "ratio_quiet": quiet["ratio"],
        f"ratio_busy_{BUSY}": busy["ratio"],
        "quiet": quiet,
        f"busy_{BUSY}": busy,
        "infra_errors": stats.infra_errors,
        "memory_cgroup": capabilities["memory_limit"],
        "seccomp": capabilities["seccomp"],
    }
    print(f"start overhead over `python3 -c pass`: p50 {figures['overhead_p50_ms']} ms, "
          f"p95 {figures['overhead_p95_ms']} ms (plain {figures['plain_p50_ms']} ms, "
          f"sandboxed {figures['sandboxed_p50_ms']} ms)")
    print(f"where a jailed run's time goes (ms from the launcher's start of the run): {figures['phases_ms']}")
    for name, phase in (("as the machine is", quiet), (f"with {BUSY} busy processes", busy)):
        print(f"five-assert programs on {cpus} cores, {name}: unsandboxed {phase['unsandboxed_runs_per_s']}/s, "
              f"sandboxed {phase['sandboxed_runs_per_s']}/s, ratio {phase['ratio']}; CPU per run "
              f"{phase['unsandboxed_cpu_ms_per_run']} / {phase['sandboxed_cpu_ms_per_run']} ms, cpu_ratio "
              f"{phase['cpu_ratio']} (load average {phase['load_avg_1m_before']} -> {phase['load_avg_1m_after']})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
