"""The user's own code, named in a recipe: modules and files imported before a run, and `module:function` refs.

    imports: [my_pkg.rewards, ./my_env.py]          # a recipe's `imports:` (every stage has the key)
    rewards: [{function: "my_rewards:brevity"}]     # an RL reward term naming a function

An entry ending in ``.py`` (or holding a path separator) is a file, read relative to the recipe's directory; anything
else is a module name, imported with the recipe's directory and the working directory on ``sys.path`` (so a
`my_rewards.py` beside the recipe imports as ``my_rewards``). A file is imported once per process under a name
derived from its absolute path, so importing it again (another stage, a resumed run) does not register its
``@verifier`` / ``@domain`` twice. Every process of a run calls `import_all` with the same list: the local
process (`posttrain.config.load_recipe`), each torchrun rank (it loads the recipe itself) and each Ray worker
(`posttrain.distributed`'s worker set-up), so registrations exist wherever tasks are made or judged.

This module is at the bottom of the import graph beside `posttrain.types`: `config` resolves the list, `verify`
resolves reward functions, `distributed` imports in its workers.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

from posttrain.types import PosttrainError


class UserCodeError(PosttrainError):
    """A module, file or function the recipe names could not be imported or found."""


def is_file_ref(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def resolve_entry(entry: str, base_dir: str | Path | None = None) -> str:
    """A file entry made absolute against `base_dir` (the recipe's directory); a module name as it is."""
    if not is_file_ref(entry):
        return entry
    path = Path(entry).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or ".") / path
    return str(path.resolve())


def import_entry(entry: str, base_dir: str | Path | None = None) -> ModuleType:
    """Import one `imports:` entry (a module name or a .py file); `UserCodeError` in one line on failure."""
    if is_file_ref(entry):
        return _import_file(Path(resolve_entry(entry, base_dir)), entry)
    with _on_path(base_dir):
        try:
            return importlib.import_module(entry)
        except ModuleNotFoundError as error:
            if error.name and entry.startswith(error.name):
                raise UserCodeError(f"imports: no module named '{entry}' (install it, put it on PYTHONPATH, "
                                    "or name its file: ./path/to/module.py)") from None
            raise UserCodeError(f"imports: '{entry}' failed: {_where(error)}") from None
        except Exception as error:  # noqa: BLE001 - the user's module raised while importing
            raise UserCodeError(f"imports: '{entry}' failed: {_where(error)}") from None


def import_all(entries: Iterable[str], base_dir: str | Path | None = None) -> list[ModuleType]:
    return [import_entry(entry, base_dir) for entry in entries]


def resolve_function(ref: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable a ``module:function`` or ``path/to/file.py:function`` reference names."""
    module_ref, sep, name = ref.rpartition(":")
    if not sep or not module_ref or not name:
        raise UserCodeError(f"function '{ref}': expected 'module:function' or 'file.py:function'")
    if len(module_ref) == 1 and module_ref.isalpha():  # a Windows drive letter, not a module
        raise UserCodeError(f"function '{ref}': expected 'module:function' or 'file.py:function'")
    module = import_entry(module_ref, base_dir)
    function = module
    for part in name.split("."):
        function = getattr(function, part, None)
        if function is None:
            public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
            raise UserCodeError(f"function '{ref}': '{module_ref}' has no '{name}' "
                                f"(its functions: {', '.join(public) or 'none'})")
    if not callable(function):
        raise UserCodeError(f"function '{ref}': '{name}' is a {type(function).__name__}, not a function")
    return function  # type: ignore[return-value]


def _import_file(path: Path, entry: str) -> ModuleType:
    if not path.is_file():
        raise UserCodeError(f"imports: '{entry}': no such file ({path})")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    name = f"posttrain_user.{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"imports: '{entry}': not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _on_path(path.parent):  # the file may import its siblings
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the user's file raised while importing
            del sys.modules[name]
            raise UserCodeError(f"imports: '{entry}' failed: {_where(error)}") from None
    return module


class _on_path:
    """`directory` and the working directory on sys.path while importing (left there: later lazy imports of the
    user's package need them too)."""

    def __init__(self, directory: str | Path | None):
        self.directories = [str(Path(directory).resolve())] if directory else []
        self.directories.append(str(Path.cwd()))

    def __enter__(self) -> None:
        for directory in self.directories:
            if directory not in sys.path:
                sys.path.append(directory)

    def __exit__(self, *exc: object) -> None:
        return None


def _where(error: BaseException) -> str:
    """`Type: message (file:line)` of the innermost frame: the line of the user's code that raised."""
    frames = traceback.extract_tb(error.__traceback__)
    place = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{place}"
