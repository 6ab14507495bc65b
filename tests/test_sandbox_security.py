"""Security probes against the real bubblewrap sandbox: each probe runs the attack in a jail and checks it
failed, and - where that can be done safely - runs it again with that one protection off (a jail option, a
raised limit, or the unsafe local backend) to prove the probe would have seen the leak.

At the end of the module no process of the slot uids may be alive and no temp dir or cgroup may be left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from posttrain.sandbox import JailOptions, Limits, Sandbox, SandboxError, SandboxPool, UnsafeSandboxWarning
from posttrain.sandbox.pool import DEFAULT_UID_BASE

pytestmark = pytest.mark.bwrap


def _slot_processes(uids: set[int]) -> list[tuple[int, int]]:
    """(pid, uid) of every live process whose real uid is one of `uids`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) in uids:
                found.append((int(entry), int(line.split()[1])))
    return found


@pytest.fixture(scope="module")
def pool():
    # A uid range of our own, so other processes' sandboxes (tests running in parallel) never share it.
    try:
        pool = SandboxPool(2, uid_base=DEFAULT_UID_BASE + 1_000_000 + (os.getpid() % 4096) * 16)
    except SandboxError as error:
        pytest.skip(f"bubblewrap sandbox unavailable: {error}")
    pool.capabilities()  # start-up check
    yield pool
    uids, footprint = set(pool.slot_uids()), pool.footprint()
    pool.close()
    assert uids and footprint, "the pool never reported its slot uids and directories"
    deadline = time.monotonic() + 5
    while _slot_processes(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slot_processes(uids) == [], "processes of the sandbox uids survived"
    assert [path for path in footprint if os.path.exists(path)] == [], "temp dirs or cgroups were left behind"


def box(pool, jail: JailOptions | None = None, **limits) -> Sandbox:
    return Sandbox(Limits(**{"timeout_s": 10, **limits}), pool=pool, jail=jail)


@pytest.fixture(scope="module")
def unsafe_pool():
    pool = SandboxPool(1, backend="unsafe-local")
    yield pool
    pool.close()


def run_unsafe(unsafe_pool, code: str, **options):
    with pytest.warns(UnsafeSandboxWarning):
        return Sandbox(Limits(timeout_s=10), pool=unsafe_pool).run_python(code, **options)


def probe_json(result) -> dict:
    assert result.status == "ok", (result.status, result.stderr[-800:], result.error)
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- network ------------------------------------------------------------------------------------------

NETWORK_PROBE = """
import json, socket, sys
port, udp_port = int(sys.argv[1]), int(sys.argv[2])
report = {}
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=2); s.sendall(b"leak"); s.close()
    report["tcp"] = "connected"
except OSError as error:
    report["tcp"] = type(error).__name__
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.sendto(b"leak", ("127.0.0.1", udp_port))
    report["udp"] = "sent"
except OSError as error:
    report["udp"] = type(error).__name__
try:
    socket.getaddrinfo("pypi.org", 443); report["dns"] = "resolved"
except OSError as error:
    report["dns"] = type(error).__name__
print(json.dumps(report))
"""


def _listen():
    received: list[bytes] = []
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = tcp.accept()
                received.append(b"tcp:" + conn.recv(16))
                conn.close()
            except OSError:
                pass
            try:
                received.append(b"udp:" + udp.recvfrom(16)[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return tcp.getsockname()[1], udp.getsockname()[1], received, stop


def test_network_is_unreachable_tcp_udp_dns(pool):
    port, udp_port, received, stop = _listen()
    try:
        report = probe_json(box(pool).run_python(NETWORK_PROBE, args=[str(port), str(udp_port)]))
        assert report["tcp"] != "connected"
        assert report["dns"] != "resolved"
        time.sleep(0.5)
        assert received == []
        # protection off: the same probe in a jail sharing the host network reaches the server
        shared = box(pool, JailOptions(network=True))
        with pytest.warns(UserWarning, match="network"):
            report = probe_json(shared.run_python(NETWORK_PROBE, args=[str(port), str(udp_port)]))
        assert report["tcp"] == "connected"
        deadline = time.monotonic() + 3
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"tcp:leak" in received and b"udp:leak" in received
    finally:
        stop.set()


# ---- reading what is not the jail's --------------------------------------------------------------------

READ_PROBE = """
import json, os, sys
report = {}
for label, path in (("shadow", "/etc/shadow"), ("home", sys.argv[1]), ("project", sys.argv[2])):
    try:
        with open(path, "rb") as handle:
            report[label] = handle.read(64).decode(errors="replace")
    except OSError as error:
        report[label] = type(error).__name__
report["env"] = os.environ.get("POSTTRAIN_SANDBOX_CANARY", "absent")
print(json.dumps(report))
"""


@pytest.fixture()
def canaries(monkeypatch):
    secret = os.urandom(8).hex()
    home_canary = Path.home() / f".posttrain-canary-{secret}"
    home_canary.write_text("home-" + secret)
    monkeypatch.setenv("POSTTRAIN_SANDBOX_CANARY", "env-" + secret)
    yield secret, str(home_canary), str(Path(__file__).resolve())
    home_canary.unlink()


def test_cannot_read_shadow_home_project_or_parent_environment(pool, unsafe_pool, canaries):
    secret, home, project = canaries
    report = probe_json(box(pool).run_python(READ_PROBE, args=[home, project]))
    assert report["shadow"] in ("FileNotFoundError", "PermissionError")
    assert report["home"] in ("FileNotFoundError", "PermissionError")
    assert report["project"] in ("FileNotFoundError", "PermissionError")
    assert report["env"] == "absent"
    # protection off: unsandboxed, the same probe reads all three files; an env var handed over is seen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSandboxWarning)
        leaked = probe_json(Sandbox(pool=unsafe_pool).run_python(READ_PROBE, args=[home, project],
                                                                 env={"POSTTRAIN_SANDBOX_CANARY": "given"}))
    assert leaked["home"] == "home-" + secret
    assert leaked["project"].startswith('"""Security probes')
    assert leaked["shadow"].startswith("root:")
    assert leaked["env"] == "given"


def test_parent_environment_only_what_is_passed(pool, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SANDBOX_CANARY", "secret")
    result = box(pool).run(["sh", "-c", "env"], env={"GIVEN": "yes"})
    assert "POSTTRAIN_SANDBOX_CANARY" not in result.stdout
    assert "GIVEN=yes" in result.stdout


# ---- writing ----------------------------------------------------------------------------------------------

WRITE_PROBE = """
import json
report = {}
for path in ("/probe", "/usr/probe", "/etc/probe", "/dev/probe", "/sandbox/probe", "/tmp/probe", "/dev/shm/probe"):
    try:
        with open(path, "w") as handle:
            handle.write("x")
        report[path] = "written"
    except OSError as error:
        report[path] = type(error).__name__
print(json.dumps(report))
"""


def test_system_is_read_only_only_workdir_tmp_shm_writable(pool):
    report = probe_json(box(pool).run_python(WRITE_PROBE))
    for path in ("/probe", "/usr/probe", "/etc/probe", "/dev/probe"):
        assert report[path] in ("OSError", "PermissionError"), (path, report[path])
    for path in ("/sandbox/probe", "/tmp/probe", "/dev/shm/probe"):
        assert report[path] == "written", path
    # protection off: without the read-only root, the jail's / (its own tmpfs, not the host's) takes writes;
    # its /dev stays closed anyway (the launcher's prepared /dev is read-only and owned by root)
    with pytest.warns(UserWarning, match="readonly_root"):
        report = probe_json(box(pool, JailOptions(readonly_root=False)).run_python(WRITE_PROBE))
    assert report["/probe"] == "written" and report["/dev/probe"] in ("OSError", "PermissionError")


LISTING = """
import json, os, stat
FRESH = {"/proc", "/tmp", "/sandbox", "/dev/shm"}  # mounted anew for every run
def listing():
    seen = {}
    for top in ("/", "/etc", "/dev"):
        for name in sorted(os.listdir(top)):
            path = os.path.join(top, name)
            if path in FRESH:
                continue
            info = os.lstat(path)
            seen[path] = [info.st_mode, info.st_uid, info.st_size]
            if not stat.S_ISDIR(info.st_mode):  # a directory's mtime is when this slot's launcher made it
                seen[path].append(info.st_mtime_ns)
    for place in sorted(FRESH - {"/proc"}):
        seen[place + " entries"] = sorted(n for n in os.listdir(place) if n != "main.py")
    try:
        seen["xattr"] = os.getxattr("/", "user.leak").decode()
    except OSError:
        seen["xattr"] = None
    return seen
"""

TAMPER_PROBE = LISTING + """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
attempts = {}
def attempt(name, action):
    try:
        action()
        attempts[name] = "done"
    except OSError as error:
        attempts[name] = type(error).__name__
def remount_root_writable():
    if libc.mount(b"none", b"/", None, 32 | 4096, None) != 0:  # MS_REMOUNT | MS_BIND, without MS_RDONLY
        raise OSError(ctypes.get_errno(), "mount")
attempt("write /", lambda: open("/leak", "w").write("x"))
attempt("mkdir /", lambda: os.mkdir("/leakdir"))
attempt("append /etc/passwd", lambda: open("/etc/passwd", "a").write("x"))
attempt("chmod /etc/passwd", lambda: os.chmod("/etc/passwd", 0o777))
attempt("touch /etc/group", lambda: os.utime("/etc/group", (0, 0)))
attempt("rename /etc/passwd", lambda: os.rename("/etc/passwd", "/etc/passwd2"))
attempt("xattr /", lambda: os.setxattr("/", "user.leak", b"1"))
attempt("chmod /dev/null", lambda: os.chmod("/dev/null", 0o600))
attempt("mknod /dev", lambda: os.mknod("/dev/leak", 0o20666, os.makedev(8, 0)))
attempt("symlink /dev", lambda: os.symlink("/sandbox", "/dev/leak"))
attempt("remount / writable", remount_root_writable)
for place in ("/tmp/left", "/dev/shm/left", "/sandbox/left"):
    open(place, "w").write("from an earlier run")
with open("/dev/null", "w") as sink, open("/dev/zero", "rb") as zeros, open("/dev/urandom", "rb") as noise:
    attempts["devices work"] = [sink.write("x"), len(zeros.read(4)), len(noise.read(4))]
print(json.dumps({"attempts": attempts, "after": listing()}))
"""


def test_the_shared_jail_root_cannot_be_changed_and_nothing_carries_over(pool):
    """Each launcher prepares one read-only jail root and every run of its slot binds it as /: a run must not
    be able to change it, and nothing a run writes (work dir, /tmp, /dev/shm) may reach the next run."""
    one_slot = box(pool)  # runs from one thread, one after another, go to the same warm slot
    before = probe_json(one_slot.run_python(LISTING + "print(json.dumps(listing()))"))
    assert "/etc/passwd" in before and "/dev/null" in before and before["/tmp entries"] == []
    report = {}
    for _ in range(3):
        report = probe_json(one_slot.run_python(TAMPER_PROBE))
        assert report["attempts"].pop("devices work") == [1, 4, 4]
        assert set(report["attempts"].values()) <= {"OSError", "PermissionError"}, report["attempts"]
        assert {k: v for k, v in report["after"].items() if "entries" not in k} == \
            {k: v for k, v in before.items() if "entries" not in k}
    assert report["after"]["/tmp entries"] == ["left"]  # the probe's own writes, this run only
    after = probe_json(one_slot.run_python(LISTING + "print(json.dumps(listing()))"))
    assert after == before, "a run's changes reached a later run"
    # the listing sees a change where there is one: with a writable root (each run's own tmpfs) the write lands
    with pytest.warns(UserWarning, match="readonly_root"):
        weak = probe_json(box(pool, JailOptions(readonly_root=False)).run_python(TAMPER_PROBE))
    assert weak["attempts"]["write /"] == "done" and "/leak" in weak["after"] and "/leak" not in before


def test_a_read_only_path_gets_its_mount_point_in_the_shared_root(pool):
    shared = Path(__file__).resolve().parent / "data"  # not under /tmp: needs a mount point in the jail root
    jail = JailOptions(ro_paths=(str(shared),))
    listed = box(pool, jail).run(["ls", str(shared)])
    assert listed.status == "ok" and sorted(listed.stdout.split()) == sorted(os.listdir(shared))
    written = box(pool, jail).run(["sh", "-c", f"echo x > {shared}/leak"])
    assert written.status == "runtime_error" and not (shared / "leak").exists()


NAMESPACE_PROBE = """
import ctypes, json, subprocess
libc = ctypes.CDLL(None, use_errno=True)
report = {}
nested = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /tmp && echo mounted"],
                        capture_output=True, text=True)
report["nested"] = nested.stdout.strip() or nested.stderr.strip()[-80:]
report["mount"] = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
report["unshare_user"] = libc.unshare(0x10000000)
print(json.dumps(report))
"""


def test_no_mounts_and_no_nested_namespaces(pool):
    report = probe_json(box(pool).run_python(NAMESPACE_PROBE))
    assert report["unshare_user"] == -1 and report["mount"] == -1
    assert report["nested"] != "mounted"
    # protection off: with nested user namespaces allowed, the probe gets its own mount
    with pytest.warns(UserWarning, match="nested_namespaces"):
        report = probe_json(box(pool, JailOptions(nested_namespaces=True)).run_python(NAMESPACE_PROBE))
    assert report["nested"] == "mounted"


# ---- resource exhaustion ---------------------------------------------------------------------------------

FORK_PROBE = """
import json, os, time
forks = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    forks += 1
print(json.dumps({"forks": forks}))
"""

THREAD_PROBE = """
import json, threading, time
threads = 0
for _ in range(200):
    try:
        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
    except RuntimeError:
        break
    threads += 1
print(json.dumps({"threads": threads}))
"""


def test_fork_and_thread_bombs_are_bounded(pool):
    assert probe_json(box(pool, processes=16).run_python(FORK_PROBE))["forks"] < 20
    assert probe_json(box(pool, processes=16).run_python(THREAD_PROBE))["threads"] < 20
    # protection off (limit raised): the same bounded bombs get all 200
    assert probe_json(box(pool, processes=400).run_python(FORK_PROBE))["forks"] == 200
    assert probe_json(box(pool, processes=400).run_python(THREAD_PROBE))["threads"] == 200


def test_shell_fork_bomb_ends_with_the_run(pool):
    started = time.monotonic()
    result = box(pool, processes=16, timeout_s=2).run(["sh", "-c", "f() { f | f & }; f; sleep 1"])
    assert result.status in ("ok", "runtime_error", "timeout", "output_limit")
    assert time.monotonic() - started < 8


MEMORY_PROBE = """
chunks = []
for _ in range(16):
    chunks.append(bytearray(16 << 20))  # bytearray touches (zeroes) its pages
print("allocated", sum(map(len, chunks)) >> 20)
"""


def test_memory_bomb_is_killed(pool):
    if not pool.capabilities()["memory_limit"]:
        pytest.skip("no memory cgroup on this machine")
    assert box(pool, memory_mb=96).run_python(MEMORY_PROBE).status == "oom"
    # protection off (limit raised): the same 256 MiB fit
    assert box(pool, memory_mb=512).run_python(MEMORY_PROBE).stdout.strip() == "allocated 256"


def test_cpu_spin_stops_at_the_cpu_limit(pool):
    result = box(pool, cpu_s=1, timeout_s=20).run_python("while True: pass")
    facts = (result.status, result.signal, result.cpu_s, result.duration_s, result.stderr[-200:])
    assert result.status == "timeout" and result.signal in (signal.SIGXCPU, signal.SIGKILL), facts
    assert 0.9 <= result.cpu_s < 5 and result.duration_s < 15, facts
    # protection off (CPU limit raised): only the wall clock stops it
    result = box(pool, cpu_s=100, timeout_s=1.5).run_python("while True: pass")
    facts = (result.status, result.signal, result.cpu_s, result.duration_s, result.stderr[-200:])
    assert result.status == "timeout" and 1.4 < result.duration_s < 5, facts


FILL_PROBE = """
import json, sys
written = 0
try:
    with open(sys.argv[1], "wb") as handle:
        for _ in range(32):
            handle.write(b"x" * (1 << 19)); handle.flush(); written += 1 << 19
except OSError as error:
    pass
print(json.dumps({"written_mb": written / (1 << 20)}))
"""


@pytest.mark.parametrize("path", ["/tmp/fill", "/dev/shm/fill", "/sandbox/fill"])
def test_disk_fill_is_capped(pool, path):
    capped = probe_json(box(pool, tmp_mb=4, workdir_mb=4).run_python(FILL_PROBE, args=[path]))
    assert capped["written_mb"] <= 4
    # protection off (caps raised): the probe writes all 16 MiB it tries
    roomy = probe_json(box(pool, tmp_mb=32, workdir_mb=32).run_python(FILL_PROBE, args=[path]))
    assert roomy["written_mb"] == 16


def test_file_size_limit(pool):
    # Python ignores SIGXFSZ, so the write past the limit fails with EFBIG instead of killing the probe
    assert probe_json(box(pool, file_size_mb=1).run_python(FILL_PROBE, args=["/sandbox/big"]))["written_mb"] <= 1
    assert probe_json(box(pool, file_size_mb=64).run_python(FILL_PROBE, args=["/sandbox/big"]))["written_mb"] == 16
    shell = box(pool, file_size_mb=1).run(["sh", "-c", "head -c 4000000 /dev/zero > big"])
    assert shell.status == "runtime_error" and shell.signal == signal.SIGXFSZ


def test_output_flood_is_truncated_and_flagged(pool):
    flood = "import sys\nfor _ in range(1024): sys.stdout.write('x' * 1024)\n"
    result = box(pool, output_bytes=64 << 10).run_python(flood)
    assert result.status == "output_limit" and result.truncated
    assert len(result.stdout_bytes) + len(result.stderr_bytes) <= 64 << 10
    # protection off (cap raised): all of it arrives
    result = box(pool, output_bytes=4 << 20).run_python(flood)
    assert result.status == "ok" and len(result.stdout_bytes) == 1 << 20, (result.status, result.stderr[-300:])


FD_PROBE = """
import json, os
fds = []
for _ in range(300):
    try:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
print(json.dumps({"opened": len(fds)}))
"""


def test_fd_exhaustion_is_bounded(pool):
    assert probe_json(box(pool, open_files=64).run_python(FD_PROBE))["opened"] < 64
    assert probe_json(box(pool, open_files=1024).run_python(FD_PROBE))["opened"] == 300


# ---- time and process lifetime ------------------------------------------------------------------------


def test_sleeping_past_the_timeout_is_killed(pool):
    result = box(pool, timeout_s=1).run(["sleep", "30"])
    assert result.status == "timeout" and result.duration_s < 4
    assert box(pool, timeout_s=5).run(["sleep", "0.2"]).status == "ok"


DAEMON_PROBE = """
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(os.getpid(), flush=True)
        time.sleep(60)
        os._exit(0)
    os._exit(0)
time.sleep(0.3)
"""


def test_double_forked_daemon_ignoring_sigterm_dies_with_the_run(pool, unsafe_pool):
    result = box(pool).run_python(DAEMON_PROBE)
    assert result.status == "ok"
    time.sleep(0.2)
    assert _slot_processes(set(pool.slot_uids())) == []
    # protection off: without a PID namespace the daemon outlives the run (we kill it ourselves)
    leaked = run_unsafe(unsafe_pool, DAEMON_PROBE, timeout_s=2)
    daemon = int(leaked.stdout.split()[0])
    try:
        os.kill(daemon, 0)  # still alive
    finally:
        os.kill(daemon, signal.SIGKILL)


PARENT_PROBE = """
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
report = {"ppid": os.getppid()}
for target in (os.getppid(), 1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError as error:
        report[f"kill_{target}"] = type(error).__name__
attached = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH to bubblewrap's init
report["ptrace"] = "attached" if attached == 0 else os.strerror(ctypes.get_errno())
if attached == 0:
    os.waitpid(1, 0x40000000)  # __WALL: wait for the stop, then let it go
    libc.ptrace(17, 1, 0, 0)  # PTRACE_DETACH
print(json.dumps(report))
"""


def test_cannot_kill_or_ptrace_the_parent(pool):
    report = probe_json(box(pool).run_python(PARENT_PROBE))
    assert report["ptrace"] != "attached"
    assert box(pool).run(["true"]).status == "ok"
    # protection off: without the seccomp filter the same-uid init is attachable
    with pytest.warns(UserWarning, match="seccomp"):
        report = probe_json(box(pool, JailOptions(seccomp=False)).run_python(PARENT_PROBE))
    assert report["ptrace"] == "attached"


PROC_PROBE = """
import json, os
print(json.dumps({"pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""


def test_other_processes_are_invisible(pool, unsafe_pool):
    pids = probe_json(box(pool).run_python(PROC_PROBE))["pids"]
    assert len(pids) <= 3 and os.getpid() not in pids
    # protection off: unsandboxed, the probe sees this very test process
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSandboxWarning)
        assert os.getpid() in probe_json(Sandbox(pool=unsafe_pool).run_python(PROC_PROBE))["pids"]


LINK_PROBE = """
import os
open("real.txt", "w").write("mine")
os.symlink("/etc/passwd", "passwd_link")
os.symlink("/", "root_link")
os.mkdir("sub")
os.symlink("../real.txt", "sub/inner_link")
open("twin_a", "w").write("twin")
os.link("twin_a", "twin_b")
os.mkfifo("pipe")
try:
    os.link("/etc/passwd", "hard_out")
    print("hard link out made")
except OSError as error:
    print("hard link out refused:", type(error).__name__)
"""


def test_collect_takes_regular_files_and_refuses_links(pool):
    result = box(pool).run_python(LINK_PROBE, collect=True)
    assert "hard link out refused" in result.stdout
    assert result.files["real.txt"] == b"mine"
    assert result.files["main.py"].startswith(b"\nimport os")
    assert result.refused_files["passwd_link"] == "symlink"
    assert result.refused_files["root_link"] == "symlink"
    assert result.refused_files["sub/inner_link"] == "symlink"
    assert result.refused_files["twin_a"] == result.refused_files["twin_b"] == "hard link"
    assert result.refused_files["pipe"] == "not a regular file"
    assert not any(b"root:" in content for content in result.files.values())


def test_runs_as_an_unprivileged_uid_per_slot(pool):
    uids = {int(box(pool).run(["id", "-u"]).stdout) for _ in range(6)}
    assert 0 not in uids
    assert uids <= set(pool.slot_uids())


def _host_view(pid: int) -> dict:
    """What the host sees of a jail process: its ids, groups, capabilities, limits and OOM score."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    limits = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name, soft, hard = line[:26].strip(), *line[26:].split()[:2]
        limits[name] = (soft, hard)
    return {"ids": fields["Uid"].split() + fields["Gid"].split(), "groups": fields["Groups"].split(),
            "caps": {fields[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")},
            "limits": limits, "oom_score_adj": Path(f"/proc/{pid}/oom_score_adj").read_text().strip()}


def _runs_the_launchers_image(pid: int) -> bool:
    """Whether `pid` still runs the launcher's interpreter: the launcher itself during a spawn (its real and
    saved ids are the slot's for those microseconds, its effective id root) or the spawned child before its
    exec of bubblewrap (glibc's spawn code, which drops to the slot's ids before the exec). No code of the run's
    exists yet in either; every process that runs bubblewrap or the program is checked."""
    return Path(f"/proc/{pid}/exe").resolve() == Path(sys.executable).resolve()


@pytest.mark.parametrize("processes, open_files, file_size_mb", [(12, 40, 3), (30, 200, 9)])
def test_every_jail_process_has_the_slot_uid_no_privileges_and_the_run_limits(pool, processes, open_files,
                                                                               file_size_mb):
    # bubblewrap is started without a fork of the launcher (posix_spawn) and gets its limits from outside
    # before it may build the jail: every process of the run - bubblewrap's monitor outside the jail, its init
    # and the program inside - must show the slot's uid in all four ids, no groups, no capabilities, and
    # this run's limits (two runs with different limits, so the probe cannot pass on a default)
    future = pool.submit(box(pool, cpu_s=3, processes=processes, open_files=open_files,
                             file_size_mb=file_size_mb).request(["sleep", "3"]))
    deadline = time.monotonic() + 20
    seen: dict[int, dict] = {}
    while len(seen) < 3 and time.monotonic() < deadline:
        uids = set(pool.slot_uids())  # known once the slots' launchers have started
        for pid, _ in _slot_processes(uids):
            try:
                if _runs_the_launchers_image(pid):
                    continue
                seen.setdefault(pid, _host_view(pid))
            except OSError:
                pass
        time.sleep(0.02)
    assert future.result().status == "ok"
    assert len(seen) >= 3, seen  # monitor, init, program
    for view in seen.values():
        assert len(set(view["ids"][:4])) == 1 and len(set(view["ids"][4:])) == 1, view
        assert int(view["ids"][0]) in uids and view["groups"] == [], view
        assert view["caps"] == {"0000000000000000"}, view
        assert view["oom_score_adj"] == "500", view
        limits = view["limits"]
        assert limits["Max processes"] == (str(processes + 2),) * 2, view
        assert limits["Max open files"] == (str(open_files),) * 2, view
        assert limits["Max file size"] == (str(file_size_mb << 20),) * 2, view
        assert limits["Max cpu time"] == ("3", "4") and limits["Max core file size"] == ("0", "0"), view


NO_INHERITED_FDS_PROBE = """
import os
print(sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
"""


def test_the_program_inherits_only_stdin_stdout_stderr(pool):
    # the launcher's own pipes and descriptors (its request pipe, cgroup files, namespace handles) never reach
    # a jail: the fourth descriptor is the one listdir opened on /proc/self/fd
    assert box(pool).run_python(NO_INHERITED_FDS_PROBE).stdout.strip() == "[0, 1, 2, 3]"


def test_two_hundred_back_to_back_runs_have_no_infra_error(pool):
    sandbox = box(pool)
    before = pool.stats().infra_errors
    statuses = [sandbox.run(["true"]).status for _ in range(200)]
    assert statuses.count("ok") == 200
    assert pool.stats().infra_errors == before
