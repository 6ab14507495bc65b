"""The reward-hacking suite: known exploits score 0 and honest solutions score 1, through `verify` as training
would call it. The cases live in tests/data/exploits.yaml, so a new exploit is one entry there."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.types import Task
from posttrain.verify import verify

SUITE = yaml.safe_load((Path(__file__).parent / "data" / "exploits.yaml").read_text())

pytestmark = pytest.mark.bwrap  # the code and reasoning-gym entries run in the sandbox


def _task(entry: dict) -> Task:
    return Task(id=entry["name"], domain="reward_hacking", messages=[{"role": "user", "content": "..."}],
                verifier=entry["verifier"], verifier_args=entry["args"])


def test_the_suite_is_big_enough():
    assert len(SUITE["exploits"]) >= 20 and len(SUITE["honest"]) >= 20
    names = [e["name"] for e in SUITE["exploits"] + SUITE["honest"]]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("entry", SUITE["exploits"], ids=lambda e: e["name"])
def test_exploit_scores_nothing(entry):
    reward = verify(_task(entry), entry["completion"], entry.get("final_state"))
    assert not reward.is_infrastructure_failure, reward.details
    assert not reward.passed
    assert reward.score <= entry.get("max_score", 0.0), reward.details


@pytest.mark.parametrize("entry", SUITE["honest"], ids=lambda e: e["name"])
def test_honest_solution_scores_full(entry):
    reward = verify(_task(entry), entry["completion"], entry.get("final_state"))
    assert reward.passed and reward.score == 1.0, reward.details


NAIVE_RUNNER = """
{solution}

{asserts}
print("OK")
"""


def test_the_code_exploits_fool_a_naive_judge():
    """Protection off: judged the common shortcut ways - the exit code of solution + in-process asserts, or an
    "OK" printed after them - several of the exploits above pass, so the suite would notice a verifier that
    regressed to either."""
    from posttrain.sandbox import Sandbox
    from posttrain.verify import code_block

    fooled = []
    for entry in SUITE["exploits"]:
        tests = entry["args"].get("tests") if entry["verifier"] == "code" else None
        if not isinstance(tests, dict) or tests.get("function") != "add":
            continue
        solution = code_block(entry["completion"]) or ""
        asserts = "\n".join(f"assert add(*{c['args']}) == {c['expected']}" for c in tests["cases"])
        result = Sandbox().run_python(NAIVE_RUNNER.format(solution=solution, asserts=asserts), timeout_s=1)
        if result.exit_code == 0 or "OK" in result.stdout:
            fooled.append(entry["name"])
    assert {"sys_exit_at_import", "os_exit_at_import", "always_equal_object", "int_subclass_equal_to_everything",
            "fake_pass_banner"} <= set(fooled), fooled
