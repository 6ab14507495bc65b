"""A local stand-in for the Hugging Face hub's HTTP API, enough for `from_pretrained` of a model repository.

    with HubStandIn({"acme/tiny-chat": model_dir}) as hub:      # then HF_ENDPOINT=hub.url in the loading process
        ...

It answers what `huggingface_hub` asks when a model is fetched: ``HEAD``/``GET /{repo}/resolve/{revision}/{file}``
(with the commit and ETag headers it reads; a missing file is a 404 with ``X-Error-Code: EntryNotFound``, as
the hub answers) and ``GET /api/models/{repo}[/revision/{revision}]`` and ``.../tree/...`` listings. It is a
stand-in: the real hub's redirects to a CDN, Xet storage, authentication and rate limits are not exercised.
`hub.requests` lists the paths asked for.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "1" * 40


class HubStandIn:
    def __init__(self, repos: dict[str, Path]):
        self.repos = {name: Path(path) for name, path in repos.items()}
        self.requests: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                standin._answer(self, body=False)

            def do_GET(self) -> None:
                standin._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = handler.path.split("?")[0]
        self.requests.append(f"{handler.command} {path}")
        if path.startswith("/api/models/"):
            return self._api(handler, path.removeprefix("/api/models/"), body)
        for name, root in self.repos.items():
            prefix = f"/{name}/resolve/"
            if path.startswith(prefix):
                _revision, _, file = path.removeprefix(prefix).partition("/")
                target = root / file
                if target.is_file():
                    data = target.read_bytes()
                    etag = hashlib.sha256(data).hexdigest() if file.endswith(".safetensors") else \
                        hashlib.sha1(data).hexdigest()
                    return self._send(handler, 200, data, body, {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT},
                                      "application/octet-stream")
                return self._send(handler, 404, b"Entry not found", body, {"X-Error-Code": "EntryNotFound",
                                                                          "X-Repo-Commit": COMMIT})
        self._send(handler, 404, b"Repository not found", body, {"X-Error-Code": "RepoNotFound"})

    def _api(self, handler: BaseHTTPRequestHandler, rest: str, body: bool) -> None:
        for name, root in self.repos.items():
            if rest == name or rest.startswith(name + "/"):
                files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
                if "/tree/" in rest:
                    listing = [{"type": "file", "path": f, "oid": COMMIT, "size": (root / f).stat().st_size}
                               for f in files if f.startswith(rest.partition("/tree/")[2].partition("/")[2])]
                    return self._send(handler, 200, json.dumps(listing).encode(), body, {}, "application/json")
                info = {"id": name, "modelId": name, "sha": COMMIT, "private": False,
                        "siblings": [{"rfilename": f} for f in files]}
                return self._send(handler, 200, json.dumps(info).encode(), body, {}, "application/json")
        self._send(handler, 404, b"{}", body, {"X-Error-Code": "RepoNotFound"}, "application/json")

    @staticmethod
    def _send(handler, status: int, data: bytes, body: bool, headers: dict[str, str], kind: str = "text/plain"):
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)
