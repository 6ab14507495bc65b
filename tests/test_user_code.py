"""The user's own code without editing posttrain: a recipe's `imports:` (modules and files, in this process and in
a fresh one as a worker would), every stage schema and built-in verifier present on `import posttrain.config` /
`posttrain.verify` alone, and `module:function` references."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

USER_FILE = '''
from posttrain.types import Reward
from posttrain.verify import verifier


@verifier("shouting_{tag}", blocking=False)
def verify_shouting(completion, *, final_state=None):
    return Reward(float(completion.isupper()), completion.isupper())


def brevity(completion, task):
    return -len(completion) / 100
'''


def _fresh(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": SRC}, timeout=120)


def test_a_library_call_loads_an_rl_recipe_and_every_verifier_is_registered(tmp_path):
    (tmp_path / "rl.yaml").write_text("stage: rl\nmodel: {path: some/model}\ntrain: {max_steps: 3}\n")
    done = _fresh(f"""
        from posttrain.config import load_recipe
        recipe = load_recipe({str(tmp_path / 'rl.yaml')!r})
        import posttrain.verify as verify
        print(type(recipe).__name__, recipe.train.max_steps, " ".join(verify.list_verifiers()))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    name, steps, *verifiers = done.stdout.split()
    assert (name, steps) == ("RLRecipe", "3")
    assert {"math", "code", "structured", "format", "repo_tests", "combined"} <= set(verifiers)


def test_imports_register_a_file_and_a_module_relative_to_the_recipe(tmp_path):
    (tmp_path / "my_env.py").write_text(USER_FILE.replace("{tag}", "file"))
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "rewards.py").write_text(USER_FILE.replace("{tag}", "module"))
    (tmp_path / "rl.yaml").write_text("stage: rl\nimports: [my_pkg.rewards, ./my_env.py]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # A fresh process, started in another directory: what a torchrun rank or a Ray worker does.
    done = _fresh(f"""
        from posttrain.config import load_recipe
        from posttrain.verify import list_verifiers
        recipe = load_recipe({str(tmp_path / 'rl.yaml')!r})
        load_recipe({str(tmp_path / 'rl.yaml')!r})  # a second load registers nothing twice
        print(recipe.imports[1])
        print(sorted(v for v in list_verifiers() if v.startswith("shouting")))
    """, elsewhere)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first == str(tmp_path / "my_env.py")  # made absolute: workers elsewhere find it
    assert second == "['shouting_file', 'shouting_module']"


def test_import_errors_are_one_line_naming_the_entry(tmp_path):
    from posttrain.config import ConfigError, load_recipe

    recipe = tmp_path / "rl.yaml"
    recipe.write_text("stage: rl\nimports: [no_such_pkg_xyz.rewards]\n")
    with pytest.raises(ConfigError, match=r"rl.yaml:2: imports: no module named 'no_such_pkg_xyz.rewards'"):
        load_recipe(recipe)
    (tmp_path / "broken.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    recipe.write_text("stage: rl\nimports: [broken.py]\n")
    with pytest.raises(ConfigError) as caught:
        load_recipe(recipe)
    assert "RuntimeError: boom" in str(caught.value) and "broken.py:2" in str(caught.value)
    recipe.write_text("stage: rl\nimports: [./missing.py]\n")
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe(recipe)


def test_function_references(tmp_path):
    from posttrain.usercode import UserCodeError, resolve_function

    (tmp_path / "scoring.py").write_text("def brevity(completion, task):\n    return -len(completion)\n")
    assert resolve_function(f"{tmp_path / 'scoring.py'}:brevity")("abc", None) == -3
    assert resolve_function("scoring:brevity", tmp_path)("ab", None) == -2
    with pytest.raises(UserCodeError, match="has no 'shortness' \\(its functions: brevity\\)"):
        resolve_function(f"{tmp_path / 'scoring.py'}:shortness")


def test_a_worker_imports_the_recipe_imports(tmp_path):
    """What every Ray actor runs first (`distributed.cluster.worker_setup`): module names and .py files alike."""
    (tmp_path / "my_env.py").write_text(USER_FILE.replace("{tag}", "worker"))
    done = _fresh(f"""
        import os
        from posttrain.distributed.cluster import worker_setup
        from posttrain.verify import list_verifiers
        worker_setup(1, [{str(tmp_path / 'my_env.py')!r}, "json"])
        print([v for v in list_verifiers() if v.startswith("shouting")], os.environ.get("HF_HUB_OFFLINE"))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['shouting_worker'] None"  # and the user's environment is left as it was


def test_a_reward_function_beside_the_recipe_is_found_from_anywhere(tmp_path):
    from posttrain.config import load_recipe

    (tmp_path / "my_rewards.py").write_text("def brevity(completion, task):\n    return 0.0\n")
    (tmp_path / "rl.yaml").write_text("stage: rl\nrewards:\n  - {function: 'my_rewards:brevity'}\n"
                                      "  - {function: './my_rewards.py:brevity', name: again}\n"
                                      "  - {function: 'json:dumps', name: elsewhere}\n")
    recipe = load_recipe(tmp_path / "rl.yaml")
    assert [t.function for t in recipe.rewards] == [f"{tmp_path}/my_rewards.py:brevity"] * 2 + ["json:dumps"]
