"""A newcomer's path, end to end, without editing posttrain (docs/your-own.md): their own model directory, a JSONL
of their own chats, tasks of their own and a reward function of their own, through `posttrain validate`, `sft`,
`rl` and `eval` — every file written here is the user's, every command posttrain's CLI."""

from __future__ import annotations

import json
import textwrap

import pytest

from posttrain.cli import main

QUIET = ["tracking.progress=false", "tracking.tensorboard=false", "runtime.num_threads=1"]


def _write(path, text: str):
    path.write_text(textwrap.dedent(text).lstrip())
    return path


@pytest.fixture()
def user_files(tmp_path, tiny_tokenizer, tiny_model, monkeypatch):
    """The user's working directory: a model saved by plain transformers, chats, problems, a reward function."""
    monkeypatch.chdir(tmp_path)
    tiny_model.save_pretrained(tmp_path / "my-llm")  # any HF causal LM directory with a chat-templated tokenizer
    tiny_tokenizer.save_pretrained(tmp_path / "my-llm")
    with open(tmp_path / "chat.jsonl", "w") as handle:
        for a in range(12):
            for b in range(5):
                handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                                      {"role": "assistant", "content": f"\\boxed{{{a + b}}}"}]}) + "\n")
    with open(tmp_path / "problems.jsonl", "w") as handle:
        for a in range(30):
            handle.write(json.dumps({"question": f"What is {a}+{a % 7}?", "answer": str(a + a % 7),
                                     "level": 1 + a % 2}) + "\n")
    _write(tmp_path / "my_rewards.py", """
        CALLS = []

        def brevity(completion: str, task) -> float:
            CALLS.append(task.id)
            return -len(completion) / 500
        """)
    return tmp_path


def test_own_model_data_and_reward_through_sft_grpo_and_eval(user_files, capsys):
    home = user_files
    _write(home / "sft.yaml", """
        stage: sft
        output_dir: runs/my-sft
        model: {path: my-llm}
        data: {train: [{path: chat.jsonl}], heldout_fraction: 0.1, max_length: 64}
        optim: {lr: 3.0e-3}
        train: {batch_size: 8, max_steps: 4, log_every: 1, eval_every: 4}
        """)
    assert main(["validate", "sft.yaml", *QUIET]) == 0
    assert "[[" in capsys.readouterr().out  # one rendered sample with its trained tokens marked
    assert main(["sft", "sft.yaml", *QUIET]) == 0
    assert (home / "runs/my-sft/final/config.json").is_file()

    _write(home / "grpo.yaml", """
        stage: rl
        output_dir: runs/my-grpo
        model: {path: runs/my-sft/final}
        domains:
          - {name: tasks, args: {kind: math, path: problems.jsonl, columns: {difficulty: level}}, levels: [1, 2],
             heldout: 0}
        rewards:
          - {verifier: task, name: correct, weight: 1.0}
          - {function: "my_rewards:brevity", weight: 0.2}
        rollout: {prompts_per_step: 2, sampling: {group_size: 2, max_new_tokens: 12}}
        train: {max_steps: 2}
        """)
    assert main(["validate", "grpo.yaml", *QUIET]) == 0
    assert main(["rl", "grpo.yaml", *QUIET]) == 0
    metrics = [json.loads(line) for line in (home / "runs/my-grpo/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/mean" in m]
    assert len(steps) == 2 and all("reward/correct" in m and "reward/brevity" in m for m in steps)
    episodes = [json.loads(line) for line in (home / "runs/my-grpo/episodes.jsonl").read_text().splitlines()]
    assert episodes and all(e["details"]["correct"].get("verifier") == "math" for e in episodes)

    _write(home / "eval.yaml", """
        stage: eval
        output_dir: runs/my-eval
        checkpoints: [{path: runs/my-sft/final, label: sft}, {path: runs/my-grpo/final, label: grpo}]
        suites:
          datasets: [{name: problems, path: problems.jsonl, split: heldout,
                      args: {kind: math, columns: {difficulty: level}}}]
        report: {training_runs: [{path: runs/my-grpo, label: grpo}]}
        """)
    assert main(["eval", "eval.yaml"]) == 0
    reports = list((home / "runs/my-eval").rglob("*.html"))
    assert reports, sorted(p.name for p in (home / "runs/my-eval").rglob("*"))
