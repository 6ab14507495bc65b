"""Where torch.compile keeps what it compiled, so a model shape is compiled in full once per machine.

torch's inductor caches its compiled graphs (the FX graph cache) and their autograd halves (the AOT autograd
cache) on disk, both on by default, but under ``/tmp/torchinductor_<user>``: gone at every reboot, and on a
container's fresh ``/tmp`` at every start. `use_compile_cache` points them at a directory that persists:

    $POSTTRAIN_CACHE_DIR/compile, else $XDG_CACHE_HOME/posttrain/compile, else ~/.cache/posttrain/compile

A cold compile of tiny-3m's decoder stack and decode step costs ~35 s here; a warm one re-traces the Python
(dynamo) but loads the generated code instead of generating and building it. A ``TORCHINDUCTOR_CACHE_DIR`` (or
``TRITON_CACHE_DIR``) the user set is kept as it is. Nothing in the cache is trusted beyond what torch itself
trusts: its entries are keyed by a hash of the graph, the torch version and the compiler settings.

`compile_pays` is the rule behind ``runtime.compile: auto``: compile when the run has at least
``min_steps`` steps to win the one-off cost back, and a compiler to compile with.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def compile_cache_dir() -> Path:
    """The directory compiled artifacts persist in (not created)."""
    root = os.environ.get("POSTTRAIN_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "compile"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "posttrain" / "compile"


def use_compile_cache() -> Path | None:
    """Point torch's compile caches at `compile_cache_dir` (before the first compile of the process); returns
    the inductor cache directory in use, or None when it cannot be created (torch's default stays)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):  # the user's choice, or one this process already made
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    directory = compile_cache_dir()
    try:
        (directory / "inductor").mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory / "triton"))
    return directory / "inductor"


def compile_pays(max_steps: int | None, min_steps: int, device_type: str) -> tuple[bool, str]:
    """Whether ``runtime.compile: auto`` compiles, and why (for the log)."""
    if max_steps is None or max_steps < min_steps:
        return False, f"{max_steps} steps is under runtime.compile_min_steps ({min_steps}): not worth compiling"
    if device_type == "cpu" and not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        return False, "no C++ compiler on the PATH (inductor needs one on CPU)"
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed (inductor needs it on CUDA)"
    return True, f"{max_steps} steps >= runtime.compile_min_steps ({min_steps})"
