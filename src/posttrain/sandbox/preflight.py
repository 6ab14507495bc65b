"""No silent fallback: find bubblewrap and prove it can build a jail here, or say exactly how to fix it.

`find_bubblewrap` raises `SandboxError` naming the package to install; `explain_jail_failure` turns
bubblewrap's complaint about namespaces into the setting to change. `SandboxPool` calls both before its
first run, so a machine that cannot sandbox fails at start-up with one clear message instead of scoring
every program 0.
"""

from __future__ import annotations

import os
import shutil

from posttrain.sandbox.errors import SandboxError

INSTALL_HINT = (
    "install bubblewrap: `sudo apt-get install bubblewrap` (Debian/Ubuntu), `sudo dnf install bubblewrap` "
    "(Fedora/RHEL), `sudo pacman -S bubblewrap` (Arch). On a platform without Linux namespaces, "
    "SandboxPool(backend='unsafe-local') runs programs WITHOUT isolation (it warns on every run)."
)

NAMESPACE_HINT = (
    "bubblewrap could not create the jail's namespaces. Allow unprivileged user namespaces: "
    "`sudo sysctl -w user.max_user_namespaces=15000` (and on Debian <= 10 `kernel.unprivileged_userns_clone=1`); "
    "on Ubuntu >= 23.10 `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile "
    "for bwrap; inside Docker run with `--security-opt seccomp=unconfined --security-opt apparmor=unconfined` "
    "(or use a VM). Bubblewrap said: "
)

_NAMESPACE_WORDS = ("namespace", "uid map", "setting up uid", "Operation not permitted", "Permission denied",
                    "No permissions", "pivot_root", "Creating new namespace failed")


def find_bubblewrap(explicit: str | None = None) -> str:
    """The bwrap executable to use: `explicit`, $PATH, or /usr/bin/bwrap; SandboxError if there is none."""
    candidates = [explicit] if explicit else [shutil.which("bwrap"), "/usr/bin/bwrap"]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    where = f" at {explicit}" if explicit else ""
    raise SandboxError(f"bubblewrap (bwrap) not found{where}: {INSTALL_HINT}")


def explain_jail_failure(error: str) -> SandboxError:
    """A SandboxError for a jail that could not start at pool start-up, with the fix when we recognise it."""
    if any(word.lower() in error.lower() for word in _NAMESPACE_WORDS):
        return SandboxError(NAMESPACE_HINT + error.strip()[-400:])
    return SandboxError(f"the sandbox could not run a trivial program: {error.strip()[-600:]}")
