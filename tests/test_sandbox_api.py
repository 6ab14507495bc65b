"""The sandbox's API on real jails: statuses, files in and out, per-run limits, sync/async/threads, the pool's
bound and backpressure, infra errors (never a score) and clear errors for the user's mistakes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import warnings

import pytest

from posttrain.sandbox import (
    JailOptions,
    Limits,
    RunStatus,
    Sandbox,
    SandboxError,
    SandboxPool,
    UnsafeSandboxWarning,
    find_bubblewrap,
)
from posttrain.sandbox.preflight import explain_jail_failure
from test_sandbox_security import pool  # noqa: F401 - the module-scoped pool fixture with its leak checks


# ---- the user's mistakes: clear errors, at once ----------------------------------------------------------


def test_limits_are_validated():
    with pytest.raises(SandboxError, match="timeout_s must be a positive number"):
        Limits(timeout_s=0)
    with pytest.raises(SandboxError, match="unknown sandbox limit.*memory_gb"):
        Limits().replace(memory_gb=1)
    assert Limits().replace(timeout_s=2).timeout_s == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"cmd": "echo hi"}, "list of arguments"),
    ({"cmd": []}, "non-empty list"),
    ({"cmd": ["true"], "files": {"/etc/passwd": "x"}}, "relative"),
    ({"cmd": ["true"], "files": {"../up": "x"}}, "stay inside"),
    ({"cmd": ["true"], "files": {"a": "x", "a/b": "y"}}, "cannot be a file and a directory"),
    ({"cmd": ["true"], "files": {"x\ud800": "y"}}, "not UTF-8"),
    ({"cmd": ["true"], "files": {"a": "\ud800"}}, "not UTF-8"),
    ({"cmd": ["true"], "files": {"n" * 256: "x"}}, "too long"),
    ({"cmd": ["true"], "files": {"a/" * 600 + "b": "x"}}, "too long"),
    ({"cmd": ["true"], "files": {"a": 3}}, "str or bytes"),
    ({"cmd": ["true"], "env": {"A=B": "x"}}, "environment variable"),
    ({"cmd": ["true"], "timeout_s": -1}, "timeout_s"),
])
def test_bad_requests_are_refused_before_running(kwargs, message):
    sandbox = Sandbox(pool=SandboxPool(1, backend="unsafe-local"))
    cmd = kwargs.pop("cmd")
    with pytest.raises(SandboxError, match=message):
        sandbox.request(cmd, **kwargs)


def test_files_larger_than_the_workdir_are_refused():
    with pytest.raises(SandboxError, match="workdir_mb"):
        Sandbox(Limits(workdir_mb=1), pool=SandboxPool(1, backend="unsafe-local")).request(
            ["true"], files={"big": b"x" * (2 << 20)})


def test_missing_bubblewrap_names_the_fix():
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        find_bubblewrap("/nonexistent/bwrap")
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        SandboxPool(1, bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxError, match="unknown sandbox backend"):
        SandboxPool(1, backend="docker")


def test_refused_namespaces_name_the_fix():
    error = explain_jail_failure("bwrap: setting up uid map: Permission denied")
    assert "max_user_namespaces" in str(error) and "apparmor" in str(error)


def test_missing_read_only_path_is_an_error():
    with pytest.raises(SandboxError, match="does not exist"):
        JailOptions(ro_paths=("/nonexistent/venv",))


# ---- statuses and I/O ---------------------------------------------------------------------------------

pytestmark = pytest.mark.bwrap


def test_ok_with_stdin_args_and_stdout(pool):
    result = Sandbox(pool=pool).run_python("import sys\nprint(sys.argv[1], sys.stdin.read()[::-1])",
                                           stdin="abc", args=["x"])
    assert result.status is RunStatus.OK and result.ok and result.exit_code == 0
    assert result.stdout == "x cba\n" and result.duration_s > 0 and result.backend == "bubblewrap"


def test_dev_stdin_works_for_programs_that_open_it(pool):
    assert Sandbox(pool=pool).run(["cat", "/dev/stdin"], stdin="hello").stdout == "hello"


def test_runtime_error_keeps_exit_code_and_stderr(pool):
    result = Sandbox(pool=pool).run_python("import sys\nsys.stderr.write('boom')\nsys.exit(3)")
    assert result.status == "runtime_error" and result.exit_code == 3 and result.stderr == "boom"
    killed = Sandbox(pool=pool).run(["sh", "-c", "kill -SEGV $$"])
    assert killed.status == "runtime_error" and killed.signal == signal.SIGSEGV


def test_a_shared_read_only_path_under_the_host_tmp_is_visible(pool):
    # e.g. a project (and its virtualenv) checked out under /tmp: the jail's private /tmp must not hide it
    import tempfile

    shared = tempfile.mkdtemp(dir="/tmp", prefix="posttrain-shared-")
    os.chmod(shared, 0o755)  # as a checkout or a virtualenv is: readable by the jail's unprivileged uid
    try:
        with open(os.path.join(shared, "lib.txt"), "w") as handle:
            handle.write("shared\n")
        result = Sandbox(pool=pool, jail=JailOptions(ro_paths=(shared,))).run(
            ["sh", "-c", f"cat {shared}/lib.txt; touch {shared}/x 2>/dev/null && echo writable; ls /tmp | wc -l"])
        assert result.ok and result.stdout.split() == ["shared", "1"]  # readable, read-only, /tmp otherwise empty
    finally:
        import shutil

        shutil.rmtree(shared)


def test_files_in_and_collected_files_out(pool):
    result = Sandbox(pool=pool).run(
        ["sh", "-c", "cat data/in.txt | tr a-z A-Z > out/result.txt; echo log > note.log"],
        files={"data/in.txt": "hello", "out/.keep": ""}, collect=["out/*", "*.log"])
    assert result.ok
    assert result.files == {"out/.keep": b"", "out/result.txt": b"HELLO", "note.log": b"log\n"}


def test_collect_budget_is_respected(pool):
    result = Sandbox(Limits(collect_bytes=1000), pool=pool).run(
        ["sh", "-c", "head -c 600 /dev/zero > a; head -c 600 /dev/zero > b"], collect=True)
    assert len(result.files) == 1 and list(result.refused_files.values()) == ["over the collect budget"]


def test_per_run_timeout_and_limits_override_the_defaults(pool):
    sandbox = Sandbox(Limits(timeout_s=30), pool=pool)
    assert sandbox.run(["sleep", "5"], timeout_s=0.5).status == "timeout"
    assert sandbox.run_python("print(len(bytearray(64 << 20)))", limits=Limits(memory_mb=512)).ok


def test_run_results_are_strings_for_text_and_bytes_exactly(pool):
    result = Sandbox(pool=pool).run(["printf", "\\377ok"])
    assert result.stdout_bytes == b"\xffok" and result.stdout == "\ufffdok"


# ---- concurrency: threads, asyncio, the bound and backpressure ---------------------------------------------


def test_threads_share_the_pool(pool):
    results: list[str] = []

    def worker(index: int) -> None:
        for _ in range(4):
            results.append(Sandbox(pool=pool).run(["echo", str(index)]).stdout.strip())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(str(i) for i in range(6) for _ in range(4))


def test_asyncio_runs_never_exceed_the_slots(pool):
    peak = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak.append(pool.stats().busy)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def main() -> list:
        sandbox = Sandbox(pool=pool)
        return await asyncio.gather(*(sandbox.arun(["sleep", "0.3"]) for _ in range(6)))

    started = time.monotonic()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert all(r.ok for r in results)
    assert max(peak) <= pool.size == 2
    assert time.monotonic() - started >= 0.85  # three waves of two


def test_submit_blocks_when_max_pending_runs_are_queued():
    with SandboxPool(1, max_pending=2) as small:
        request = Sandbox(pool=small).request(["sleep", "0.4"])
        first, second = small.submit(request), small.submit(request)
        started = time.monotonic()
        third = small.submit(request)  # waits until the first run is done
        assert time.monotonic() - started >= 0.3
        assert all(f.result().ok for f in (first, second, third))


def test_a_dead_launcher_is_an_infra_error_then_replaced():
    with SandboxPool(1) as lonely:
        sandbox = Sandbox(pool=lonely)
        assert sandbox.run(["true"]).ok
        slot = lonely._slots[0]
        threading.Timer(0.3, lambda: os.kill(slot.process.pid, signal.SIGKILL)).start()
        result = sandbox.run(["sleep", "5"])
        assert result.status == "infra_error" and result.is_infra_error and "launcher" in result.error
        assert sandbox.run(["true"]).ok  # a fresh launcher took over
        stats = lonely.stats()
        assert stats.infra_errors == 1 and stats.launcher_restarts == 1
    # the killed launcher's work dir and cgroups were cleaned up by the trainer side
    assert [path for path in lonely.footprint() if os.path.exists(path)] == []


@pytest.fixture
def open_tmp():
    """A temp directory the slot uids may pass through (pytest's tmp_path is 0700 under a 0700 parent)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="test-launcher-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_next_launcher_removes_what_launchers_killed_with_their_trainer_left(open_tmp):
    """A launcher killed hard with its trainer (a Ray worker's children die with the worker) leaves its two empty
    directories in the temp dir, and nobody removed them: every such death left two more. The next launcher
    removes every such pair nobody holds (a live launcher holds its directory's flock), and nothing with
    contents, no link, no directory a live launcher holds, nothing of another name. A directory a launcher made
    and died before locking (`.posttrain-sandbox-new-*`) goes once it is a minute old."""
    import fcntl
    import time

    with SandboxPool(1, tmp_dir=str(open_tmp)) as first:
        assert Sandbox(pool=first).run(["true"]).ok
        [uid] = first.slot_uids()
        [live] = [path for path in open_tmp.iterdir() if not path.name.endswith("-ro")]
        assert live.name.startswith(f"posttrain-sandbox-{uid}-")
    assert list(open_tmp.iterdir()) == []  # a launcher that exits removes its own
    stale = [open_tmp / f"posttrain-sandbox-{u}-4242-k1ll3d{suffix}" for u in (uid, uid + 7) for suffix in ("", "-ro")]
    stale.append(open_tmp / ".posttrain-sandbox-new-d13d")  # made two minutes ago, never locked
    held = open_tmp / "posttrain-sandbox-77-4343-h0ld1ng"  # a live launcher's, from another pid namespace say
    kept = [held, open_tmp / f"{held.name}-ro", open_tmp / "posttrain-sandbox-77-4444-full",
            open_tmp / "posttrain-sandbox-77-4545-link", open_tmp / "posttrain-sandbox-0ldn4me", open_tmp / "target",
            open_tmp / ".posttrain-sandbox-new-j0st"]  # just made: its launcher may be about to lock it
    for directory in stale + [path for path in kept if "link" not in path.name]:
        directory.mkdir()
    os.utime(stale[-1], (time.time() - 120, time.time() - 120))
    (kept[2] / "data").write_text("kept")
    kept[3].symlink_to(kept[5], target_is_directory=True)
    lock = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with SandboxPool(1, tmp_dir=str(open_tmp)) as second:
            assert Sandbox(pool=second).run(["true"]).ok
            assert not any(path.exists() for path in stale)
            assert all(path.is_symlink() or path.is_dir() for path in kept) and (kept[2] / "data").read_text() == "kept"
    finally:
        os.close(lock)
    assert sorted(path.name for path in open_tmp.iterdir()) == sorted(path.name for path in kept)


def test_closed_pool_refuses_runs():
    closed = SandboxPool(1)
    closed.close()
    with pytest.raises(SandboxError, match="closed"):
        Sandbox(pool=closed).run(["true"])


def test_default_sandbox_uses_the_shared_pool():
    assert Sandbox().run(["echo", "shared"]).stdout == "shared\n"


def test_local_pool_is_the_default_unless_the_default_runs_elsewhere():
    from posttrain.sandbox import default_pool, local_pool, set_default_pool

    class RemotePool:  # a pool whose runs would happen on another machine (Ray's sandbox workers)
        runs = 0

        def execute(self, request):
            RemotePool.runs += 1
            raise AssertionError("a run meant for this machine was sent away")

    shared = default_pool()
    assert local_pool() is shared  # a local default: no second pool
    try:
        set_default_pool(RemotePool())
        here = local_pool()
        assert isinstance(here, SandboxPool) and here is not shared and local_pool() is here
        assert Sandbox(pool=here).run(["echo", "here"]).stdout == "here\n"
        assert RemotePool.runs == 0
    finally:
        set_default_pool(shared)
    assert local_pool() is shared


def test_local_pool_of_n_slots_is_one_per_size_and_not_the_default():
    from posttrain.sandbox import default_pool, local_pool

    wide = local_pool(5)
    assert isinstance(wide, SandboxPool) and wide.size == 5 and local_pool(5) is wide
    assert local_pool(3).size == 3 and local_pool(3) is not wide and wide is not default_pool()
    assert Sandbox(pool=wide).run(["echo", "wide"]).stdout == "wide\n"


# ---- the explicitly unsafe backend ---------------------------------------------------------------------


def test_unsafe_local_backend_warns_on_every_run():
    with SandboxPool(1, backend="unsafe-local") as local:
        sandbox = Sandbox(Limits(timeout_s=1), pool=local)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            first = sandbox.run(["sh", "-c", "echo hi > out.txt; echo done"], collect=True)
            second = sandbox.run(["sleep", "5"])
        assert sum(issubclass(w.category, UnsafeSandboxWarning) for w in caught) == 2
        assert first.ok and first.files == {"out.txt": b"hi\n"} and first.backend == "unsafe-local"
        assert second.status == "timeout"
