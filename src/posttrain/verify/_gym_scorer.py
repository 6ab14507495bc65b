"""reasoning-gym scoring inside the jail: some datasets' scorers ``eval`` the model's answer, so they run here.

Invoked as ``python _gym_scorer.py CONFIG`` with the trainer's interpreter (bound read-only into the jail).
As in `_harness.py`, the process that prints the result never runs model text: it turns non-dumpable, opens
and unlinks the config and forks the scoring child *before* reading it (the child never holds the nonce);
the child's stdout/stderr go to /dev/null and it returns one number over a pipe. The parent prints
``NONCE {"score": x}`` - or nothing, which scores 0. As in `_harness.py`, the jail's working directory leaves
``sys.path`` before the first import: no file there can stand in for a module the parent imports.
"""

import os
import sys

if __name__ == "__main__":  # os and sys came with the interpreter's start-up, before the script's directory was added
    _here = os.path.dirname(os.path.abspath(sys.argv[0]))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in (_here, os.getcwd())]

import ctypes  # noqa: E402 - after the working directory left sys.path
import json  # noqa: E402
import select  # noqa: E402


def _child(request_r, reply_w):
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        chunks = []
        while True:
            chunk = os.read(request_r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        request = json.loads(b"".join(chunks))
        import reasoning_gym

        score = reasoning_gym.get_score_answer_fn(request["dataset"])(request["answer"], request["entry"])
        os.write(reply_w, json.dumps({"score": float(score)}).encode())
    finally:
        os._exit(0)


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    config_fd = os.open(sys.argv[1], os.O_RDONLY)
    os.unlink(sys.argv[1])
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(config_fd)
        os.close(request_w)
        os.close(reply_r)
        _child(request_r, reply_w)
    os.close(request_r)
    os.close(reply_w)
    with os.fdopen(config_fd, "rb") as handle:
        config = json.loads(handle.read())
    with os.fdopen(request_w, "wb") as handle:
        handle.write(json.dumps({k: config[k] for k in ("dataset", "answer", "entry")}).encode())
    reply = b""
    while select.select([reply_r], [], [], float(config["timeout_s"]))[0]:
        chunk = os.read(reply_r, 4096)
        if not chunk:
            break
        reply += chunk
        if len(reply) > 4096:
            break
    try:  # kill(-1) only inside the jail's own PID namespace; outside one it would hit the whole machine
        os.kill(-1, 9) if config.get("jailed") is True else os.kill(pid, 9)
    except OSError:
        pass
    try:
        score = json.loads(reply)["score"]
    except (ValueError, KeyError, TypeError):
        return
    if type(score) is float and 0.0 <= score <= 1.0:
        os.write(1, (config["nonce"] + " " + json.dumps({"score": score}) + "\n").encode())


if __name__ == "__main__":
    main()
