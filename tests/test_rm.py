"""The reward-model recipe: it ranks held-out pairs above chance, and its saved form loads as a scorer."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from posttrain.config import RMRecipe, load_recipe
from posttrain.models import ModelError
from posttrain.train.reward_model import HEAD_FILE, HEAD_META, load_reward_model, run_rm

ROOT = Path(__file__).resolve().parents[1]


def write_pairs(directory: Path, train: int, heldout: int) -> Path:
    spec = importlib.util.spec_from_file_location("dpo_bench", ROOT / "bench" / "dpo_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("heldout", heldout)):
        records = bench.arithmetic_pairs(count, levels=(2,), split=split, trace=False, wrong="random")
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A reward model trained on 1,000 arithmetic pairs (chosen = the right sum, rejected = a random wrong one)."""
    root = tmp_path_factory.mktemp("rm")
    pairs = write_pairs(root / "pairs", 1000, 200)
    recipe = load_recipe(ROOT / "src/posttrain/recipes/rm-arithmetic.yaml", [
        f"output_dir={root / 'run'}", f"data.train=[{{path: {pairs}/train.jsonl}}]",
        f"data.heldout=[{{path: {pairs}/heldout.jsonl}}]", "model.preset=tiny-1m", "train.epochs=2",
        "optim.lr=3e-3", "tracking.tensorboard=false", "tracking.progress=false", "runtime.num_threads=1"], RMRecipe)
    return run_rm(recipe), pairs


def test_reward_model_ranks_heldout_pairs_above_chance(trained):
    result, _ = trained
    assert result.heldout_start["accuracy"] < 0.65
    assert result.heldout["accuracy"] > 0.7, result.heldout  # measured: ~0.5 -> ~0.8
    assert result.heldout["loss"] < result.heldout_start["loss"]


def test_saved_reward_model_scores_conversations_and_token_ids(trained):
    result, pairs = trained
    final = result.final_dir
    meta = json.loads((final / HEAD_META).read_text())
    assert meta["format"] == "posttrain-reward-head/1" and meta["score_position"] == "last_token"
    assert (final / HEAD_FILE).is_file() and (final / "config.json").is_file()

    reward = load_reward_model(result.output_dir)  # a run directory resolves to its final/
    record = json.loads((pairs / "heldout.jsonl").read_text().splitlines()[0])
    chosen = record["prompt"] + [record["chosen"]]
    rejected = record["prompt"] + [record["rejected"]]
    single = reward(chosen)
    assert isinstance(single, float)
    batch = reward([chosen, rejected])
    assert batch[0] == pytest.approx(single, abs=1e-5)
    text = reward.tokenizer.apply_chat_template(chosen, tokenize=False)
    ids = reward.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reward(ids) == pytest.approx(single, abs=1e-5)
    assert reward([ids, ids[:-1]])[0] == pytest.approx(single, abs=1e-5)

    normalized = load_reward_model(final, normalize=True)
    assert normalized(chosen) == pytest.approx((single - meta["mean"]) / meta["std"], abs=1e-4)

    # Held-out ranking through the loader agrees with the recipe's figure.
    records = [json.loads(line) for line in (pairs / "heldout.jsonl").read_text().splitlines()]
    chosen_scores = reward([r["prompt"] + [r["chosen"]] for r in records])
    rejected_scores = reward([r["prompt"] + [r["rejected"]] for r in records])
    accuracy = sum(c > r for c, r in zip(chosen_scores, rejected_scores)) / len(records)
    assert accuracy == pytest.approx(result.heldout["accuracy"], abs=0.02)


def test_checkpoint_keeps_the_head_for_resume(trained):
    result, _ = trained
    from posttrain.models import latest_checkpoint, load_training_state

    state = load_training_state(latest_checkpoint(result.output_dir))
    assert set(state["reward_head"]) == {"weight", "bias"}
    from safetensors.torch import load_file

    head = load_file(str(result.final_dir / HEAD_FILE))  # the final head is the last checkpoint's
    torch.testing.assert_close(head["weight"], state["reward_head"]["weight"].float())


def test_loading_something_else_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="not a posttrain reward model"):
        load_reward_model(tmp_path)
    (tmp_path / HEAD_META).write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(ModelError, match="unknown reward head format 'other/9'"):
        load_reward_model(tmp_path)
