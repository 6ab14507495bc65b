"""The adapter recipes (grpo-gym, grpo-openenv, grpo-verifiers) run as packaged on the built-in tiny model.

Fast: one step each through the CLI (the OpenEnv one against the packaged example server, started here on a free
port). Slow: the full runs, whose held-out pass rate must rise from the fresh model's baseline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from posttrain.cli import main

RECIPES = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes"
FAST = ["train.max_steps=1", "rollout.prompts_per_step=2", "rollout.sampling.group_size=2", "train.eval_every=null",
        "schedule.guard.enabled=false", "model.preset=tiny-1m", "runtime.num_threads=1"]


@pytest.fixture(scope="module")
def digits_server():
    import importlib.util

    import uvicorn

    spec = importlib.util.spec_from_file_location("env_digits_server", RECIPES / "env_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(module.make_app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _episodes(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "episodes.jsonl").read_text().splitlines() if line.strip()]


def _extra(name: str, url: str | None) -> list[str]:
    return [f"domains.0.args.base_url={url}"] if name == "grpo-openenv" else []


@pytest.mark.parametrize("name", ["grpo-gym", "grpo-verifiers", "grpo-openenv"])
def test_adapter_recipe_fast(tmp_path, name, request):
    url = request.getfixturevalue("digits_server") if name == "grpo-openenv" else None
    assert main(["rl", name, *FAST, *_extra(name, url), f"output_dir={tmp_path / 'run'}"]) == 0
    episodes = _episodes(tmp_path / "run")
    assert episodes and not any(e["failure"] in ("infra", "sandbox_failure") for e in episodes)
    verifier = "verifiers" if name == "grpo-verifiers" else "environment"
    assert all(e["details"]["verifier"] == verifier for e in episodes)
    assert any("reward/mean" in m for m in _metrics(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["grpo-gym", "grpo-verifiers", "grpo-openenv"])
def test_adapter_recipe_full_raises_the_heldout_pass_rate(tmp_path, name, request):
    url = request.getfixturevalue("digits_server") if name == "grpo-openenv" else None
    assert main(["rl", name, *_extra(name, url), f"output_dir={tmp_path / 'run'}"]) == 0
    heldout = [m["heldout/mean"] for m in _metrics(tmp_path / "run") if "heldout/mean" in m]
    print(name, "held-out pass rate:", heldout)
    assert heldout[-1] >= heldout[0] + 0.5
