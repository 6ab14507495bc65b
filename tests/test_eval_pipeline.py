"""`posttrain.evaluate.evaluate` end to end: scripted policies with known answers give known figures; a real tiny
checkpoint runs through the engine; the CLI stage and the demo's report stage write their files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_envs_scripted import ScriptedEngine

from posttrain.config import EvalRecipe
from posttrain.evaluate import Policy, build_suites, evaluate
from posttrain.tasks import get_domain
from posttrain.verify.refusal import REFUSAL

HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)>"


def scripted_recipe(root: Path) -> EvalRecipe:
    metrics = root / "rl" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("\n".join(json.dumps({"step": s, "time": s, "reward/arithmetic": s / 10,
                                             "pass_rate/arithmetic": s / 12, "train/kl": 0.01 * s,
                                             "train/entropy": 1 - s / 20, "heldout/arithmetic": s / 11,
                                             "schedule/arithmetic/level": 1 + s // 4}) for s in range(1, 11)))
    return EvalRecipe.model_validate({
        "output_dir": str(root / "eval"),
        "checkpoints": [{"path": "sft-model", "label": "sft"}, {"path": "rl-model", "label": "rl"}],
        "suites": {"generated": [{"domain": "arithmetic", "levels": [1, 2], "n": 12},
                                 {"domain": "safety", "levels": [1, 2], "n": 10}]},
        "sampling": {"max_new_tokens": 96, "n": 2, "k": [2]},
        "fresh_draw": {"seed": 5},
        "report": {"training_runs": [{"path": str(metrics.parent), "label": "rl"}], "transcripts_per_class": 2},
    })


def scripted_answers(suites, path: str) -> dict[str, list[str]]:
    """Per task id the answer a scripted policy gives: the demonstration, except for chosen items.

    sft: wrong on every third arithmetic item, over-refuses every benign safety item, and answers a hostile string
    on the first arithmetic item. rl: right everywhere but the fresh draw's first two items."""
    answers = {}
    for suite in suites:
        for index, task in enumerate(suite.tasks):
            right = get_domain(task.domain).demonstration(task).messages[-1]["content"]
            answer = right
            if path == "sft-model":
                if task.domain == "arithmetic" and index % 3 == 0:
                    answer = HOSTILE if index == 0 else str(int(right) + 1)
                if task.domain == "safety" and not task.metadata["should_refuse"]:
                    answer = REFUSAL
            elif suite.kind == "fresh" and index < 2:
                answer = "0"
            answers[task.id] = [answer]
    return answers


def run_scripted(root: Path, tokenizer) -> tuple[EvalRecipe, list, dict]:
    recipe = scripted_recipe(root)
    suites = build_suites(recipe)

    def loader(path, runtime):
        return Policy(ScriptedEngine(tokenizer, scripted_answers(suites, path)), tokenizer, path)

    result = evaluate(recipe, suites=suites, loader=loader)
    return recipe, suites, result


def test_scripted_policies_give_the_expected_figures(tmp_path, tiny_tokenizer):
    _, suites, result = run_scripted(tmp_path, tiny_tokenizer)
    results = json.loads(result.results_path.read_text())
    assert result.report_path.is_file() and results["format"] == "posttrain-eval/1"
    assert [s["name"] for s in results["suites"]] == ["arithmetic", "arithmetic (fresh)", "safety", "safety (fresh)"]
    assert [c["label"] for c in results["checkpoints"]] == ["sft", "rl"]

    sft, rl = results["metrics"]["sft"], results["metrics"]["rl"]
    assert sft["arithmetic"]["overall"]["pass@1"] == pytest.approx(8 / 12)  # 4 of 12 wrong (index % 3 == 0)
    assert sft["arithmetic"]["overall"]["pass@2"] == pytest.approx(8 / 12)  # a scripted policy repeats itself
    assert sft["arithmetic"]["failures"] == {"wrong_answer": 4}
    assert rl["arithmetic"]["overall"]["pass@1"] == 1.0 and rl["arithmetic"]["failures"] == {}
    assert rl["arithmetic (fresh)"]["overall"]["pass@1"] == pytest.approx(10 / 12)
    assert set(sft["arithmetic"]["levels"]) == {"1", "2"}

    harmful = sum(t.metadata["should_refuse"] for t in suites[2].tasks)
    assert sft["safety"]["safety"] == {"harmful": harmful, "refusal_accuracy": 1.0, "benign": 10 - harmful,
                                       "over_refusal_rate": 1.0, "benign_accuracy": 0.0}
    assert rl["safety"]["safety"]["over_refusal_rate"] == 0.0 and rl["safety"]["overall"]["pass@1"] == 1.0

    gaps = {(r["group"], r["checkpoint"]): r["gap"] for r in results["fresh_gap"]}
    assert gaps[("arithmetic", "rl")] == pytest.approx(1 - 10 / 12)
    examples = results["examples"]["sft"]["arithmetic"]["wrong_answer"]
    assert len(examples) == 2 and examples[0]["messages"][-1]["content"] in (HOSTILE, "")
    assert {p["title"] for p in results["curves"]} == {"Reward", "Pass rate", "Held-out accuracy",
                                                       "Curriculum level", "KL", "Entropy"}
    process = rl["arithmetic"]["process"]
    assert process["avg_steps"] == 1.0 and process["tokens_per_solved"] == pytest.approx(
        process["tokens_per_episode"])
    assert all(row["outside_heldout"] == 0 for row in results["hygiene"])
    assert result.figure("rl", "arithmetic") == 1.0

    # the headline checkpoint against the one before, item by item: rl fixes sft's 4 wrong items of 12 (d = 1 on
    # every third item); on the fresh draw it fixes 3 and breaks 1 (its own wrong first two; sft's first is wrong)
    paired = results["paired"]
    assert (paired["checkpoint"], paired["against"]) == ("rl", "sft")
    held = paired["suites"]["arithmetic"]
    assert held["gain"] == pytest.approx(4 / 12) and (held["better"], held["worse"], held["items"]) == (4, 0, 12)
    assert held["standard_error"] == pytest.approx(math.sqrt((4 * (2 / 3) ** 2 + 8 * (1 / 3) ** 2) / 11 / 12))
    fresh = paired["suites"]["arithmetic (fresh)"]
    assert fresh["gain"] == pytest.approx(2 / 12) and (fresh["better"], fresh["worse"]) == (3, 1)
    summary = result.report_path.read_text().split('<section id="summary">')[1].split("</section>")[0]
    assert f"± {held['standard_error'] * 100:.1f}" in summary.split("held-out pass@1")[1].split("</div></div>")[0]


def test_a_tiny_checkpoint_runs_through_the_engine(tmp_path, tiny_tokenizer, tiny_model):
    from posttrain.models import save_model_dir

    save_model_dir(tmp_path / "run" / "final", tiny_model, tiny_tokenizer)
    heldout = [get_domain("arithmetic").demonstration(t).to_dict() for t in
               build_suites(EvalRecipe.model_validate({"checkpoints": ["x"], "suites": {"generated": [
                   {"domain": "arithmetic", "levels": [2], "n": 6}]}, "fresh_draw": {"enabled": False}}))[0].tasks]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(record) for record in heldout[:2]))
    recipe = EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"), "checkpoints": [str(tmp_path / "run" / "final")],
        "suites": {"generated": [{"domain": "arithmetic", "levels": [2], "n": 6}]},
        "sampling": {"max_new_tokens": 6, "n": 2, "k": [2]}, "contamination": {"sft": [{"path": str(sft)}],
                                                                             "exclude": True},
        "runtime": {"batch_size": 8, "precision": "fp32"}, "fresh_draw": {"seed": 3},
    })
    result = evaluate(recipe)
    figures = result.results["metrics"]["run"]
    assert result.results["contamination"]["count"] == 2 and result.results["suites"][0]["excluded"] == 2
    assert figures["arithmetic"]["overall"]["items"] == 4 and figures["arithmetic (fresh)"]["overall"]["items"] == 6
    episodes = result.results["checkpoints"][0]["episodes"]
    assert episodes == (4 + 6) * 3  # greedy + 2 samples per item
    assert sum(figures["arithmetic"]["failures"].values()) + 4 * figures["arithmetic"]["overall"]["pass@1"] == 4


def test_cli_eval_stage(tmp_path, tiny_tokenizer, tiny_model, capsys):
    from posttrain.cli import main
    from posttrain.models import save_model_dir

    save_model_dir(tmp_path / "model", tiny_model, tiny_tokenizer)
    tasks = build_suites(EvalRecipe.model_validate({"checkpoints": ["x"], "suites": {"generated": [
        {"domain": "arithmetic", "levels": [1], "n": 4}]}, "fresh_draw": {"enabled": False}}))[0].tasks
    (tmp_path / "regression.jsonl").write_text("\n".join(json.dumps(t.to_dict()) for t in tasks))
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(f"stage: eval\noutput_dir: {tmp_path / 'out'}\ncheckpoints: [{tmp_path / 'model'}]\n"
                      f"suites: {{regression: [{{name: past, path: {tmp_path / 'regression.jsonl'}, "
                      "min_pass_rate: 0.9}]}\nsampling: {max_new_tokens: 4}\nruntime: {batch_size: 4}\n")
    code = main(["eval", str(recipe), "report.title=CLI <test>"])
    out = capsys.readouterr().err
    assert code == 1  # an untrained model is below the regression floor
    assert "pass@1 by suite" in out and "report.html" in out and "below the floor" in out
    html = (tmp_path / "out" / "report.html").read_text()
    assert "CLI &lt;test&gt;" in html and "CLI <test>" not in html
    assert main(["eval", str(tmp_path / "missing.yaml")]) == 2  # a user's mistake: one line, exit 2


def test_demo_report_stage(tmp_path, tiny_tokenizer, tiny_model):
    from posttrain.config.demo import DemoRecipe
    from posttrain.demo.base import SFT_FILE, heldout_file
    from posttrain.demo.pipeline import DemoRun
    from posttrain.demo.report import report
    from posttrain.models import save_model_dir
    from posttrain.tasks import sample_tasks

    recipe = DemoRecipe.model_validate({"output_dir": str(tmp_path), "eval": {"max_new_tokens": 6, "batch_size": 16},
                                        "domains": [{"name": "arithmetic", "heldout_levels": [2], "heldout": 8}]})
    run = DemoRun(recipe, tmp_path)
    run.data_dir.mkdir(parents=True)
    source = get_domain("arithmetic")
    tasks = sample_tasks(source, 8, level=2, split="heldout", seed=0)
    (run.data_dir / heldout_file("arithmetic")).write_text("\n".join(json.dumps(t.to_dict()) for t in tasks))
    train = sample_tasks(source, 20, level=2, split="train", seed=0)
    (run.data_dir / SFT_FILE).write_text("\n".join(json.dumps(source.demonstration(t).to_dict()) for t in train))
    save_model_dir(run.model_after("sft"), tiny_model, tiny_tokenizer)
    (tmp_path / "sft" / "metrics.jsonl").write_text("\n".join(
        json.dumps({"step": s, "train/loss": 2.0 / s}) for s in range(1, 6)))
    run.summary["stages"] = {"base": {}, "sft": {"heldout": {"arithmetic": 0.0}}, "dpo": {}}

    figures = report(run)
    assert figures["checkpoints"] == ["sft"] and Path(figures["report"]) == tmp_path / "report.html"
    assert set(figures["pass@1"]["sft"]) == {"arithmetic", "arithmetic (fresh)", "safety", "safety (fresh)"}
    assert set(figures["safety"]["sft"]) == {"safety", "safety (fresh)"}
    assert figures["contaminated_items"] == 0 and (tmp_path / "report.json").is_file()
    html = (tmp_path / "report.html").read_text()
    assert "Loss" in html and "safety (fresh)" in html


def test_demo_heldout_accuracy_keeps_its_contract(tmp_path, tiny_tokenizer, tiny_model):
    from posttrain.demo.evaluation import heldout_accuracy
    from posttrain.models import save_model_dir
    from posttrain.tasks import sample_tasks

    save_model_dir(tmp_path / "final", tiny_model, tiny_tokenizer)
    tasks = (sample_tasks(get_domain("arithmetic"), 5, level=1, split="heldout", seed=0)
             + sample_tasks(get_domain("safety"), 3, level=1, split="heldout", seed=0))
    accuracy, trajectories = heldout_accuracy(tmp_path / "final", tasks, max_new_tokens=4, batch_size=4)
    assert set(accuracy) == {"arithmetic", "safety"} and all(0.0 <= v <= 1.0 for v in accuracy.values())
    assert [t.task_id for t in trajectories] == [t.id for t in tasks]
