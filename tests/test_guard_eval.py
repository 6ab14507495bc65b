"""One evaluation path: the RL forgetting guard reads a suite exactly as `posttrain eval` scores it.

Infrastructure failures (here a verifier that raises) are counted and left out of the pass rate in both, so they
can neither lower a suite's pass rate in the guard's eyes nor trip the guard into boosting, replaying or rolling
back. The tasks are judged by a test verifier that reads a verdict written into each task (not the completion), so
the pass rate of an untrained tiny model is known in advance.
"""

from __future__ import annotations

import json

import pytest

from posttrain.config import EvalRecipe, RegressionSuite
from posttrain.config.rl import RLRecipe
from posttrain.evaluate import SuiteScore, evaluate, regression_suite
from posttrain.models import load_model, load_tokenizer
from posttrain.rl.guarding import RunGuard, eval_metrics_of, regression_suites, suite_evaluator
from posttrain.train import Runtime
from posttrain.types import Reward, Task
from posttrain.verify import verifier

SANDBOX_DOWN = {"now": False}  # while True, every "flaky" task's verification fails for infrastructure reasons


@verifier("test_written_verdict")
def written_verdict(completion: str, *, verdict: str, flaky: bool = False, final_state=None) -> Reward:
    if flaky and SANDBOX_DOWN["now"]:
        raise RuntimeError("simulated sandbox failure")
    return Reward(score=float(verdict == "pass"), passed=verdict == "pass")


def verdict_task(index: int, verdict: str, flaky: bool) -> Task:
    return Task(id=f"verdict-{index}", domain="verdicts", messages=[{"role": "user", "content": f"{index}+1"}],
                verifier="test_written_verdict", verifier_args={"verdict": verdict, "flaky": flaky})


# 6 pass and 2 fail among the steady tasks, 3 pass and 1 fail among the flaky ones: 9/12 with the sandbox up, and
# with it down 6/8 over the scored episodes (the same 0.75) where counting the failures as fails would say 6/12.
VERDICTS = [("pass", False)] * 6 + [("fail", False)] * 2 + [("pass", True)] * 3 + [("fail", True)]


@pytest.fixture()
def suite_file(tmp_path):
    path = tmp_path / "past.jsonl"
    path.write_text("".join(json.dumps(verdict_task(i, v, f).to_dict()) + "\n" for i, (v, f) in enumerate(VERDICTS)))
    yield path
    SANDBOX_DOWN["now"] = False


def rl_recipe(policy_dir, suite_file, tmp_path, **guard) -> RLRecipe:
    return RLRecipe.model_validate({
        "output_dir": str(tmp_path / "rl"), "model": {"path": str(policy_dir)},
        "domains": [{"name": "arithmetic", "heldout": 0}],
        "rollout": {"sampling": {"max_new_tokens": 4}, "infra_retries": 1},
        "runtime": {"precision": "fp32"},
        "schedule": {"guard": {"suites": [{"name": "past", "path": str(suite_file)}], **guard}},
    })


def guard_evaluator(recipe: RLRecipe):
    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model, tokenizer)
    runtime = Runtime(device=model.device, autocast_dtype=None)
    suites = regression_suites(recipe)
    return suites, lambda version: suite_evaluator(recipe, suites, model, tokenizer, runtime)(model, version)


def test_guard_and_eval_agree_on_a_suite_with_infrastructure_failures(policy_dir, suite_file, tmp_path):
    SANDBOX_DOWN["now"] = True
    result = evaluate(EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"), "checkpoints": [str(policy_dir)],
        "suites": {"regression": [{"name": "past", "path": str(suite_file)}]},
        "sampling": {"max_new_tokens": 4}, "runtime": {"precision": "fp32", "infra_retries": 1},
    }), write=False)
    label = result.results["checkpoints"][0]["label"]
    overall = result.results["metrics"][label]["past"]["overall"]

    _, evaluate_for_guard = guard_evaluator(rl_recipe(policy_dir, suite_file, tmp_path))
    score = evaluate_for_guard(0)["past"]
    assert score == SuiteScore(pass_rate=0.75, episodes=12, infra_failures=4)
    assert (score.pass_rate, score.episodes, score.infra_failures) == (
        overall["pass@1"], overall["episodes"], overall["infra_failures"])
    metrics = eval_metrics_of(rl_recipe(policy_dir, suite_file, tmp_path), {"past": score})
    assert metrics["regression/past"] == 0.75
    assert metrics["eval/infra_failures/past"] == 4 and metrics["eval/infra_failures"] == 4


def test_infrastructure_failures_cannot_trip_the_guard(policy_dir, suite_file, tmp_path):
    recipe = rl_recipe(policy_dir, suite_file, tmp_path, threshold=0.05, recover=0.02)
    suites, evaluate_for_guard = guard_evaluator(recipe)
    guard = RunGuard(recipe, suites)
    baseline = evaluate_for_guard(0)
    assert baseline["past"] == SuiteScore(pass_rate=0.75, episodes=12, infra_failures=0)
    assert guard.after_eval(0, baseline) == []

    SANDBOX_DOWN["now"] = True
    flaky = evaluate_for_guard(1)
    assert flaky["past"].infra_failures == 4
    # Counted as fails, the four would put the suite at 6/12, far past the threshold below its best of 0.75.
    assert 6 / 12 < 0.75 - recipe.schedule.guard.threshold
    assert guard.after_eval(1, flaky) == [] and guard.forgetting.regressed == []

    # A suite with nothing scored at all (every verification failed) is not read: no event, no pass rate.
    down = {"past": SuiteScore(pass_rate=None, episodes=12, infra_failures=12)}
    assert guard.after_eval(2, down) == [] and guard.forgetting.regressed == []
    assert "regression/past" not in eval_metrics_of(recipe, down)
    assert eval_metrics_of(recipe, down)["eval/infra_failures"] == 12

    # A real drop still trips it: the guard is reading the scores, not ignoring them.
    worse = {"past": SuiteScore(pass_rate=0.5, episodes=12, infra_failures=0)}
    assert [event["kind"] for event in guard.after_eval(3, worse)] == ["regression"]


def test_one_regression_suite_schema_for_eval_and_the_guard(tmp_path, suite_file):
    from_file = regression_suite(RegressionSuite(name="past", path=str(suite_file), count=5))
    assert from_file.kind == "regression" and len(from_file.tasks) == 5
    drawn = regression_suite(RegressionSuite(name="sums", domain="arithmetic", levels=[2]), seed=3)
    assert len(drawn.tasks) == 50 and all(task.domain == "arithmetic" for task in drawn.tasks)
    # both: the file's items, and the domain only for what the RL guard replays (the demo's guard items)
    both = RegressionSuite(name="both", path=str(suite_file), domain="arithmetic", levels=[1, 2])
    assert both.items is None and [t.id for t in regression_suite(both, seed=3).tasks] == [
        t.id for t in regression_suite(RegressionSuite(name="past", path=str(suite_file))).tasks]
    with pytest.raises(ValueError, match="set path .* or domain"):
        RegressionSuite(name="neither")
    guard_suite = RLRecipe.model_validate(
        {"schedule": {"guard": {"suites": [{"name": "sums", "domain": "arithmetic"}]}}})
    assert isinstance(guard_suite.schedule.guard.suites[0], RegressionSuite)
