"""`model.path` as a hub id: read from a hub-shaped local cache when the user set HF_HUB_OFFLINE, a one-line error
when the id is not there; and posttrain itself never sets offline mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

LOAD = """
from posttrain.config import ModelConfig
from posttrain.models import load_model, load_tokenizer
config = ModelConfig(path="acme/tiny-chat")
tokenizer = load_tokenizer(config)
model = load_model(config, tokenizer)
print("loaded", type(model).__name__, model.get_input_embeddings().num_embeddings, len(tokenizer))
"""


def _hub_cache(home: Path, repo: str, tokenizer, model) -> None:
    """The layout huggingface_hub writes: hub/models--org--name/{refs/main, snapshots/<commit>/...}."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    snapshot = root / "snapshots" / commit
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


def _run(code: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": SRC, "HF_HOME": str(home), **env}
    # A fresh interpreter importing torch and transformers takes minutes on a loaded 2-core machine.
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=600)


def test_a_hub_id_loads_from_the_cache_when_offline(tmp_path, tiny_tokenizer, tiny_model):
    _hub_cache(tmp_path, "acme/tiny-chat", tiny_tokenizer, tiny_model)
    done = _run(LOAD, tmp_path, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    assert f"loaded LlamaForCausalLM {tiny_model.get_input_embeddings().num_embeddings}" in done.stdout


def test_an_uncached_hub_id_offline_is_one_line_naming_it_and_the_fix(tmp_path):
    code = LOAD.replace("acme/tiny-chat", "acme/not-there")
    code = "from posttrain.models import ModelError\ntry:\n" + "".join(
        f"    {line}\n" for line in code.strip().splitlines()) + "except ModelError as e:\n    print('ERR', e)\n"
    done = _run(code, tmp_path, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith("ERR model.path:") and "\n" not in message
    assert "acme/not-there" in message and "HF_HUB_OFFLINE" in message and "hf download" in message


def test_a_path_that_is_neither_dir_nor_hub_id_is_rejected(tmp_path):
    from posttrain.config import ModelConfig
    from posttrain.models import ModelError, load_tokenizer

    with pytest.raises(ModelError, match="is not a local directory, nor a hub id"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "missing" / "model")))


def test_the_cli_never_forces_offline_mode(monkeypatch, capsys):
    from posttrain.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert main(["recipes"]) == 0
    assert "HF_HUB_OFFLINE" not in os.environ


def _online_env(home: Path, endpoint: str) -> dict[str, str]:
    """An online process: HF_HUB_OFFLINE unset, the hub at `endpoint` (the local stand-in), an empty cache."""
    environment = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**environment, "PYTHONPATH": SRC, "HF_HOME": str(home), "HF_ENDPOINT": endpoint}


def test_a_hub_id_is_fetched_online_then_loads_offline_from_the_cache(tmp_path, tiny_tokenizer, tiny_model):
    """The online path through the real huggingface_hub and transformers HTTP code, against a local stand-in
    of the hub (tests/hub_standin.py): the real hub (CDN redirects, Xet storage, auth) is not reached here."""
    from hub_standin import HubStandIn

    tiny_model.save_pretrained(tmp_path / "repo")
    tiny_tokenizer.save_pretrained(tmp_path / "repo")
    home = tmp_path / "home"
    with HubStandIn({"acme/tiny-chat": tmp_path / "repo"}) as hub:
        done = subprocess.run([sys.executable, "-c", LOAD], env=_online_env(home, hub.url), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        fetched = {request.rsplit("/", 1)[-1] for request in hub.requests if request.startswith("GET /acme/")}
        missing = LOAD.replace("acme/tiny-chat", "acme/not-there")
        failed = subprocess.run([sys.executable, "-c", _catching(missing)], env=_online_env(home, hub.url),
                                capture_output=True, text=True, timeout=600)
    assert f"loaded LlamaForCausalLM {tiny_model.get_input_embeddings().num_embeddings}" in done.stdout
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= fetched
    message = failed.stdout.strip()  # online, a wrong id: one line naming it, the hub, and the fix
    assert message.startswith("ERR model.path: could not fetch 'acme/not-there' from the Hugging Face hub")
    assert "\n" not in message
    offline = _run(LOAD, home, HF_HUB_OFFLINE="1")  # what was fetched is now in the cache
    assert offline.returncode == 0 and "loaded LlamaForCausalLM" in offline.stdout, offline.stderr


def _catching(code: str) -> str:
    return "from posttrain.models import ModelError\ntry:\n" + "".join(
        f"    {line}\n" for line in code.strip().splitlines()) + "except ModelError as e:\n    print('ERR', e)\n"
