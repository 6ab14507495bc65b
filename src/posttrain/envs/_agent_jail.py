"""Runs inside the jail, before the agent: a loopback TCP -> unix-socket proxy, then the agent itself.

    python3 _agent_jail.py SOCKET -- AGENT_ARGV...

The jail's network namespace has only a loopback interface, reachable from nothing else; the one way out is the
unix socket of the episode's endpoint, bound read-only into the jail. This script listens on a free loopback
port, forwards each connection to that socket byte for byte, and runs the agent with ``OPENAI_BASE_URL`` set to
``http://127.0.0.1:PORT/v1``; its exit status is the agent's (128 + N for a signal N). Standard library only: it
runs with whatever Python the jail has, copied in by `posttrain.envs.agent` (never imported by posttrain).
"""

import os
import socket
import subprocess
import sys
import threading


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            target.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((target, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, endpoint: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(endpoint)
        except OSError:
            client.close()
            upstream.close()
            continue
        for source, target in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(source, target), daemon=True).start()


def main() -> int:
    endpoint, separator, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if separator != "--" or not argv:
        print("usage: _agent_jail.py SOCKET -- AGENT_ARGV...", file=sys.stderr)
        return 2
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    threading.Thread(target=_serve, args=(listener, endpoint), daemon=True).start()
    env = dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
    try:
        code = subprocess.call(argv, env=env)
    except OSError as error:
        print(f"posttrain: cannot start the agent {argv[0]!r}: {error}", file=sys.stderr)
        return 127
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
