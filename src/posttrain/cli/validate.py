"""`posttrain validate RECIPE [a.b=c ...]`: everything a run would check before its first step, without training.

    posttrain validate grpo-math
    posttrain validate my-sft.yaml data.max_length=1024

It checks the recipe (schema, overrides, `imports:`), resolves the model and the tokenizer (the model's config
only: no weights are loaded; the built-in tokenizer is trained on the run's text as the run would), reads and
counts the data (SFT samples after dedup, preference pairs, RL tasks per domain), prints one rendered sample with
its loss mask marked (``[[...]]`` is trained; the rest is context), and estimates the run's steps and tokens.
A problem is the same one-line error the run would give, exit code 2.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from posttrain.config import load_recipe

OPEN, CLOSE = "[[", "]]"  # around the tokens the loss is computed on


def main(args: argparse.Namespace) -> int:
    from posttrain.cli.stages import recipe_path

    path = recipe_path(args.recipe)
    recipe = load_recipe(path, args.overrides)
    print(f"[validate] {path}: a valid '{recipe.stage}' recipe"
        + (f"; imported {', '.join(recipe.imports)}" if getattr(recipe, "imports", None) else ""))
    check = {"sft": _sft, "dpo": _pairs, "rm": _pairs, "rl": _rl}.get(recipe.stage)
    if check is None:
        print(f"[validate] stage '{recipe.stage}': the recipe is valid (nothing further is checked for it)")
        return 0
    check(recipe)
    print("[validate] ok: nothing was trained")
    return 0


# ---- model and tokenizer -----------------------------------------------------------------------------------


def _describe_model(model_config: Any) -> None:
    if model_config.path is None:
        print(f"[validate] model: the built-in {model_config.preset} (fresh weights)")
        return
    from transformers import AutoConfig

    from posttrain.models import ModelError

    try:
        config = AutoConfig.from_pretrained(model_config.path)
    except (OSError, ValueError) as error:
        raise ModelError(f"model.path: '{model_config.path}': not a Hugging Face model "
                         f"({str(error).strip().splitlines()[0][:160] if str(error).strip() else error})") from None
    size = _parameters(config)
    print(f"[validate] model: {model_config.path} ({config.model_type}, {getattr(config, 'num_hidden_layers', '?')} "
        f"layers, hidden {getattr(config, 'hidden_size', '?')}" + (f", ~{size / 1e6:,.0f}M parameters" if size
                                                                 else "") + ")")


def _parameters(config: Any) -> int | None:
    """A decoder's parameter count from its config (embeddings + layers), without building it."""
    hidden, layers, vocab = (getattr(config, key, None) for key in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if not (hidden and layers and vocab):
        return None
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = getattr(config, "num_attention_heads", None) or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * hidden * 2 + 2 * hidden * (hidden * kv // heads)
    tied = getattr(config, "tie_word_embeddings", False)
    return vocab * hidden * (1 if tied else 2) + layers * (attention + 3 * hidden * inner)


def _describe_tokenizer(tokenizer: Any, model_config: Any) -> None:
    where = model_config.tokenizer_path or model_config.path or "built-in, trained on the run's text"
    print(f"[validate] tokenizer: {where} ({len(tokenizer):,} tokens, chat template present)")


def marked(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> str:
    """The decoded sequence with every run of trained tokens between [[ and ]]."""
    pieces: list[str] = []
    start = 0
    for index in range(1, len(input_ids) + 1):
        if index == len(input_ids) or loss_mask[index] != loss_mask[start]:
            text = tokenizer.decode(input_ids[start:index], skip_special_tokens=False)
            pieces.append(f"{OPEN}{text}{CLOSE}" if loss_mask[start] else text)
            start = index
    return "".join(pieces)


# ---- per stage ---------------------------------------------------------------------------------------------


def _sft(recipe: Any) -> None:
    from posttrain.data import prepare_sft_data, read_all_texts
    from posttrain.models import load_tokenizer
    from posttrain.train import count_items

    _describe_model(recipe.model)
    corpus = read_all_texts(recipe.data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    _describe_tokenizer(tokenizer, recipe.model)
    data = prepare_sft_data(recipe.data, tokenizer, seed=recipe.runtime.seed)
    rows = data.epoch_rows(0)  # a streaming epoch is read by forward slices: take what is needed as slices
    row_count = count_items(rows)  # validate reads the data through: a streamed epoch is counted by a pass
    if recipe.data.streaming:
        print(f"[validate] data: streamed, {row_count} packed rows in the first epoch "
              f"({len(data.heldout)} held-out samples)")
        sample = rows[0:1][0]
    else:
        report = data.report
        print(f"[validate] data: {report.get('read_total', len(data.train))} records read, {len(data.train)} train / "
            f"{len(data.heldout)} held-out samples after dedup and splits")
        sample = data.train[0]
    shown = marked(tokenizer, sample.input_ids, sample.loss_mask)
    print(f"[validate] one {'packed row' if recipe.data.streaming else 'sample'} ({len(sample.input_ids)} tokens, "
        f"{sum(sample.loss_mask)} trained, {OPEN}trained{CLOSE}):\n{shown}")
    tokens_per_epoch = sum(len(row) for row in rows[0:row_count])
    steps_per_epoch = max(1, math.ceil(row_count / recipe.train.batch_size))
    steps = recipe.train.max_steps or math.ceil(steps_per_epoch * recipe.train.epochs)
    epochs = steps / steps_per_epoch
    print(f"[validate] estimate: {steps} steps ({row_count} rows of up to {recipe.data.max_length} tokens per epoch, "
        f"batch {recipe.train.batch_size}: {epochs:.2f} epochs), ~{tokens_per_epoch * epochs:,.0f} tokens")


def _pairs(recipe: Any) -> None:
    from posttrain.data import load_preference_data, pair_texts, tokenize_pairs
    from posttrain.models import load_tokenizer

    _describe_model(recipe.model)
    data = load_preference_data(recipe.data)
    corpus = pair_texts(data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    _describe_tokenizer(tokenizer, recipe.model)
    print(f"[validate] data: {len(data.train)} train / {len(data.heldout)} held-out preference pairs")
    _, tokens, truncated = tokenize_pairs(data.train[:1], tokenizer, recipe.data.max_length)
    pair = tokens[0]
    print(f"[validate] one pair, chosen side ({len(pair.chosen_ids)} tokens, {sum(pair.chosen_mask)} scored, "
        f"{OPEN}scored{CLOSE}):\n{marked(tokenizer, pair.chosen_ids, pair.chosen_mask)}")
    batch = recipe.train.batch_size
    steps_per_epoch = max(1, math.ceil(len(data.train) / batch))
    steps = recipe.train.max_steps or math.ceil(steps_per_epoch * recipe.train.epochs)
    mean_tokens = (len(pair.chosen_ids) + len(pair.rejected_ids))
    print(f"[validate] estimate: {steps} steps (batch {batch} pairs: {steps / steps_per_epoch:.2f} epochs), "
        f"~{steps * batch * mean_tokens:,.0f} tokens (from the first pair's length)")


def _rl(recipe: Any) -> None:
    from posttrain.rl import ProcessorRenderer, policy_processor, starting_tokenizer, wants_vision
    from posttrain.tasks import get_domain, sample_tasks

    _describe_model(recipe.model)
    renderer = None
    if wants_vision(recipe.model):  # image prompts: the processor renders them, as in the run
        processor = policy_processor(recipe.model, None if recipe.model.path else starting_tokenizer(recipe))
        renderer, tokenizer = ProcessorRenderer(processor), processor.tokenizer
        print(f"[validate] vision-language model: prompts rendered by its processor ({type(processor).__name__})")
    else:
        tokenizer = starting_tokenizer(recipe)
    _describe_tokenizer(tokenizer, recipe.model)
    first = None
    for spec in recipe.domains:
        source = get_domain(spec.name, **spec.args)
        pools = getattr(source, "by_level", None)
        if pools:
            counts = ", ".join(f"level {level}: {len(pools[level])}" for level in sorted(pools))
            print(f"[validate] domain {spec.name}: {sum(len(p) for p in pools.values())} tasks ({counts}); "
                f"drawing levels {spec.levels}")
        else:
            print(f"[validate] domain {spec.name}: generated tasks, levels {spec.levels} (of 1..{source.max_level})")
        if first is None:
            first = sample_tasks(source, 1, level=spec.levels, split="train", seed=recipe.runtime.seed)[0]
    for term in recipe.rewards:
        print(f"[validate] reward term {term.label}: weight {term.weight:g}, "
            + (f"function {term.function}" if term.function else f"verifier {term.verifier}"))
    if recipe.rewards:
        from posttrain.rl import reward_terms

        reward_terms(recipe)  # functions import, verifiers exist
    assert first is not None
    from posttrain.data import prompt_ids as render_prompt_ids, render_chat

    if renderer is not None:
        prompt = renderer.render(first.messages, generation_prompt=True)
        prompt_ids = renderer.prompt(first.messages)[0]  # the images expanded to their tokens
    else:
        prompt = render_chat(tokenizer, first.messages, generation_prompt=True)
        prompt_ids = render_prompt_ids(tokenizer, [first.messages])[0]
    new = recipe.rollout.sampling.max_new_tokens
    print(f"[validate] one task ({first.domain}, level {first.difficulty}, judged by {first.verifier}; the prompt is "
        f"context, the policy's {OPEN}completion{CLOSE} of up to {new} tokens per turn is trained):\n"
        f"{prompt}{OPEN}...{CLOSE}")
    episodes = recipe.train.max_steps * recipe.rollout.prompts_per_step * recipe.rollout.sampling.group_size
    turns = max(1, first.max_steps)
    print(f"[validate] estimate: {recipe.train.max_steps} steps x {recipe.rollout.prompts_per_step} prompts x "
        f"{recipe.rollout.sampling.group_size} completions = {episodes:,} episodes, up to "
        f"~{episodes * (len(prompt_ids) + turns * new):,} tokens (prompts of ~{len(prompt_ids)} tokens, "
        f"{turns} turn(s) of at most {new})")
