"""`runtime.compile: auto`, RL's default: long runs compile, short ones stay eager, and what is compiled is cached
on disk under posttrain's cache directory (`posttrain.models.compile_cache`)."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.config import RLRecipe, SFTRecipe
from posttrain.models import build_tiny_model, compile_cache_dir, compile_pays, train_tokenizer, use_compile_cache
from posttrain.train import prepare_model, resolve_compile


def test_rl_defaults_to_auto_even_with_a_runtime_section_and_sft_stays_eager():
    assert RLRecipe().runtime.compile == "auto"
    assert RLRecipe.model_validate({"runtime": {"precision": "bf16"}}).runtime.compile == "auto"
    assert RLRecipe.model_validate({"runtime": {"compile": False}}).runtime.compile is False
    assert SFTRecipe().runtime.compile is False
    assert RLRecipe().runtime.compile_min_steps == 500


def test_auto_compiles_only_runs_long_enough_to_win_it_back(monkeypatch):
    runtime = RLRecipe().runtime
    cpu = torch.device("cpu")
    assert resolve_compile(runtime, 499, cpu).compile is False
    assert resolve_compile(runtime, None, cpu).compile is False
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    assert resolve_compile(runtime, 500, cpu).compile is True
    assert resolve_compile(runtime.model_copy(update={"compile_min_steps": 50}), 60, cpu).compile is True
    # an explicit choice is kept whatever the run's length
    assert resolve_compile(runtime.model_copy(update={"compile": False}), 10_000, cpu).compile is False
    assert resolve_compile(runtime.model_copy(update={"compile": True}), 1, cpu).compile is True


def test_auto_stays_eager_without_a_compiler(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    decision, reason = compile_pays(10_000, 500, "cpu")
    assert decision is False and "C++ compiler" in reason


def test_an_undecided_auto_never_compiles():
    tokenizer = train_tokenizer(["What is 1 + 2? 3"] * 20, vocab_size=64)
    model = build_tiny_model("tiny-1m", tokenizer, seed=0)
    recipe = RLRecipe()
    prepared = prepare_model(model, recipe.model, recipe.runtime)
    assert getattr(prepared.model, "_compiled_call_impl", None) is None


def test_the_compile_cache_lives_under_posttrains_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_cache_dir() == tmp_path / "cache" / "compile"
    directory = use_compile_cache()
    assert directory == tmp_path / "cache" / "compile" / "inductor" and directory.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "triton")


def test_xdg_cache_home_and_a_users_own_inductor_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("POSTTRAIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir() == tmp_path / "xdg" / "posttrain" / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("value", ["auto", True, False])
def test_the_setting_round_trips_through_yaml(value, tmp_path):
    import yaml

    from posttrain.config import load_recipe

    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({"stage": "rl", "runtime": {"compile": value}}))
    assert load_recipe(path).runtime.compile == value
    assert load_recipe(path, [f"runtime.compile={str(value).lower()}"]).runtime.compile == value
