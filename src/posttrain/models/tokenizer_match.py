"""Whether two models' tokenizers are one: what distillation and speculative decoding need of a teacher and a
student (or a target and its draft), since both compare next-token distributions id by id.

Three things must agree: the vocabulary (every token string with the same id), the special tokens (the named
ones — eos, pad, bos, unk — and the additional ones, with their ids) and the chat template (a prompt must render
to the same ids for both). Padding the embedding matrix beyond the tokenizer (common on GPU-sized models) is
fine: ids past the tokenizer's length are never real tokens.
"""

from __future__ import annotations

from typing import Any

from posttrain.models.load import ModelError

_NAMED = ("eos_token", "pad_token", "bos_token", "unk_token")


def tokenizer_differences(first: Any, second: Any, names: tuple[str, str] = ("first", "second")) -> list[str]:
    """What differs between two tokenizers, one short line per kind of difference (empty: they are one)."""
    a, b = names
    problems: list[str] = []
    vocab_a, vocab_b = first.get_vocab(), second.get_vocab()
    if vocab_a != vocab_b:
        detail = f"{len(vocab_a)} vs {len(vocab_b)} tokens"
        for token in sorted(set(vocab_a) | set(vocab_b)):
            if vocab_a.get(token) != vocab_b.get(token):
                detail += f"; {token!r} is {vocab_a.get(token)} in the {a}, {vocab_b.get(token)} in the {b}"
                break
        problems.append(f"vocabulary differs ({detail})")
    for name in _NAMED:
        token_a, token_b = getattr(first, name, None), getattr(second, name, None)
        id_a, id_b = getattr(first, f"{name}_id", None), getattr(second, f"{name}_id", None)
        if (str(token_a), id_a) != (str(token_b), id_b):
            problems.append(f"{name} differs ({token_a!r} id {id_a} vs {token_b!r} id {id_b})")
    special_a = sorted(zip(first.all_special_tokens, first.all_special_ids))
    special_b = sorted(zip(second.all_special_tokens, second.all_special_ids))
    if special_a != special_b:
        only_a = sorted(set(special_a) - set(special_b))
        only_b = sorted(set(special_b) - set(special_a))
        problems.append(f"special tokens differ (only the {a}: {only_a[:3]}; only the {b}: {only_b[:3]})")
    if (getattr(first, "chat_template", None) or "") != (getattr(second, "chat_template", None) or ""):
        problems.append("chat templates differ")
    return problems


def check_same_tokenizer(first: Any, second: Any, *, names: tuple[str, str] = ("first", "second"),
                         where: tuple[str, str] = ("", ""), fix: str = "") -> None:
    """Raise `ModelError` naming what differs, unless `first` and `second` are one tokenizer.

    `names` say which model is which in the message ("teacher", "student"), `where` the recipe keys or paths
    they came from, `fix` how to make them agree."""
    problems = tokenizer_differences(first, second, names)
    if not problems:
        return
    sources = " and ".join(f"the {name} ({place})" if place else f"the {name}" for name, place in zip(names, where))
    raise ModelError(f"{sources} do not share a tokenizer: {'; '.join(problems)}" + (f". {fix}" if fix else ""))
