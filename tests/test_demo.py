"""The demo pipeline (`posttrain demo`) at toy scale: its data hygiene, and every stage end to end."""

from __future__ import annotations

import filecmp
import json
from collections import Counter
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_recipe
from posttrain.config.demo import DemoRecipe
from posttrain.demo import run_demo
from posttrain.types import PosttrainError


def toy_recipe(tmp_path, stages: str, extra: list[str] | None = None) -> DemoRecipe:
    path = tmp_path / "demo.yaml"
    path.write_text(f"""\
stage: demo
output_dir: {tmp_path / 'run'}
preset: tiny-1m
vocab_size: 320
stages: {stages}
domains:
  - {{name: arithmetic, args: {{operators: "+"}}, sft_levels: [1, 2], demos: 300, level_demos: {{3: 25}},
     heldout_levels: [2, 3], heldout: 40, validation: 10}}
  - {{name: calculator, sft_levels: [1], demos: 40, heldout_levels: [1], heldout: 8, validation: 0}}
sft:
  data: {{max_length: 96}}
  optim: {{lr: 2.0e-3, warmup_steps: 2}}
  train: {{batch_size: 16, max_steps: 6, log_every: 3}}
dpo_pairs: {{prompts: 16, samples: 2, per_task: 1}}
dpo:
  train: {{batch_size: 4, epochs: 1}}
rl:
  domains:
    - {{name: arithmetic, args: {{operators: "+"}}, levels: [3], heldout: 0}}
    - {{name: calculator, levels: [1], heldout: 0}}
  rollout: {{prompts_per_step: 4, sampling: {{group_size: 4, max_new_tokens: 24}}}}
  train: {{max_steps: 2, micro_batch_size: 16}}
eval: {{max_new_tokens: 24, batch_size: 32}}
""")
    return load_recipe(path, extra or [], DemoRecipe)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_base_stage_keeps_heldout_items_out_of_the_demonstrations(tmp_path):
    summary = run_demo(toy_recipe(tmp_path, "[]"))
    data = tmp_path / "run" / "data"
    demos = read_jsonl(data / "sft_train.jsonl")
    arithmetic = [d for d in demos if d["metadata"]["domain"] == "arithmetic"]
    assert len(arithmetic) == 325 and summary["stages"]["base"]["demonstrations"]["arithmetic"] == 325
    assert Counter(d["metadata"]["difficulty"] for d in arithmetic)[3] == 25  # the few hard demonstrations

    def questions(records):  # the first user turn: the problem itself
        return {next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records}

    trained = questions(demos)
    for name in ("arithmetic", "calculator"):
        test = questions(read_jsonl(data / f"heldout_{name}.jsonl"))
        validation = questions(read_jsonl(data / f"validation_{name}.jsonl"))
        assert test and not test & trained, name
        assert not validation & test and not validation & trained, name
    assert {t["difficulty"] for t in read_jsonl(data / "heldout_arithmetic.jsonl")} == {2, 3}


def test_a_fresh_demo_clears_its_own_directory_and_never_one_holding_other_files(tmp_path):
    """A fresh demo clears its output directory: `--output ~/work` deleted the user's files there."""
    recipe = toy_recipe(tmp_path, "[]")
    run_demo(recipe)
    (tmp_path / "run" / "sft").mkdir()  # a stage's directory from an earlier run: the demo's own
    run_demo(recipe)  # a demo directory is cleared and written again
    assert not (tmp_path / "run" / "sft").exists() and (tmp_path / "run" / "summary.json").is_file()
    (tmp_path / "run" / "thesis.tex").write_text("three years of work")
    with pytest.raises(PosttrainError, match=r"holds files a demo does not write \(thesis.tex\).*nothing was deleted"):
        run_demo(recipe)
    assert (tmp_path / "run" / "thesis.tex").read_text() == "three years of work"
    assert (tmp_path / "run" / "summary.json").is_file()


def test_level_demos_may_not_repeat_the_spread_levels(tmp_path):
    with pytest.raises(ConfigError, match=r"level_demos: levels \[2\] are in sft_levels"):
        toy_recipe(tmp_path, "[]", ["domains.0.level_demos={2: 5}"])


def test_every_stage_runs_records_its_figures_and_resumes(tmp_path):
    recipe = toy_recipe(tmp_path, "[sft, dpo, rl, sft_control, report]",
                        ["eval.pass_k_samples=2", "eval.pass_k=[2]", "eval.pass_k_domains=[calculator]"])
    summary = run_demo(recipe)
    stages = summary["stages"]
    trained = ["sft", "rl", "sft_control"]
    # Six SFT steps solve none of the sampled tasks (seeded: the same on every machine): no success/failure pair,
    # so DPO says so, writes no (empty) pairs file, and RL starts from SFT. (`make demo` takes the other branch.)
    assert stages["dpo"]["pairs"] == 0 and stages["dpo"]["sampled_pass_rate"] == 0.0
    assert stages["dpo"]["skipped"] and not (tmp_path / "run" / "dpo" / "final").exists()
    assert not (tmp_path / "run" / "data" / "dpo_pairs.jsonl").exists()
    for stage in trained:
        assert set(stages[stage]["heldout"]) == {"arithmetic", "calculator"}, stage
        assert all(0.0 <= v <= 1.0 for v in stages[stage]["heldout"].values())
        assert (tmp_path / "run" / stage / "final" / "config.json").is_file()
    assert stages["rl"]["steps"] == 2 and stages["rl"]["started_from"] == "sft"
    assert stages["sft_control"]["seconds"] > 0
    # the report shows the stages' own figures: sampled pass@k per level, the judging share, the compute matched
    html = (tmp_path / "run" / "report.html").read_text()
    runs = html.split('<section id="runs">')[1].split("</section>")[0]
    for stage in trained:
        [(level, figures)] = stages[stage]["pass_at_k_by_level"]["calculator"].items()
        assert (f"<td>{stage}</td><td>calculator</td><td>{level}</td><td>{figures['pass@1'] * 100:.1f}%</td>"
                f"<td>{figures['pass@2'] * 100:.1f}%</td>") in runs, stage
        assert f"<td>{stage}</td><td>{stages[stage]['steps']}</td><td>{stages[stage]['stopped_by']}</td>" in runs
    share = stages["rl"]["judging"]["share"]["calculator"]
    assert f"<td>calculator</td><td>{share * 100:.1f}%</td>" in runs
    compute = stages["rl"]["compute"]
    assert f"<td>rl</td><td>{compute['sampled_tokens']:,}</td><td>{compute['trained_tokens']:,}</td>" in runs
    assert f"<td>{stages['sft_control']['compute']['trained_tokens']:,}</td>" in runs
    # each stage against the one it is measured against, item by item: the paired differences are the stages'
    # own pass-rate differences (no infrastructure failures here), and the report shows them
    comparisons = {(c["after"], c["before"]): c for c in summary["comparisons"]}
    assert set(comparisons) == {("rl", "sft"), ("rl", "sft_control"), ("sft_control", "sft")}  # DPO skipped
    for (after, before), c in comparisons.items():
        for domain, g in c["greedy"].items():
            assert g["gain"] == pytest.approx(stages[after]["heldout"][domain] - stages[before]["heldout"][domain])
            assert g["items"] == (40 if domain == "arithmetic" else 8) and g["better"] + g["worse"] <= g["items"]
        [(level, after_k)] = stages[after]["pass_at_k_by_level"]["calculator"].items()
        before_k = stages[before]["pass_at_k_by_level"]["calculator"][level]
        assert c["sampled"]["calculator"]["gain"] == pytest.approx(after_k["pass@1"] - before_k["pass@1"])
        assert f"<td>{after} - {before}</td><td>calculator</td><td>greedy</td>" in runs
    # the report's episodes on the fixed held-out sets are the stages' own (the episode cache): none sampled
    # again, and the same figures; only the fresh draws and the generated safety suites are new. The toy RL has
    # no reward signal (every group all wrong), so its checkpoint holds SFT's very weights: the cache, keyed by
    # the files' content, then serves it SFT's episodes on every suite.
    results = json.loads((tmp_path / "run" / "report.json").read_text())
    rows = {row["label"]: row for row in results["checkpoints"]}
    unchanged = all(filecmp.cmp(f, tmp_path / "run" / "rl" / "final" / f.name, shallow=False)
                    for f in (tmp_path / "run" / "sft" / "final").iterdir() if f.is_file())
    for label, row in rows.items():
        cached = row["items"] if label == "rl" and unchanged else 40 + 8
        assert (row["cached_episodes"], row["episodes"]) == (cached, row["items"] - cached), label
        for domain, rate in stages[label]["heldout"].items():
            assert results["metrics"][label][domain]["overall"]["pass@1"] == pytest.approx(rate)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    again = run_demo(recipe, resume=True)  # every stage finished: nothing runs twice
    assert again == summary


def test_rl_s_guard_watches_the_domains_only_sft_trained_on_items_of_their_own(tmp_path):
    from posttrain.demo.pipeline import DemoRun
    from posttrain.demo.rl import guard_suites
    from posttrain.tasks import split_of

    # RL trains calculator only: arithmetic, which SFT trained, is what the guard must watch
    recipe = toy_recipe(tmp_path, "[sft, rl]", ["guard_items=25", "rl.train.eval_every=1",
                                                 "rl.domains=[{name: calculator, levels: [1], heldout: 0}]"])
    summary = run_demo(recipe)
    data = tmp_path / "run" / "data"
    assert sorted(p.name for p in data.glob("guard_*.jsonl")) == ["guard_arithmetic.jsonl"]
    guard = read_jsonl(data / "guard_arithmetic.jsonl")
    keys = {t["metadata"]["problem_key"] for t in guard}
    assert len(guard) == 25 == len(keys) and {t["difficulty"] for t in guard} == {2, 3}  # its heldout_levels
    assert all(split_of(key) == "heldout" for key in keys)
    for name in ("heldout", "validation"):  # never a test or validation problem
        used = {t["metadata"]["problem_key"] for t in read_jsonl(data / f"{name}_arithmetic.jsonl")}
        assert used and not keys & used, name
    figures = summary["stages"]["rl"]["guard"]
    assert figures["items"] == {"arithmetic": 25}
    # the baseline, after steps 1 and 2, and the final evaluation, each with its pass rate and seconds
    assert [(e["step"], e["final"]) for e in figures["evaluations"]] == [(0, False), (1, False), (2, False),
                                                                         (2, True)]
    assert all(0.0 <= e["pass_rate"]["arithmetic"] <= 1.0 and e["seconds"] > 0 for e in figures["evaluations"])
    assert figures["eval_seconds"] > 0 and figures["replay_tokens"] >= 0

    run = DemoRun(recipe, tmp_path / "run")
    rl = recipe.rl.model_copy(deep=True)
    [suite] = guard_suites(run, rl)  # replays arithmetic at the levels SFT demonstrated, with its generator's args
    assert (suite.name, suite.domain, suite.levels, suite.args) == ("arithmetic", "arithmetic", [1, 2, 3],
                                                                    {"operators": "+"})
    rl.domains = toy_recipe(tmp_path, "[]").rl.domains  # RL trains every domain SFT did: nothing to watch
    assert guard_suites(run, rl) == []
    run.recipe = toy_recipe(tmp_path, "[]", ["guard_items=0"])  # 0: off
    assert guard_suites(run, recipe.rl) == []


def test_the_control_s_compute_counts_the_guard_s_replayed_demonstrations():
    from posttrain.demo.rl import control_steps, rl_compute

    history = [{"tokens/sampled": 600.0, "tokens/trained": 100.0},
               {"tokens/sampled": 300.0, "tokens/trained": 50.0, "guard/replay_tokens": 40.0}]
    # sampled: a forward (2N) each; trained, the replayed demonstrations too: forward and backward (6N) each
    assert rl_compute(history) == {"sampled_tokens": 900, "trained_tokens": 190, "train_token_equivalents": 490}
    assert control_steps(490, 100.0) == 5


def code_recipe(tmp_path, name: str, extra: list[str] | None = None) -> DemoRecipe:
    """A toy demo with the code domain (sandboxed function cases) and fractions (the math verifier)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""\
stage: demo
output_dir: {tmp_path / name}
seed: 3
preset: tiny-1m
vocab_size: 400
stages: [sft, rl, sft_control]
domains:
  - {{name: code, sft_levels: [1], demos: 40, heldout_levels: [1], heldout: 12, validation: 4}}
  - {{name: fractions, sft_levels: [1], demos: 60, heldout_levels: [1], heldout: 10, validation: 4}}
sft:
  data: {{max_length: 256}}
  optim: {{lr: 2.0e-3, warmup_steps: 2}}
  train: {{batch_size: 8, epochs: 1, max_minutes: 30, log_every: 3, eval_every: 4}}
  runtime: {{num_threads: 1}}
rl:
  domains:
    - {{name: code, levels: [1], heldout: 0}}
    - {{name: fractions, levels: [1], heldout: 0}}
  rollout: {{prompts_per_step: 2, sampling: {{group_size: 2, max_new_tokens: 16}}}}
  train: {{max_steps: 2, max_minutes: 30, micro_batch_size: 8}}
  runtime: {{num_threads: 1}}
eval: {{max_new_tokens: 16, batch_size: 32, pass_k_samples: 2, pass_k: [2]}}
""")
    return load_recipe(path, extra or [], DemoRecipe)


def test_code_and_fractions_data_never_share_a_problem_between_train_and_heldout(tmp_path):
    run_demo(code_recipe(tmp_path, "hygiene", ["stages=[]", "domains.0.demos=300", "domains.0.sft_levels=[1, 2]",
                                               "domains.0.heldout_levels=[1, 2]", "domains.0.heldout=60",
                                               "domains.0.validation=20"]))
    data = tmp_path / "hygiene" / "data"
    demos = read_jsonl(data / "sft_train.jsonl")
    for name in ("code", "fractions"):
        trained = [d for d in demos if d["metadata"]["domain"] == name]
        prompts = {next(m["content"] for m in d["messages"] if m["role"] == "user") for d in trained}
        test, validation = read_jsonl(data / f"heldout_{name}.jsonl"), read_jsonl(data / f"validation_{name}.jsonl")
        keys = {t["metadata"]["problem_key"] for t in test}
        assert trained and test and validation, name
        assert all(t["metadata"]["split"] == "heldout" for t in test + validation), name
        assert not keys & {t["metadata"]["problem_key"] for t in validation}, name
        # a problem is its family and parameters (code) or its two fractions: the same problem drawn twice with
        # other example cases still has the same key, so keys, not prompts, are what must not cross
        assert not {t["messages"][-1]["content"] for t in test + validation} & prompts, name
    code_test = read_jsonl(data / "heldout_code.jsonl")
    assert len(code_test) == 60 and {t["difficulty"] for t in code_test} == {1, 2}
    from posttrain.tasks import get_domain, split_of

    code = get_domain("code")
    for demo in (d for d in demos if d["metadata"]["domain"] == "code"):
        # every demonstration's problem hashes to the train split: none is a held-out problem
        prompt = next(m["content"] for m in demo["messages"] if m["role"] == "user")
        assert not any(prompt == t["messages"][-1]["content"] for t in code_test)
    assert code.max_level == 3 and split_of(code_test[0]["metadata"]["problem_key"]) == "heldout"


def test_a_fixed_seed_gives_the_same_steps_and_figures_twice(tmp_path):
    first = run_demo(code_recipe(tmp_path, "one"))["stages"]
    second = run_demo(code_recipe(tmp_path, "two"))["stages"]

    def figures(stages):  # everything but wall times (and the machine's speed in tokens/s)
        drop = {"seconds", "tokens_per_s", "judging"}
        return {stage: {k: v for k, v in values.items() if k not in drop} for stage, values in stages.items()}

    assert figures(first) == figures(second)
    sft, rl, control = first["sft"], first["rl"], first["sft_control"]
    assert sft["stopped_by"] == "epochs" and rl["stopped_by"] == "steps" and rl["steps"] == 2
    assert set(rl["heldout"]) == {"code", "fractions"}
    assert set(sft["pass_at_k_by_level"]["code"]["1"]) == {"pass@1", "pass@2"}
    # the control: as many SFT steps as make up RL's FLOPs (sampling 2N, training 6N per token) at SFT's tokens/step
    compute = rl["compute"]
    assert compute["sampled_tokens"] > 0 and compute["trained_tokens"] >= 0
    assert compute["train_token_equivalents"] == round(compute["sampled_tokens"] / 3 + compute["trained_tokens"])
    assert control["steps"] == max(1, -(-compute["train_token_equivalents"] // sft["tokens_per_step"]))
    assert control["compute"]["matched"] == compute["train_token_equivalents"]
    assert control["compute"]["trained_tokens"] >= compute["train_token_equivalents"] * 0.5
    # code is judged in the sandbox: its share of RL's step time is measured (wall time, a share in [0, 1])
    assert 0.0 < rl["judging"]["share"]["code"] <= rl["judging"]["share"]["all"] <= 1.0


def test_rl_starts_from_dpo_after_it_unless_rl_from_says_sft(tmp_path):
    from posttrain.demo.pipeline import DemoRun
    from posttrain.demo.rl import rl_start

    recipe = toy_recipe(tmp_path, "[sft, dpo, rl]")
    run = DemoRun(recipe, tmp_path / "run", summary={"stages": {"sft": {}, "dpo": {}}})
    for stage in ("sft", "dpo"):
        run.model_after(stage).mkdir(parents=True)
    assert rl_start(run) == ("dpo", run.model_after("dpo"))
    run.recipe = toy_recipe(tmp_path, "[sft, dpo, rl]", ["rl_from=sft"])
    assert rl_start(run) == ("sft", run.model_after("sft"))
    with pytest.raises(ConfigError, match="rl_from"):
        toy_recipe(tmp_path, "[sft, dpo, rl]", ["rl_from=dpo"])


def test_dpo_s_samples_and_the_tier_speed_probe_run_in_the_recipe_s_precision(tmp_path, monkeypatch):
    """DPO's pair sampling and the distill stage's tokens/s probe build their engines as the evaluations do, in the
    stage recipe's precision (they ran plain fp32 whatever `precision` said: on a bf16 machine the tier table's
    speed was not the speed of the engine that served the report)."""
    import torch

    import posttrain.evaluate as evaluate
    from posttrain.demo.distill import decode_speed
    from posttrain.demo.pipeline import DemoRun

    loaded = []

    def recording(path, runtime=None, *args, **kwargs):
        policy = load(path, runtime, *args, **kwargs)
        loaded.append((Path(path).parent.name, policy.engine.autocast))
        return policy

    load = evaluate.load_policy
    monkeypatch.setattr(evaluate, "load_policy", recording)
    recipe = toy_recipe(tmp_path, "[sft, dpo]", ["dpo.runtime.precision=bf16", "sft.runtime.precision=fp32"])
    stages = run_demo(recipe)["stages"]
    assert stages["dpo"]["sampled_pass_rate"] == 0.0  # the toy SFT's samples were judged (none passes)
    # SFT's checkpoint is loaded by its stage's evaluation, then by DPO's sampling, in DPO's precision
    assert [stage for stage, _ in loaded].count("sft") == 2 and loaded[-1] == ("sft", torch.bfloat16)
    run = DemoRun(recipe, tmp_path / "run")
    for precision, autocast in (("bf16", torch.bfloat16), ("fp32", None)):
        run.recipe.distill.runtime.precision = precision
        loaded.clear()
        figures = decode_speed(run, run.model_after("sft"))
        assert loaded == [("sft", autocast)] and figures["decode_tokens_per_s"] > 0 and figures["parameters"] > 0


def test_the_report_tables_name_the_guard_s_regressions_by_step():
    from posttrain.config import ReportTable
    from posttrain.demo.summary import report_tables

    evaluations = [{"step": 0, "pass_rate": {"calculator": 0.43, "safety": 0.9}},
                   {"step": 30, "pass_rate": {"calculator": 0.47, "safety": 0.9}}]
    events = [{"kind": "regression", "step": 25, "suite": "calculator"}, {"kind": "recovered", "step": 30,
                                                                         "suite": "calculator"}]
    guard = {"items": {"calculator": 30, "safety": 30}, "evaluations": evaluations, "events": events,
             "eval_seconds": 19.6, "replay_samples": 40}
    [table] = [ReportTable.model_validate(t) for t in report_tables({"stages": {"rl": {"guard": guard}}}, 8, 1.0)]
    assert table.rows == [["calculator", 30, 0.43, 0.47, "25"], ["safety", 30, 0.9, 0.9, None]]
    assert table.percent == [2, 3] and "40 demonstrations replayed" in table.lead


def test_stage_comparisons_pair_the_items_and_combine_the_domains_errors():
    from posttrain.demo.summary import stage_comparisons

    def items(code, maths):
        return {"greedy": {"code": dict(enumerate(code)), "maths": dict(enumerate(maths))},
                "sampled": {"code": {i: v / 4 for i, v in enumerate(code)}}}

    sft = items([0, 0, 1, 1], [1, 1, 1, 0])
    rl = items([1, 0, 1, 1], [1, 1, 1, 0])  # code: one item better, none worse; maths: the same outcomes
    rl_sft, dpo_sft = stage_comparisons({"sft": sft, "rl": rl, "dpo": sft})  # no sft_control: no rl - sft_control
    assert dpo_sft["mean"]["gain"] == 0.0 and dpo_sft["greedy"]["code"]["better"] == 0
    c = rl_sft
    assert (c["after"], c["before"]) == ("rl", "sft")
    code, maths = c["greedy"]["code"], c["greedy"]["maths"]
    assert code["gain"] == 0.25 and (code["better"], code["worse"], code["items"]) == (1, 0, 4)
    assert code["standard_error"] == pytest.approx((0.25 / 4) ** 0.5) and maths["standard_error"] == 0.0
    assert c["mean"]["gain"] == pytest.approx(0.125) and c["mean"]["standard_error"] == pytest.approx(0.125)
    assert c["sampled"]["code"]["gain"] == pytest.approx(0.0625)


def test_the_summary_names_the_differences_beyond_two_standard_errors(capsys):
    from posttrain.demo.summary import print_details

    def pair(gain, error):
        return {"gain": gain, "standard_error": error, "items": 100, "better": 1, "worse": 1}

    comparison = {"after": "rl", "before": "sft_control", "greedy": {"code": pair(-0.05, 0.048)},
                  "sampled": {"code": pair(-0.09, 0.033)}, "mean": {"gain": -0.018, "standard_error": 0.012,
                                                                    "domains": 6}}
    print_details({"stages": {}, "comparisons": [comparison]})
    line = next(line for line in capsys.readouterr().err.splitlines() if "rl - sft_control" in line)  # say: stderr
    assert line.endswith("beyond two standard errors: code sampled pass@1 -9.0 ± 3.3")
