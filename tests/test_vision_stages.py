"""The plain stage recipes with images: `posttrain sft` and `posttrain dpo` on JSONL chats whose image parts are
local PNG files and data URLs (real Pillow images), with the built-in tiny VLM and a tiny LLaVA built from its config
and saved as a model directory; bad images are one-line errors naming the file, the line and the field."""

import base64
import copy
import io
import json
import random

import pytest
import torch
from PIL import Image
from test_models_vision import _llava
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from posttrain.config import ConfigError, DPORecipe, SFTRecipe
from posttrain.data import DataError, read_vision_pair_data
from posttrain.models import load_vision_model, vision_inputs
from posttrain.train import run_dpo, run_sft

pytestmark = pytest.mark.usefixtures("one_thread")
IGNORE = -100
COLOURS = {"red": (220, 30, 30), "blue": (30, 40, 220)}


def _shade(rgb, rng):
    return tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in rgb)


def _png(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _image_part(image, index, tmp_path):
    """Every other image a file beside the data (relative path), the others a data URL."""
    if index % 2:
        url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    else:
        name = f"images/{index:03d}.png"
        (tmp_path / "images").mkdir(exist_ok=True)
        image.save(tmp_path / name)
        url = name
    return {"type": "image_url", "image_url": {"url": url}}


def _colour_images(count, seed=0):
    rng = random.Random(seed)
    out = []
    for index in range(count):
        word = ["red", "blue"][index % 2]
        image = Image.new("RGB", (32, 32), (255, 255, 255))
        image.paste(Image.new("RGB", (20, 20), _shade(COLOURS[word], rng)), (rng.randint(0, 12), rng.randint(0, 12)))
        out.append((image, word))
    return out


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft_data(tmp_path, count=24):
    records = [{"messages": [
        {"role": "user", "content": [_image_part(image, i, tmp_path), {"type": "text", "text": "Which colour?"}]},
        {"role": "assistant", "content": word}]} for i, (image, word) in enumerate(_colour_images(count))]
    return _write_jsonl(tmp_path / "train.jsonl", records)


def _sft_recipe(tmp_path, data, **model):
    return SFTRecipe.model_validate({
        "output_dir": str(tmp_path / "run"),
        "model": {"vision": True, "preset": "tiny-1m", **model},
        "data": {"train": [{"path": str(data)}], "heldout_fraction": 0.25, "max_length": 64},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "train": {"max_steps": 30, "batch_size": 8, "micro_batch_size": 4, "log_every": 10, "eval_every": 15},
        "runtime": {"device": "cpu", "precision": "fp32", "seed": 0},
    })


def test_posttrain_sft_trains_a_vlm_on_image_chats_and_saves_it_with_its_processor(tmp_path):
    data = _sft_data(tmp_path)
    result = run_sft(_sft_recipe(tmp_path, data))
    assert result.steps == 30 and result.data_report["images"] == 24
    assert result.data_report["samples"]["heldout"] > 0  # split by the prompt's text and pixels, not the text alone
    losses = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m["train/loss"] for m in losses if "train/loss" in m]
    assert train[-1] < 0.5 * train[0]
    assert result.heldout_loss is not None and result.heldout_loss < 1.0

    model, processor = load_vision_model(str(result.final_dir))  # plain transformers classes, processor beside
    assert isinstance(model, LlavaForConditionalGeneration) and isinstance(processor, LlavaProcessor)
    # The labels: the reply and its end-of-turn token; the image placeholder tokens and the prompt are masked.
    image, word = _colour_images(1)[0]
    row = vision_inputs(processor, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": word}]}], [image])
    ids, labels = row["input_ids"][0], row["labels"][0]
    image_id = model.config.image_token_id
    assert int((ids == image_id).sum()) == 16 and not (labels[ids == image_id] != IGNORE).any()
    assert processor.tokenizer.decode(ids[labels != IGNORE]) == "red<|end|>"


def test_sft_resumes_a_vlm_run_from_its_checkpoint(tmp_path):
    data = _sft_data(tmp_path, count=12)
    recipe = _sft_recipe(tmp_path, data)
    recipe.train.max_steps, recipe.train.save_every = 4, 2
    whole = run_sft(recipe)
    first = copy.deepcopy(recipe)
    first.output_dir, first.train.max_steps = str(tmp_path / "cut"), 4
    (tmp_path / "cut").mkdir()
    stopped = copy.deepcopy(first)
    stopped.train.max_steps = 2
    run_sft(stopped)
    resumed = run_sft(first, resume=True)
    assert resumed.steps == 4
    a = load_vision_model(str(whole.final_dir))[0].state_dict()
    b = load_vision_model(str(resumed.final_dir))[0].state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_bad_image_is_one_line_naming_the_file_line_and_field(tmp_path):
    good = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "images/000.png"}}]},
                         {"role": "assistant", "content": "red"}]}
    _colour_images(1)[0][0].save((tmp_path / "images").mkdir() or tmp_path / "images" / "000.png")
    (tmp_path / "cut.png").write_bytes(_png(Image.new("RGB", (32, 32)))[:60])
    cases = {
        "missing": ({"type": "image_url", "image_url": {"url": "images/404.png"}}, "no such image file 'images/404.png'"),
        "corrupt": ({"type": "image_url", "image_url": {"url": "cut.png"}}, "'cut.png' is corrupt or truncated"),
        "data-url": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "not valid base64"),
    }
    for name, (part, message) in cases.items():
        bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Which?"}, part]},
                            {"role": "assistant", "content": "red"}]}
        data = _write_jsonl(tmp_path / f"{name}.jsonl", [good, good, bad])
        with pytest.raises(DataError) as error:
            run_sft(_sft_recipe(tmp_path, data))
        text = str(error.value)
        assert "\n" not in text and text.startswith(f"{data}:3: messages[0].content[1]: ") and message in text


def test_what_the_image_path_does_not_support_is_refused_up_front(tmp_path):
    data = _sft_data(tmp_path, count=4)
    recipe = _sft_recipe(tmp_path, data)
    recipe.model.lora.enabled = True
    recipe.data.streaming = True
    with pytest.raises(ConfigError, match="model.lora .*data.streaming|data.streaming.*model.lora"):
        run_sft(recipe)


def _llava_dir(tokenizer, path):
    """A tiny LLaVA (CLIP encoder, MLP projector, Llama) built from its config and saved with its processor."""
    torch.manual_seed(0)
    model, processor, _ = _llava(tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_sft_on_a_llava_model_directory(tiny_tokenizer, tmp_path):
    data = _sft_data(tmp_path, count=16)
    model_dir = _llava_dir(tiny_tokenizer, tmp_path / "llava")
    recipe = _sft_recipe(tmp_path, data, vision=False, path=str(model_dir))  # found a VLM by its config
    recipe.train.max_steps = 20
    result = run_sft(recipe)
    losses = [json.loads(line).get("train/loss") for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [loss for loss in losses if loss is not None]
    assert losses[-1] < losses[0] - 1.0  # a 1-layer, 32-wide text model: 5.0 -> 3.4 in 20 steps (seed 0)
    assert load_vision_model(str(result.final_dir))[0].config.vision_config.image_size == 16


def _pair_data(tmp_path, count=24):
    """Preference pairs whose shared prompt holds the image: as an image_url part, or (every third) TRL's vision
    format, a bare {type: image} part and the image's file in the record's `images` column."""
    records = []
    for i, (image, word) in enumerate(_colour_images(count, seed=1)):
        other = "blue" if word == "red" else "red"
        part = _image_part(image, i, tmp_path)
        record = {"prompt": [{"role": "user", "content": [part, {"type": "text", "text": "Which colour?"}]}],
                  "chosen": word, "rejected": [{"role": "assistant", "content": other}]}
        if i % 3 == 0 and not part["image_url"]["url"].startswith("data:"):
            record["images"] = [part["image_url"]["url"]]
            record["prompt"][0]["content"][0] = {"type": "image"}
        records.append(record)
    return _write_jsonl(tmp_path / "pairs.jsonl", records)


def _dpo_recipe(tmp_path, data, **dpo):
    return DPORecipe.model_validate({
        "output_dir": str(tmp_path / "dpo"),
        "model": {"vision": True, "preset": "tiny-1m"},
        "data": {"train": [{"path": str(data)}], "heldout_fraction": 0.25, "max_length": 64},
        "dpo": {"beta": 0.5, **dpo},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "train": {"max_steps": 12, "batch_size": 8, "micro_batch_size": 4, "log_every": 4},
        "runtime": {"device": "cpu", "precision": "fp32", "seed": 0},
    })


def test_posttrain_dpo_trains_a_vlm_on_pairs_sharing_an_image_prompt(tmp_path):
    data = _pair_data(tmp_path)
    pairs = read_vision_pair_data(_dpo_recipe(tmp_path, data).data)
    assert all(len(p.images) == 1 for p in pairs.train + pairs.heldout) and pairs.heldout
    result = run_dpo(_dpo_recipe(tmp_path, data))
    assert result.steps == 12
    assert result.heldout_start["accuracy"] == 0.0  # every implicit reward margin is 0 before the first step
    assert result.heldout["loss"] < result.heldout_start["loss"] and result.heldout["accuracy"] >= 0.75
    model, processor = load_vision_model(str(result.final_dir))
    assert isinstance(model, LlavaForConditionalGeneration)


def test_dpo_on_image_pairs_takes_every_loss_and_a_bad_image_names_the_prompt_part(tmp_path):
    data = _pair_data(tmp_path, count=8)
    recipe = _dpo_recipe(tmp_path, data, loss="simpo")
    recipe.train.max_steps = 2
    assert run_dpo(recipe).steps == 2  # reference-free
    lines = data.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["prompt"][0]["content"][0] = {"type": "image_url", "image_url": {"url": "images/missing.png"}}
    lines[1] = json.dumps(bad)
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as error:  # a run of its own (the first's directory holds that run)
        run_dpo(_dpo_recipe(tmp_path, data).model_copy(update={"output_dir": str(tmp_path / "dpo-bad")}))
    assert str(error.value) == f"{data}:2: prompt[0].content[0]: no such image file 'images/missing.png'"


def _colour_suite(tmp_path, count=8):
    """A dataset suite with images: a JSONL whose `image` field names a PNG beside it, judged by `exact`."""
    root = tmp_path / "suite"
    root.mkdir()
    records = []
    for i, (image, word) in enumerate(_colour_images(count, seed=7)):
        image.save(root / f"{i}.png")
        records.append({"question": "Which colour?", "answer": word, "image": f"{i}.png"})
    return _write_jsonl(root / "colours.jsonl", records)


def test_posttrain_eval_scores_image_suites_and_reports_sample_images_with_the_answers(tmp_path):
    from posttrain.config import EvalRecipe
    from posttrain.evaluate import evaluate

    trained = run_sft(_sft_recipe(tmp_path, _sft_data(tmp_path)))
    base = tmp_path / "base"
    model, processor = load_vision_model(str(trained.final_dir))
    torch.manual_seed(1)
    for parameter in model.parameters():  # the same architecture and processor, weights not trained
        torch.nn.init.normal_(parameter, std=0.02)
    model.save_pretrained(base)
    processor.save_pretrained(base)
    recipe = EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"),
        "checkpoints": [{"path": str(base), "label": "base"}, {"path": str(trained.final_dir), "label": "sft"}],
        "suites": {"datasets": [{"name": "colours", "path": str(_colour_suite(tmp_path)),
                                 "args": {"image_field": "image", "verifier": "exact", "instruction": None}}],
                   "generated": [{"domain": "largest_colour", "args": {"canvas": 32}, "n": 4}]},
        "sampling": {"max_new_tokens": 4}, "fresh_draw": {"enabled": False},
        "runtime": {"device": "cpu", "precision": "fp32", "num_threads": 1, "batch_size": 16},
    })
    result = evaluate(recipe)
    assert result.figure("sft", "colours") >= 0.75 and result.figure("base", "colours") == 0.0
    images = result.results["images"]["sft"]
    assert set(images) == {"colours", "largest_colour"}
    colours = images["colours"]
    assert colours["pass@1"] == result.figure("sft", "colours") and colours["per_domain"] == {"colours": colours["pass@1"]}
    sample = colours["samples"][0]
    assert sample["thumbnail"].startswith("data:image/png;base64,") and sample["expected"] in COLOURS
    assert sample["answer"] and sample["question"].startswith("Which colour?")
    html = result.report_path.read_text()
    assert "Sample images with the answers of sft" in html and html.count('<img src="data:image/png;base64,') >= 8


@pytest.mark.slow
def test_the_packaged_vlm_recipes_run_sft_then_dpo_then_eval_through_the_cli(tmp_path, monkeypatch):
    """`posttrain sft sft-vlm`, `posttrain dpo dpo-vlm` from its model, `posttrain eval eval-vlm` on both, on the
    packaged image samples, a few steps each."""
    from posttrain.cli import main

    monkeypatch.chdir(tmp_path)
    quiet = ["tracking.progress=false"]
    assert main(["sft", "sft-vlm", "train.max_steps=6", "train.eval_every=3", *quiet]) == 0
    assert main(["dpo", "dpo-vlm", "train.max_steps=3", *quiet]) == 0
    assert main(["eval", "eval-vlm", "suites.generated.0.n=6", "suites.generated.1.n=6",
                 "checkpoints=[{path: runs/sft-vlm/final, label: sft}, {path: runs/dpo-vlm/final, label: dpo}]"]) == 0
    results = json.loads((tmp_path / "runs" / "eval-vlm" / "results.json").read_text())
    assert set(results["images"]) == {"sft", "dpo"}
    assert set(results["images"]["dpo"]) == {"largest_colour", "bar_value"}
    assert 'id="images"' in (tmp_path / "runs" / "eval-vlm" / "report.html").read_text()


def test_an_image_dataset_suite_carries_its_images_and_names_a_bad_one(tmp_path):
    from posttrain.tasks import TaskError, get_domain

    path = _colour_suite(tmp_path, count=2)
    tasks = get_domain("dataset", path=str(path), image_field="image", verifier="exact", instruction=None).tasks()
    part = tasks[0].messages[0]["content"][0]
    assert part["image_url"]["url"].startswith("data:image/png;base64,") and tasks[0].verifier_args == {"answer": "red"}
    assert tasks[0].id != tasks[1].id  # one question, two images: two problems
    path.write_text(path.read_text() + json.dumps({"question": "Which colour?", "answer": "red", "image": "x.png"}) + "\n")
    with pytest.raises(TaskError) as error:
        get_domain("dataset", path=str(path), image_field="image", verifier="exact")
    assert str(error.value) == f"{path}:3: field 'image': no such image file 'x.png'"


def test_sft_trains_on_a_saved_dataset_with_an_image_column(tmp_path):
    """TRL's vision format: an `images` column of datasets Image values, bare {type: image} parts in the chat."""
    import datasets

    from posttrain.data import read_vision_sft_data

    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
    })
    pairs = _colour_images(8)
    rows = {"images": [[image] for image, _ in pairs],
            "messages": [[{"role": "user", "content": [{"type": "image", "text": None},
                                                       {"type": "text", "text": "Which colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": word}]}] for _, word in pairs]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    recipe = _sft_recipe(tmp_path, tmp_path / "ds")
    recipe.data.heldout_fraction, recipe.train.max_steps, recipe.train.eval_every = 0.0, 2, None
    data = read_vision_sft_data(recipe.data)
    assert len(data.train) == 8 and data.train[0].images[0].getpixel((0, 0)) == (255, 255, 255)
    assert run_sft(recipe).steps == 2
