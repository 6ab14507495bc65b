"""The data flywheel: verified episodes -> preference pairs and SFT samples that the readers accept."""

import json

from posttrain.cli import main
from posttrain.data import read_samples
from posttrain.data.flywheel import episodes_to_pairs, episodes_to_sft


def episode(task, passed, answer, failure=None):
    return {
        "task_id": task, "domain": "arithmetic", "difficulty": 2, "passed": passed, "score": float(passed),
        "failure": failure or ("none" if passed else "wrong_answer"),
        "messages": [{"role": "user", "content": f"{task}?"}, {"role": "assistant", "content": answer}],
    }


EPISODES = [
    episode("t1", True, "46"), episode("t1", False, "45"), episode("t1", True, "46"),  # a duplicate success
    episode("t1", False, "", failure="infra"),  # never a rejected answer
    episode("t2", False, "1"), episode("t2", False, "2"),  # no success: no pair
    episode("t3", True, "7"), episode("t3", False, "8", failure="truncated"),
]


def test_pairs_use_successes_against_model_failures_only():
    pairs = episodes_to_pairs(EPISODES, per_task=3)
    assert {p["metadata"]["task_id"] for p in pairs} == {"t1", "t3"}
    for pair in pairs:
        assert pair["prompt"] == [{"role": "user", "content": f"{pair['metadata']['task_id']}?"}]
        assert pair["chosen"][0]["content"] in ("46", "7")
        assert pair["rejected"][0]["content"] in ("45", "8")
        assert pair["metadata"]["rejected_failure"] != "infra"
    assert len([p for p in pairs if p["metadata"]["task_id"] == "t1"]) == 1  # one distinct failure to pair


def test_sft_from_distinct_successes():
    samples = episodes_to_sft(EPISODES, source="run-7")
    assert [(s["metadata"]["task_id"], s["messages"][-1]["content"]) for s in samples] == [("t1", "46"), ("t3", "7")]
    assert all(s["metadata"]["source"] == "run-7" for s in samples)


def test_cli_writes_files_the_readers_accept(tmp_path):
    episodes = tmp_path / "episodes.jsonl"
    episodes.write_text("".join(json.dumps(e) + "\n" for e in EPISODES))
    assert main(["data", "sft", str(episodes), "--out", str(tmp_path / "sft.jsonl")]) == 0
    assert len(read_samples(str(tmp_path / "sft.jsonl"))) == 2
    assert main(["data", "pairs", str(episodes), "--out", str(tmp_path / "pairs.jsonl")]) == 0
    from posttrain.config import DataSource
    from posttrain.data.preference import read_preference_pairs

    pairs = read_preference_pairs(DataSource(path=str(tmp_path / "pairs.jsonl")))
    assert len(pairs) == 2
