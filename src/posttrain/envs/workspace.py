"""A per-episode workspace: the files an agent lists, reads and writes, held in memory.

Files never touch the host's disk: the model's paths are only dictionary keys, and code that uses them runs in the
sandbox, which receives a copy. Paths are relative POSIX paths without ``..``; sizes and counts are bounded so an
episode cannot grow without limit. The final state the verifier judges is `Workspace.files`.
"""

from __future__ import annotations

import posixpath

from posttrain.sandbox import SandboxError, check_file_name, file_conflicts

MAX_FILES = 200
MAX_FILE_BYTES = 200_000


class WorkspaceError(ValueError):
    """A bad path or a file too large; the message is shown to the model as a tool error."""


class Workspace:
    def __init__(self, files: dict[str, str] | None = None, max_files: int = MAX_FILES,
                 max_file_bytes: int = MAX_FILE_BYTES):
        self.max_files = max_files
        self.max_file_bytes = max_file_bytes
        self.files: dict[str, str] = {}
        for path, content in (files or {}).items():
            self.write(path, content)

    def list(self) -> list[str]:
        return sorted(self.files)

    def read(self, path: str) -> str:
        path = normalize_path(path)
        if path not in self.files:
            raise WorkspaceError(f"no such file: {path}")
        return self.files[path]

    def write(self, path: str, content: str) -> int:
        path = normalize_path(path)
        if not isinstance(content, str):
            raise WorkspaceError("content must be a string")
        try:
            size = len(content.encode("utf-8"))
        except UnicodeEncodeError as error:  # a lone surrogate, as a JSON escape can write one
            raise WorkspaceError(f"content is not UTF-8 text ({error.reason} at {error.start})") from None
        if size > self.max_file_bytes:
            raise WorkspaceError(f"file too large ({size} bytes > {self.max_file_bytes})")
        if path not in self.files and len(self.files) >= self.max_files:
            raise WorkspaceError(f"too many files (limit {self.max_files})")
        # One tree, as on a disk: a name cannot be a file and a directory at once (the sandbox could not hold both,
        # and a run that cannot start would count as the infrastructure's failure instead of the model's).
        conflicts = file_conflicts([*self.files, path])
        if conflicts:
            parent, under = conflicts[0]
            raise WorkspaceError(f"cannot write {path}: {parent} would be a file and the directory of {under}")
        self.files[path] = content
        return size

    def snapshot(self) -> dict[str, str]:
        return dict(self.files)


def normalize_path(path: object) -> str:
    """'src/a.py' stays; './src//a.py' -> 'src/a.py'; absolute paths, '..' and empty names are refused."""
    if not isinstance(path, str) or not path.strip():
        raise WorkspaceError("path must be a non-empty string")
    if "\x00" in path or "\\" in path:
        raise WorkspaceError(f"invalid path: {path!r}")
    if path.startswith("/"):
        raise WorkspaceError(f"path must be relative to the workspace: {path}")
    parts = [part for part in path.strip().split("/") if part not in ("", ".")]
    if not parts or any(part == ".." for part in parts):
        raise WorkspaceError(f"path must stay inside the workspace: {path}")
    try:
        return check_file_name(posixpath.join(*parts))  # a name the sandbox can hold (UTF-8, not too long)
    except SandboxError as error:
        raise WorkspaceError(str(error).replace("file name", "path", 1)) from None
