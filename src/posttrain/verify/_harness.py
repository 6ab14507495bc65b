"""The code verifier's harness: runs INSIDE the jail, next to the candidate, and never trusts it.

Invoked as ``python3 -B -s _harness.py CONFIG`` (standard library only, Python >= 3.8), or as ``_harness.pyc``,
this file compiled by the verifier, where the pool's self-test found the jail's Python runs it. The config file holds the
mode, the test *inputs* (never the expected outputs, except the assert-style source of the weaker scheme) and a
per-run random nonce. The design keeps the candidate away from everything that decides the result:

0. The harness takes the jail's working directory (the workspace, and whatever the candidate writes) off its
   ``sys.path`` before its first import, so no file there can stand in for a standard-library module in it.
1. The harness makes itself non-dumpable (no ptrace, no /proc/PID/mem or /proc/PID/fd for same-uid processes),
   opens and unlinks the config file, and forks a *zygote* - all before reading the config, so no process the
   candidate can ever run in holds a copy of the nonce or of the test source.
2. Candidate code only runs in *workers* the zygote forks on request: stdout/stderr go to /dev/null, the only
   channel is a socket to the harness carrying JSON. Values cross as tagged JSON and are rebuilt from plain
   builtins; an object with ``__eq__`` always True cannot cross. A worker that dies, hangs past the per-case
   timeout or answers out of turn fails that case; the next case gets a fresh worker. Once one case has timed
   out, the cases after it share ``after_timeout_s`` seconds in all (each still at most the per-case timeout),
   and once that is spent they fail without running: a sample that loops forever costs one case's timeout plus
   that small budget, not a full timeout per case.
3. At the end the harness SIGKILLs every other process in the jail (``kill(-1)``: the zygote, workers, daemons),
   then prints one line: ``NONCE JSON``. Anything else on stdout is ignored by the verifier, and a second line
   with the nonce cannot exist, so printing a fake result, os._exit, atexit hooks or killing the harness can
   only lose the candidate its score.
Modes: "function" (call a function per case, return its value), "stdio" (run the program per case with the
case's stdin, return its stdout), "assert" (run assert-style test statements here, calling the candidate
through proxies; the weaker scheme, because the expected values are inside the jail, though never in a process
the candidate runs in).
"""

import os
import sys

# Run as a script, the harness has the jail's working directory on sys.path (first, as the script's directory):
# the workspace a task ships in and whatever the candidate writes there. A file named like a module (json.py,
# socket.py) would then be imported in place of the standard library's, into this process, which holds the nonce
# and, in the assert scheme, the expected values. So that directory leaves sys.path before any other import (os
# and sys were loaded by the interpreter's start-up, before the script's directory was added); the workers put it
# back before they load the candidate, whose own imports see the workspace as before.
WORKSPACE_PATHS = []
if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(sys.argv[0]))
    WORKSPACE_PATHS = [p for p in sys.path if os.path.abspath(p or os.curdir) in (_here, os.getcwd())]
    sys.path[:] = [p for p in sys.path if p not in WORKSPACE_PATHS]

import ctypes  # noqa: E402 - after the working directory left sys.path
import importlib.util  # noqa: E402 - the workers load the candidate with it: loaded once, before they fork
import json  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402

MAX_MESSAGE = 4 << 20
MAX_STDOUT = 1 << 20
MAX_DEPTH = 64


class WorkerGone(Exception):
    """The worker died, hung, or broke the protocol."""


class CandidateError(Exception):
    """The candidate's code raised (or returned something that cannot cross the boundary)."""


# ---- values across the boundary: plain builtins only, tagged JSON ----------------------------------


def encode(value, depth=0):
    """Exact builtin types only (a subclass could lie through its methods)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if abs(value) < (1 << 53) else {"$int": hex(value)}
    if kind is float:
        return value if value == value and value not in (float("inf"), float("-inf")) else {"$float": repr(value)}
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"$tuple": [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (set, frozenset):
        items = sorted((encode(item, depth + 1) for item in value), key=lambda e: json.dumps(e, sort_keys=True))
        return {"$set" if kind is set else "$frozenset": items}
    if kind is bytes:
        return {"$bytes": value.hex()}
    if kind is complex:
        return {"$complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise TypeError("cannot return a value of type " + kind.__name__)


def decode(data, depth=0):
    """Rebuild a value from its tagged JSON; anything malformed raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(item, depth + 1) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError("malformed value")
    (tag, body), = data.items()
    if tag == "$int" and type(body) is str:
        return int(body, 16)
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$tuple" and type(body) is list:
        return tuple(decode(item, depth + 1) for item in body)
    if tag == "$dict" and type(body) is list:
        pairs = [decode(pair, depth + 1) for pair in body]
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise ValueError("malformed dict")
        return {_hashable(k): v for k, v in pairs}
    if tag in ("$set", "$frozenset") and type(body) is list:
        items = [_hashable(decode(item, depth + 1)) for item in body]
        return set(items) if tag == "$set" else frozenset(items)
    if tag == "$bytes" and type(body) is str:
        value = bytes.fromhex(body)
        if value.hex() != body:  # one spelling per value (fromhex would also take spaces and capitals)
            raise ValueError("malformed bytes")
        return value
    if tag == "$complex" and type(body) is list and len(body) == 2:
        return complex(decode(body[0], depth + 1), decode(body[1], depth + 1))
    if tag == "$handle" and type(body) is int:
        return Handle(body)
    raise ValueError("malformed value")


def _hashable(value):
    hash(value)  # a list as a dict key or set item is malformed
    return value


class Handle:
    """A reference to an object that stays in the worker (assert mode only)."""

    def __init__(self, number):
        self.number = number


# ---- framing ------------------------------------------------------------------------------------------


def send(sock, message):
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _read(sock, size, deadline):
    chunks = []
    while size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
                raise WorkerGone("timeout")
        chunk = sock.recv(min(size, 1 << 16))
        if not chunk:
            raise WorkerGone("the worker exited")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive(sock, deadline=None):
    (size,) = struct.unpack(">I", _read(sock, 4, deadline))
    if size > MAX_MESSAGE:
        raise WorkerGone("message too large")
    try:
        message = json.loads(_read(sock, size, deadline))
    except ValueError:
        raise WorkerGone("malformed message")
    if type(message) is not dict:
        raise WorkerGone("malformed message")
    return message


# ---- the worker side (candidate code runs here) ------------------------------------------------------


def _serve(conn, solution_path):
    handles = {}

    def resolve(target):
        if "handle" in target:
            return handles[target["handle"]]
        return getattr(module, target["name"])

    def value_or_handle(value, allow_handles):
        try:
            return encode(value)
        except (TypeError, ValueError):
            if not allow_handles:
                raise
            handles[len(handles)] = value
            return {"$handle": len(handles) - 1}

    def arguments(encoded):
        value = decode(encoded)
        return value if type(value) is not Handle else handles[value.number]

    module = None
    while True:
        request = receive(conn)
        op = request.get("op")
        try:
            if op == "load":
                sys.path[:0] = WORKSPACE_PATHS  # the candidate imports from its workspace as it would anywhere

                spec = importlib.util.spec_from_file_location("solution", solution_path)
                module = importlib.util.module_from_spec(spec)
                sys.modules["solution"] = module
                spec.loader.exec_module(module)
                reply = {"ok": True}
            elif op == "call":
                args = [arguments(a) for a in request.get("args", [])]
                kwargs = {k: arguments(v) for k, v in request.get("kwargs", {}).items()}
                value = resolve(request["target"])(*args, **kwargs)
                reply = {"ok": True, "value": value_or_handle(value, request.get("handles", False))}
            elif op == "getattr":
                value = getattr(resolve(request["target"]), request["attr"])
                reply = {"ok": True, "value": value_or_handle(value, True)}
            else:
                reply = {"ok": False, "error": "unknown op"}
        except BaseException as error:  # noqa: BLE001 - SystemExit from the candidate is an error too
            reply = {"ok": False, "error": (type(error).__name__ + ": " + str(error))[:300]}
        reply["seq"] = request.get("seq")
        send(conn, reply)


def _worker(request, fds, python, solution_path):
    """In a freshly forked worker: isolate stdio, then either exec the program or serve calls."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")  # a memory bomb kills the candidate, not the harness
    except OSError:
        pass
    if request["kind"] == "exec":
        stdin_fd, stdout_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(devnull, 2)
        os.closerange(3, 65536)
        try:
            os.execv(python, [python, "-B", "-s", solution_path])
        finally:
            os._exit(127)
    (conn_fd,) = fds
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.dup2(conn_fd, 3)
    os.closerange(4, 65536)
    conn = socket.socket(fileno=3)
    try:
        _serve(conn, solution_path)
    finally:
        os._exit(0)


def _zygote(control, python, solution_path):
    """Forks workers on request; never runs candidate code and never sees the config."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 4096, 4)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            control.close()
            _worker(json.loads(message), fds, python, solution_path)
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"pid": pid}).encode())


class Spawner:
    def __init__(self, python, solution_path, close_in_zygote=()):
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            parent_end.close()
            for fd in close_in_zygote:
                os.close(fd)
            os.setpgid(0, 0)  # the zygote and its workers form a group the harness can kill in one call
            _zygote(child_end, python, solution_path)
        child_end.close()
        self.control = parent_end
        self.zygote_pid = pid

    def spawn(self, kind, fds):
        try:
            socket.send_fds(self.control, [json.dumps({"kind": kind}).encode()], fds)
            if not select.select([self.control], [], [], 10.0)[0]:
                raise WorkerGone("the zygote did not answer")
            reply = self.control.recv(4096)
        except OSError as error:
            raise WorkerGone("the zygote is gone: " + str(error))
        finally:
            for fd in fds:
                os.close(fd)
        if not reply:
            raise WorkerGone("the zygote is gone")
        return json.loads(reply)["pid"]


# ---- the harness side --------------------------------------------------------------------------------


class Worker:
    """A serving worker: the candidate module loaded once, then calls until it dies or hangs."""

    def __init__(self, spawner, load_timeout_s):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = spawner.spawn("serve", [os.dup(theirs.fileno())])
        theirs.close()
        self.conn = mine
        self.seq = 0
        reply = self.ask({"op": "load"}, load_timeout_s)
        if not reply.get("ok"):
            self.kill()
            raise CandidateError(str(reply.get("error"))[:300])

    def ask(self, request, timeout_s):
        self.seq += 1
        request["seq"] = self.seq
        try:
            send(self.conn, request)
            reply = receive(self.conn, time.monotonic() + timeout_s)
        except (OSError, WorkerGone) as error:
            self.kill()
            raise WorkerGone(str(error) if str(error) else "the worker is gone")
        if reply.get("seq") != self.seq:
            self.kill()
            raise WorkerGone("the worker answered out of turn")
        return reply

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.conn.close()


class BudgetSpent(WorkerGone):
    """Not run: an earlier case timed out and the time the later cases share is used up."""


class Harness:
    def __init__(self, config, spawner):
        self.config = config
        self.spawner = spawner
        self.timeout_s = float(config["timeout_s"])
        self.after_timeout_s = float(config.get("after_timeout_s", float("inf")))  # absent: no shared bound
        self.overtime_ends = None  # set by the first timeout: when the time the later cases share runs out
        self.worker = None
        self.load_error = None  # once the module failed to import, every later call fails the same way

    def time_left(self, limit_s):
        """How long the next wait may last: `limit_s`, or less once a case has timed out (BudgetSpent at 0)."""
        if self.overtime_ends is None:
            return limit_s
        remaining = self.overtime_ends - time.monotonic()
        if remaining <= 0:
            raise BudgetSpent("not run: an earlier case timed out and the time budget after it is spent")
        return min(limit_s, remaining)

    def timed_out(self):
        """A case ran out of time: from now on the remaining cases share `after_timeout_s`."""
        if self.overtime_ends is None:
            self.overtime_ends = time.monotonic() + self.after_timeout_s

    def ask(self, request):
        """One request to a live worker (started, and the module imported, on demand)."""
        if self.load_error is not None:
            raise CandidateError(self.load_error)
        if self.worker is None:
            try:
                self.worker = Worker(self.spawner, self.time_left(self.timeout_s + 5.0))
            except BudgetSpent:
                raise
            except (CandidateError, WorkerGone) as error:
                self.load_error = "import failed: " + str(error)[:300]
                raise CandidateError(self.load_error)
        wait_s = self.time_left(self.timeout_s)  # outside the try: a spent budget says nothing of the worker
        try:
            reply = self.worker.ask(request, wait_s)
        except WorkerGone as error:
            self.worker = None  # the next request gets a fresh worker
            if str(error) == "timeout":
                self.timed_out()
            raise
        if not reply.get("ok"):
            raise CandidateError(str(reply.get("error"))[:300])
        return reply.get("value")

    def call(self, target, args, kwargs, handles=False):
        """One call into the candidate; raises CandidateError or WorkerGone."""
        return self.ask({"op": "call", "target": target, "args": args, "kwargs": kwargs, "handles": handles})

    def run_function_cases(self):
        results = []
        for case in self.config["cases"]:
            try:
                value = self.call({"name": self.config["function"]}, case.get("args", []), case.get("kwargs", {}))
                decode(value)  # only well-formed values travel on; the verifier decodes it again outside
                results.append({"ok": True, "value": value})
            except BudgetSpent as error:
                results.append({"ok": False, "error": str(error), "timeout": True, "skipped": True})
            except WorkerGone as error:
                results.append({"ok": False, "error": str(error)[:300], "timeout": str(error) == "timeout"})
            except (CandidateError, ValueError) as error:
                results.append({"ok": False, "error": str(error)[:300]})
        return results

    def run_stdio_cases(self):
        results = []
        for case in self.config["cases"]:
            try:
                wait_s = self.time_left(self.timeout_s)
            except BudgetSpent as error:
                results.append({"ok": False, "error": str(error), "timeout": True, "skipped": True})
                continue
            stdin_fd = os.memfd_create("stdin")
            data = case["stdin"].encode("utf-8")
            view = memoryview(data)
            while view:
                view = view[os.write(stdin_fd, view):]
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            out_r, out_w = os.pipe()
            try:
                pid = self.spawner.spawn("exec", [stdin_fd, out_w])
            except WorkerGone as error:
                os.close(out_r)
                results.append({"ok": False, "error": str(error)})
                continue
            output, timed_out = _read_all(out_r, time.monotonic() + wait_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            if timed_out:
                self.timed_out()
                results.append({"ok": False, "timeout": True, "error": "timeout"})
            else:
                results.append({"ok": True, "stdout": output.decode("utf-8", errors="replace")})
        return results

    def run_assert_tests(self):
        import ast  # only this scheme parses test source: the others skip its import (~5 ms of a judgement)

        module = ast.parse(self.config["source"])
        namespace = {"__name__": "__tests__"}
        for name in self.config["remote_names"]:
            namespace[name] = Remote(self, {"name": name})
        # `from solution import f` / `import solution` in the test source reach the worker too: the candidate's
        # module is never loaded in this process, which holds the nonce and the expected values.
        sys.modules["solution"] = RemoteModule(self, self.config["remote_names"])
        results = []
        setup_failed = None
        for node in module.body:
            is_test = isinstance(node, ast.Assert) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call))
            code = compile(ast.Module(body=[node], type_ignores=[]), "<tests>", "exec")
            if setup_failed is not None:
                if is_test:
                    results.append({"ok": False, "error": "setup failed: " + setup_failed})
                continue
            try:
                exec(code, namespace)  # noqa: S102 - the dataset's test source, inside the jail
                if is_test:
                    results.append({"ok": True})
            except WorkerGone as error:
                if is_test:
                    results.append({"ok": False, "error": "worker: " + str(error)[:200],
                                    "timeout": str(error) == "timeout" or isinstance(error, BudgetSpent),
                                    "skipped": isinstance(error, BudgetSpent)})
                else:
                    setup_failed = str(error)[:200]
            except BaseException as error:  # noqa: BLE001 - a failed assert or the candidate's exception
                message = (type(error).__name__ + ": " + str(error))[:300]
                if is_test:
                    results.append({"ok": False, "error": message})
                else:
                    setup_failed = message
        return results


class RemoteModule(type(sys)):
    """The candidate's module as the test source imports it: every public attribute is a `Remote` in the worker;
    ``from solution import *`` binds the names the test source uses but never defines."""

    def __init__(self, harness, names):
        super().__init__("solution")
        self.__all__ = list(names)
        self._harness = harness

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Remote(self._harness, {"name": attr})


class Remote:
    """A proxy for a name or object in the worker: calls and attribute reads become requests, results come
    back as plain values (or more proxies). Compared with anything, it is only equal to itself."""

    def __init__(self, harness, target):
        object.__setattr__(self, "_harness", harness)
        object.__setattr__(self, "_target", target)

    def __call__(self, *args, **kwargs):
        harness = object.__getattribute__(self, "_harness")
        encoded_args = [_encode_argument(a) for a in args]
        encoded_kwargs = {k: _encode_argument(v) for k, v in kwargs.items()}
        value = harness.call(object.__getattribute__(self, "_target"), encoded_args, encoded_kwargs, handles=True)
        return _from_worker(harness, value)

    def __getattr__(self, attr):
        harness = object.__getattribute__(self, "_harness")
        value = harness.ask({"op": "getattr", "target": object.__getattribute__(self, "_target"), "attr": attr})
        return _from_worker(harness, value)


def _encode_argument(value):
    if isinstance(value, Remote):
        target = object.__getattribute__(value, "_target")
        if "handle" in target:
            return {"$handle": target["handle"]}
        raise TypeError("cannot pass a candidate function as an argument")
    return encode(value)


def _from_worker(harness, value):
    decoded = decode(value)
    if type(decoded) is Handle:
        return Remote(harness, {"handle": decoded.number})
    return decoded


def _read_all(fd, deadline):
    chunks, size = [], 0
    try:
        while size <= MAX_STDOUT:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return b"".join(chunks), True
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)[:MAX_STDOUT], False


def _kill_the_rest(jailed, spawner):
    """Stop every process the candidate could still be running in before the result is printed. In a jail
    (its own PID namespace) that is kill(-1): everything but us and the namespace's init, daemons included.
    Outside one (the unsafe local backend) kill(-1) would hit the whole machine, so only the zygote's process
    group is killed there - and a daemon may survive, as everything may without isolation."""
    try:
        if jailed:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(spawner.zygote_pid, signal.SIGKILL)
    except OSError:
        pass


def _make_non_dumpable():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def main():
    config_path = sys.argv[1]
    _make_non_dumpable()
    config_fd = os.open(config_path, os.O_RDONLY)
    os.unlink(config_path)
    python, solution_path = sys.executable, os.path.abspath("solution.py")
    spawner = Spawner(python, solution_path, [config_fd])  # forked before the config is read: it never holds the nonce
    with os.fdopen(config_fd, "rb") as handle:
        config = json.loads(handle.read())
    record = {"v": 1, "mode": config["mode"]}
    try:
        with open(solution_path, "rb") as handle:
            compile(handle.read(), "solution.py", "exec", dont_inherit=True)
        record["compiled"] = True
    except BaseException as error:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError ...
        record["compiled"] = False
        record["error"] = (type(error).__name__ + ": " + str(error))[:300]
    if record["compiled"]:
        harness = Harness(config, spawner)
        try:
            if config["mode"] == "function":
                record["cases"] = harness.run_function_cases()
            elif config["mode"] == "stdio":
                record["cases"] = harness.run_stdio_cases()
            else:
                record["cases"] = harness.run_assert_tests()
        except CandidateError as error:
            record["error"] = str(error)[:300]
        if harness.load_error is not None:
            record["import_error"] = harness.load_error
    _kill_the_rest(config.get("jailed") is True, spawner)
    line = config["nonce"] + " " + json.dumps(record, separators=(",", ":")) + "\n"
    os.write(1, line.encode())


if __name__ == "__main__":
    main()
