"""Distillation: the divergences against a direct computation, the shared-tokenizer check, every mode on tiny real
models (the student's KL to the teacher falls and its agreement rises), exact resume, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.config import ConfigError, DistillRecipe, ModelConfig, SFTRecipe
from posttrain.models import ModelError, check_same_tokenizer, load_tokenizer, tokenizer_differences, train_tokenizer
from posttrain.rl import EngineAnswerSampler
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import read_metrics
from posttrain.train import forward_kl, generalized_jsd, reverse_kl, run_distill, run_sft, token_divergence

torch.set_num_threads(1)
ARITHMETIC = [{"name": "arithmetic", "levels": [1]}]


# ---- the divergences on tiny tensors ---------------------------------------------------------------------------


def _direct(student: torch.Tensor, teacher: torch.Tensor, kind: str, beta: float = 0.5, tau: float = 1.0):
    """The formulas of train.distill_losses, one row and one token at a time in float64."""
    values = []
    for s_row, t_row in zip(student.double(), teacher.double()):
        p_s = [math.exp(x) for x in (s_row / tau).tolist()]
        p_t = [math.exp(x) for x in (t_row / tau).tolist()]
        p_s = [x / sum(p_s) for x in p_s]
        p_t = [x / sum(p_t) for x in p_t]

        def kl(p, q):
            return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)

        if kind == "forward_kl":
            value = kl(p_t, p_s)
        elif kind == "reverse_kl":
            value = kl(p_s, p_t)
        else:
            m = [beta * a + (1 - beta) * b for a, b in zip(p_t, p_s)]
            value = beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)
        values.append(value * tau**2)
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("kind,beta,tau", [("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 1.0), ("jsd", 0.5, 1.0),
                                           ("jsd", 0.1, 1.0), ("jsd", 0.9, 2.0), ("forward_kl", 0.5, 2.0)])
def test_divergences_match_a_direct_computation(kind, beta, tau):
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 7, generator=generator) * 2, torch.randn(5, 7, generator=generator) * 2
    got = token_divergence(kind, student, teacher, beta=beta, temperature=tau)
    assert got.shape == (5,)
    torch.testing.assert_close(got.double(), _direct(student, teacher, kind, beta, tau), atol=1e-5, rtol=1e-5)


def test_jsd_beta_endpoints_and_limits_follow_the_gkd_convention():
    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(4, 9, generator=generator), torch.randn(4, 9, generator=generator)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=0.0), forward_kl(student, teacher))
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=1.0), reverse_kl(student, teacher))
    # Near the ends JSD(beta) is beta * forward KL, and (1 - beta) * reverse KL, to first order.
    small = 1e-4
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=small) / small, forward_kl(student, teacher),
                               atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=1 - small) / small,
                               reverse_kl(student, teacher), atol=1e-3, rtol=1e-3)
    assert not torch.allclose(forward_kl(student, teacher), reverse_kl(student, teacher))  # the limits differ


def test_divergences_vanish_on_equal_distributions_and_train_only_the_student():
    logits = torch.randn(3, 6)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert torch.allclose(token_divergence(kind, logits, logits + 5.0), torch.zeros(3), atol=1e-6)  # shift-free
    student = torch.randn(3, 6, requires_grad=True)
    teacher = torch.randn(3, 6, requires_grad=True)
    token_divergence("jsd", student, teacher, beta=0.3, temperature=2.0).sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(student, teacher, beta=1.5)


# ---- models and data -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distill")


@pytest.fixture(scope="module")
def sft_file(work) -> Path:
    domain = get_domain("arithmetic")
    path = work / "train.jsonl"
    with open(path, "w") as handle:
        for task in sample_tasks(domain, 80, level=1, seed=0):
            handle.write(json.dumps(domain.demonstration(task).to_dict()) + "\n")
    return path


@pytest.fixture(scope="module")
def teacher_dir(work, sft_file) -> Path:
    """A tiny-1m teacher that has learnt some one-digit sums (30 SFT steps, ~15 s): it passes a few of them."""
    recipe = SFTRecipe.model_validate({
        "output_dir": str(work / "teacher"), "model": {"preset": "tiny-1m"},
        "data": {"train": [{"path": str(sft_file)}], "max_length": 64, "reasoning": "drop"},
        "optim": {"lr": 1e-2, "warmup_steps": 3}, "train": {"batch_size": 16, "max_steps": 30, "log_every": 10},
        "runtime": {"precision": "fp32", "num_threads": 1}, "tracking": {"tensorboard": False, "progress": False},
    })
    return run_sft(recipe).final_dir


@pytest.fixture(scope="module")
def student_dir(work, teacher_dir) -> Path:
    """A hidden-32 Llama on the teacher's tokenizer, as any Hugging Face directory."""
    tokenizer = load_tokenizer(ModelConfig(path=str(teacher_dir)))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    path = work / "student"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def recipe_for(tmp_path: Path, teacher_dir: Path, student_dir: Path, **sections) -> DistillRecipe:
    data = {
        "output_dir": str(tmp_path / "run"),
        "teacher": {"path": str(teacher_dir)},
        "model": {"path": str(student_dir)},
        "data": {"max_length": 64, "reasoning": "drop"},
        "tasks": {"max_new_tokens": 8, "prompts": 32},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"batch_size": 16, "max_steps": 20, "log_every": 1, "eval_every": 10},
        "runtime": {"precision": "fp32", "num_threads": 1},
        "tracking": {"tensorboard": False, "progress": False},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return DistillRecipe.model_validate(data)


def sampler_for(recipe: DistillRecipe) -> EngineAnswerSampler:
    return EngineAnswerSampler(recipe.tasks, seed=recipe.runtime.seed)


def assert_student_moved_toward_teacher(result) -> None:
    start, end = result.heldout_start, result.heldout
    print(f"[{result.mode}] held-out {start} -> {end}")
    assert end["eval/kl"] < 0.7 * start["eval/kl"], (start, end)
    assert end["eval/agreement"] > start["eval/agreement"], (start, end)


# ---- the modes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
def test_logit_mode_on_sft_data_brings_the_student_to_the_teacher(tmp_path, teacher_dir, student_dir, sft_file, loss):
    recipe = recipe_for(tmp_path, teacher_dir, student_dir, distill={"loss": loss, "beta": 0.5},
                        data={"train": [{"path": str(sft_file)}], "heldout_fraction": 0.2})
    result = run_distill(recipe)
    assert_student_moved_toward_teacher(result)
    logged = [r for r in read_metrics(result.output_dir / "metrics.jsonl") if "train/kl" in r]
    assert logged[-1]["train/kl"] < logged[0]["train/kl"]
    # The checkpoint is a plain Hugging Face directory.
    plain = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert plain.config.hidden_size == 32


def test_logit_mode_on_task_prompts_trains_on_the_teachers_sampled_answers(tmp_path, teacher_dir, student_dir):
    recipe = recipe_for(tmp_path, teacher_dir, student_dir, tasks={"domains": ARITHMETIC, "prompts": 32})
    result = run_distill(recipe, sampler=sampler_for(recipe))
    assert result.teacher_answers["sampled"] == 32
    answers = [json.loads(line) for line in (result.output_dir / "teacher_answers.jsonl").read_text().splitlines()]
    assert len(answers) == 32 and all(a["messages"][-1]["role"] == "assistant" for a in answers)
    assert_student_moved_toward_teacher(result)


def test_on_policy_mode_scores_the_students_own_samples(tmp_path, teacher_dir, student_dir, sft_file):
    recipe = recipe_for(tmp_path, teacher_dir, student_dir, mode="on_policy", distill={"loss": "reverse_kl"},
                        tasks={"domains": ARITHMETIC}, train={"max_steps": 20, "batch_size": 16})
    sampler = sampler_for(recipe)
    result = run_distill(recipe, sampler=sampler)
    assert_student_moved_toward_teacher(result)
    # The student's engine took the student's weights at every step (version = the step's draw).
    assert sampler._engines["student"].policy_version == result.steps
    assert sampler._engines["student"].stats.weight_updates == result.steps


def test_on_policy_mode_mixes_in_a_data_fraction(tmp_path, teacher_dir, student_dir, sft_file):
    recipe = recipe_for(tmp_path, teacher_dir, student_dir, mode="on_policy", distill={"data_fraction": 0.5},
                        tasks={"domains": ARITHMETIC}, data={"train": [{"path": str(sft_file)}]},
                        train={"max_steps": 3, "batch_size": 8, "eval_every": None})
    sampler = sampler_for(recipe)
    result = run_distill(recipe, sampler=sampler)
    # Half of every 8-sequence batch came from the data: the student sampled 4 answers per step.
    assert sampler._engines["student"].stats.sequences == 4 * result.steps


def test_sequence_mode_turns_the_teachers_verified_answers_into_sft_data(tmp_path, teacher_dir, student_dir):
    recipe = recipe_for(tmp_path, teacher_dir, student_dir, mode="sequence",
                        tasks={"domains": ARITHMETIC, "prompts": 32, "samples_per_prompt": 2},
                        train={"max_steps": 15, "eval_every": None})
    result = run_distill(recipe, sampler=sampler_for(recipe))
    counts = result.teacher_answers
    assert counts["sampled"] == 64 and 0 < counts["verified"] < 64
    records = [json.loads(line) for line in (result.output_dir / "sequence_sft.jsonl").read_text().splitlines()]
    assert len(records) == counts["sft_samples"] <= counts["verified"]
    for record in records:  # every kept answer is right: the sum of the prompt's two digits
        a, b = record["messages"][0]["content"].split("+")
        assert record["messages"][-1]["content"].strip() == str(int(a) + int(b))
    losses = [r["train/loss"] for r in read_metrics(result.output_dir / "metrics.jsonl") if "train/loss" in r]
    assert losses[-1] < losses[0]


def test_on_policy_resume_is_exact(tmp_path, teacher_dir, student_dir):
    def recipe(name):
        return recipe_for(tmp_path / name, teacher_dir, student_dir, mode="on_policy", tasks={"domains": ARITHMETIC},
                          train={"max_steps": 6, "batch_size": 8, "save_every": 2, "eval_every": None})

    whole = run_distill(recipe("whole"), sampler=sampler_for(recipe("whole")))

    def crash(step, _):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_distill(recipe("crashed"), sampler=sampler_for(recipe("crashed")), on_step=crash)
    resumed = run_distill(recipe("crashed"), resume=True, sampler=sampler_for(recipe("crashed")))  # from step 2
    assert resumed.steps == whole.steps == 6

    def losses(result):
        return {r["step"]: r["train/loss"] for r in read_metrics(result.output_dir / "metrics.jsonl")
                if "train/loss" in r}

    assert losses(resumed) == pytest.approx(losses(whole), abs=1e-6)
    a = AutoModelForCausalLM.from_pretrained(whole.final_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.final_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.heldout == pytest.approx(whole.heldout)


# ---- errors ----------------------------------------------------------------------------------------------------


def test_a_student_with_another_tokenizer_is_a_clear_error(tmp_path, teacher_dir, work):
    teacher_tokenizer = load_tokenizer(ModelConfig(path=str(teacher_dir)))
    other = train_tokenizer(["completely different text", "with other words 0123456789"], vocab_size=300)
    problems = tokenizer_differences(teacher_tokenizer, other, ("teacher", "student"))
    assert any(p.startswith("vocabulary differs") for p in problems)
    retemplated = load_tokenizer(ModelConfig(path=str(teacher_dir), chat_template="{{ messages }}"))
    assert tokenizer_differences(teacher_tokenizer, retemplated) == ["chat templates differ"]
    check_same_tokenizer(teacher_tokenizer, load_tokenizer(ModelConfig(path=str(teacher_dir))))  # one: no error

    from posttrain.models import build_tiny_model, save_model_dir

    stranger = work / "stranger"
    save_model_dir(stranger, build_tiny_model("tiny-1m", other), other)
    recipe = recipe_for(tmp_path, teacher_dir, stranger, data={"train": [{"path": str(work / "train.jsonl")}]})
    with pytest.raises(ModelError, match=r"the teacher \(.*\) and the student \(.*stranger\) do not share a "
                                         r"tokenizer: vocabulary differs .*model.tokenizer_path"):
        run_distill(recipe)


def test_recipe_mistakes_name_the_key(tmp_path, teacher_dir, student_dir, sft_file):
    with pytest.raises(ConfigError, match="teacher.path"):
        run_distill(DistillRecipe(data={"train": [{"path": str(sft_file)}]}))
    with pytest.raises(ConfigError, match="exactly one of data.train"):
        run_distill(recipe_for(tmp_path, teacher_dir, student_dir))
    with pytest.raises(ConfigError, match="AnswerSampler"):
        run_distill(recipe_for(tmp_path, teacher_dir, student_dir, tasks={"domains": ARITHMETIC}))
    with pytest.raises(ValueError, match="train.max_steps"):
        DistillRecipe(mode="on_policy", train={"max_steps": None})
    with pytest.raises(ValueError, match="data_fraction applies to mode on_policy"):
        DistillRecipe(distill={"data_fraction": 0.5})


def test_cli_runs_the_packaged_recipe(tmp_path, teacher_dir, capsys):
    from posttrain.cli import main

    code = main(["distill", "distill-arithmetic", f"teacher.path={teacher_dir}", f"output_dir={tmp_path / 'cli'}",
                 "train.max_steps=2", "tasks.prompts=8", "tasks.domains=[{name: arithmetic, levels: [1]}]",
                 "runtime.num_threads=1", "tracking.progress=false", "tracking.tensorboard=false"])
    assert code == 0
    assert (tmp_path / "cli" / "final" / "config.json").is_file()


# ---- the demo stage --------------------------------------------------------------------------------------------


def test_demo_distill_stage_reports_both_tiers(tmp_path):
    from posttrain.config.demo import DemoRecipe
    from posttrain.demo import run_demo

    plus = {"operators": "+"}
    recipe = DemoRecipe.model_validate({
        "output_dir": str(tmp_path / "run"), "preset": "tiny-1m", "vocab_size": 320, "stages": ["sft", "distill", "report"],
        "domains": [{"name": "arithmetic", "args": plus, "sft_levels": [1, 2], "demos": 200, "heldout_levels": [2],
                     "heldout": 16, "validation": 0}],
        "sft": {"data": {"max_length": 64}, "train": {"batch_size": 16, "max_steps": 4, "log_every": 2}},
        "rl": {"domains": [{"name": "arithmetic", "args": plus, "levels": [2], "heldout": 0}]},
        "distill": {"mode": "on_policy", "distill": {"loss": "jsd", "data_fraction": 0.5},
                    "tasks": {"max_new_tokens": 16}, "data": {"max_length": 64},
                    "train": {"batch_size": 8, "max_steps": 3, "log_every": 1}, "runtime": {"num_threads": 1}},
        "eval": {"max_new_tokens": 16, "batch_size": 16},
    })
    summary = run_demo(recipe)
    stage = summary["stages"]["distill"]
    assert stage["teacher"] == "sft" and stage["steps"] == 3
    assert set(stage["heldout"]) == {"arithmetic"}
    standard, fast = stage["tiers"]["standard"], stage["tiers"]["fast"]
    assert standard["heldout"] == summary["stages"]["sft"]["heldout"] and fast["heldout"] == stage["heldout"]
    assert standard["decode_tokens_per_s"] > 0 and fast["decode_tokens_per_s"] > 0
    assert stage["kl_to_teacher"]["end"] is not None
    assert (tmp_path / "run" / "distill" / "final" / "config.json").is_file()
    # The report's tier table: the teacher and its student, each with its accuracy and its measured speed.
    tiers = summary["stages"]["report"]["tiers"]
    assert [(row["label"], row["kind"]) for row in tiers["rows"]] == [("sft", "standard"), ("distill", "distilled")]
    assert all(row["tokens_per_s"] > 0 and row["accuracy"] is not None for row in tiers["rows"])
    assert 'id="tiers"' in (tmp_path / "run" / "report.html").read_text()
