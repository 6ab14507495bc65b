"""The reward-model recipe: it ranks held-out pairs above chance, it is saved as a plain transformers
`AutoModelForSequenceClassification` that scores what we score, any such model loads as a scorer and as PPO's
critic, and a run resumes exactly."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

from posttrain.config import ConfigError, RMRecipe, load_recipe
from posttrain.models import ModelError, load_reward_model, save_model_dir, tiny_config
from posttrain.models.reward import STATS_FILE
from posttrain.train.reward_model import run_rm

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


def rm_recipe(pairs: Path, output: Path, *overrides: str) -> RMRecipe:
    return load_recipe(ROOT / "src/posttrain/recipes/rm-arithmetic.yaml", [
        f"output_dir={output}", f"data.train=[{{path: {pairs}/train.jsonl}}]",
        f"data.heldout=[{{path: {pairs}/heldout.jsonl}}]", "model.preset=tiny-1m", "optim.lr=3e-3",
        "tracking.tensorboard=false", "tracking.progress=false", "runtime.num_threads=1", *overrides], RMRecipe)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A reward model trained on 1,000 arithmetic pairs (chosen = the right sum, rejected = a random wrong one)."""
    root = tmp_path_factory.mktemp("rm")
    pairs = write_pairs(root / "pairs", 1000, 200)
    return run_rm(rm_recipe(pairs, root / "run", "train.epochs=2")), pairs


def heldout_conversations(pairs: Path) -> list[tuple[list, list]]:
    records = [json.loads(line) for line in (pairs / "heldout.jsonl").read_text().splitlines()]
    return [(r["prompt"] + [r["chosen"]], r["prompt"] + [r["rejected"]]) for r in records]


def test_reward_model_ranks_heldout_pairs_above_chance(trained):
    result, _ = trained
    assert result.heldout_start["accuracy"] < 0.65
    assert result.heldout["accuracy"] > 0.7, result.heldout  # measured: ~0.5 -> ~0.8
    assert result.heldout["loss"] < result.heldout_start["loss"]


def test_saved_reward_model_is_a_plain_sequence_classifier_that_scores_as_ours(trained):
    result, pairs = trained
    reward = load_reward_model(result.output_dir)  # a run directory resolves to its final/
    hf = AutoModelForSequenceClassification.from_pretrained(result.final_dir).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    conversations = [c for pair in heldout_conversations(pairs)[:8] for c in pair]
    ids = [reward._ids(c) for c in conversations]
    pad = reward.tokenizer.pad_token_id
    batch = torch.full((len(ids), max(map(len, ids))), pad)
    for row, sequence in enumerate(ids):
        batch[row, : len(sequence)] = torch.tensor(sequence)
    with torch.no_grad():  # transformers reads each right-padded row at its last non-pad token, as we do
        theirs = hf(input_ids=batch).logits.squeeze(-1)
    torch.testing.assert_close(torch.tensor(reward(conversations)), theirs, rtol=0, atol=1e-5)
    assert theirs.std() > 1e-3  # not a constant: the comparison above could fail


def test_saved_reward_model_scores_conversations_and_token_ids(trained):
    result, pairs = trained
    final = result.final_dir
    stats = json.loads((final / STATS_FILE).read_text())
    assert stats["format"] == "posttrain-reward-stats/1" and stats["std"] > 0

    reward = load_reward_model(final)
    chosen, rejected = heldout_conversations(pairs)[0]
    single = reward(chosen)
    assert isinstance(single, float)
    batch = reward([chosen, rejected])
    assert batch[0] == pytest.approx(single, abs=1e-5)
    text = reward.tokenizer.apply_chat_template(chosen, tokenize=False)
    ids = reward.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reward(ids) == pytest.approx(single, abs=1e-5)
    assert reward([ids, ids[:-1]])[0] == pytest.approx(single, abs=1e-5)

    normalized = load_reward_model(final, normalize=True)
    assert normalized(chosen) == pytest.approx((single - stats["mean"]) / stats["std"], abs=1e-4)

    # Held-out ranking through the loader agrees with the recipe's figure.
    conversations = heldout_conversations(pairs)
    chosen_scores = reward([c for c, _ in conversations])
    rejected_scores = reward([r for _, r in conversations])
    accuracy = sum(c > r for c, r in zip(chosen_scores, rejected_scores)) / len(conversations)
    assert accuracy == pytest.approx(result.heldout["accuracy"], abs=0.02)


def test_checkpoint_keeps_the_head_for_resume(trained):
    result, _ = trained
    from posttrain.models import latest_checkpoint, load_training_state

    state = load_training_state(latest_checkpoint(result.output_dir))
    assert set(state["reward_head"]) == {"weight"}  # transformers' score head has no bias
    final = load_file(str(result.final_dir / "model.safetensors"))  # the final head is the last checkpoint's
    torch.testing.assert_close(final["score.weight"], state["reward_head"]["weight"].float())


def test_resume_is_exact(tmp_path):
    pairs = write_pairs(tmp_path / "pairs", 64, 0)
    overrides = ("train.max_steps=6", "train.save_every=2", "train.batch_size=8", "runtime.precision=fp32",
                 "data.heldout=[]")
    straight: dict[int, float] = {}
    run_rm(rm_recipe(pairs, tmp_path / "straight", *overrides), on_step=lambda s, m: straight.__setitem__(s, m["loss"]))

    class Stop(Exception):
        pass

    def stop_at_3(step, metrics):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        run_rm(rm_recipe(pairs, tmp_path / "crashed", *overrides), on_step=stop_at_3)
    resumed: dict[int, float] = {}
    run_rm(rm_recipe(pairs, tmp_path / "crashed", *overrides), resume=True,
           on_step=lambda s, m: resumed.__setitem__(s, m["loss"]))
    assert sorted(resumed) == [3, 4, 5, 6]  # from the checkpoint of step 2
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), step


def test_a_sequence_classifier_from_elsewhere_scores_and_inits_the_critic(tmp_path, tiny_tokenizer):
    """Any one-label AutoModelForSequenceClassification is a reward model (and PPO's critic), not only ours."""
    config = tiny_config("tiny-1m", tiny_tokenizer)
    config.num_labels = 1
    torch.manual_seed(5)
    foreign = LlamaForSequenceClassification(config).eval()
    directory = save_model_dir(tmp_path / "foreign", foreign, tiny_tokenizer)
    assert not (directory / STATS_FILE).exists()
    reward = load_reward_model(directory, normalize=True)  # no statistics: normalizing is the identity
    sequences = [[3, 30, 31, 1, 40, 1], [3, 30, 1]]
    batch = torch.full((2, 6), tiny_tokenizer.pad_token_id)
    for row, ids in enumerate(sequences):
        batch[row, : len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        theirs = foreign(input_ids=batch).logits.squeeze(-1)
    torch.testing.assert_close(torch.tensor(reward.score_ids(sequences)), theirs, rtol=0, atol=1e-5)

    from posttrain.config.rl import RLRecipe
    from posttrain.models import build_tiny_model
    from posttrain.rl import make_critic
    from posttrain.train import Runtime

    recipe = RLRecipe.model_validate({"algorithm": {"advantage": "gae"}, "critic": {"path": str(directory)}})
    runtime = Runtime(device=torch.device("cpu"), autocast_dtype=None)
    critic = make_critic(recipe, build_tiny_model("tiny-1m", tiny_tokenizer), tiny_tokenizer, runtime)
    ids = torch.tensor([sequences[0]])
    with torch.no_grad():
        every_position = foreign(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        expected = foreign.score(every_position)[0, :-1, 0]
    values = critic.model.token_values(ids, torch.ones((1, 5), dtype=torch.bool))
    torch.testing.assert_close(values.detach(), expected, rtol=0, atol=1e-5)


def test_loading_something_else_is_a_clear_error(tmp_path, tiny_model, tiny_tokenizer):
    with pytest.raises(ModelError, match="not a reward model \\(no config.json\\)"):
        load_reward_model(tmp_path)
    causal = save_model_dir(tmp_path / "causal", tiny_model, tiny_tokenizer)
    with pytest.raises(ModelError, match="architectures \\['LlamaForCausalLM'\\].*num_labels 1"):
        load_reward_model(causal)


def test_lora_reward_model_cannot_skip_the_merge():
    with pytest.raises(ConfigError, match="merge_on_save: false is not available for rm"):
        load_recipe(None, ["model.lora.enabled=true", "model.lora.merge_on_save=false"], RMRecipe)
