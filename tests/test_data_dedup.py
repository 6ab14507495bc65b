"""Exact and near-duplicate removal, and the held-out split by prompt hash."""

from posttrain.config import DedupConfig
from posttrain.data import SampleMetadata, SFTSample, conversation_text, deduplicate, normalize_text, split_by_hash

ESSAY = (
    "Photosynthesis converts light energy into chemical energy stored in glucose. Chlorophyll in the "
    "chloroplasts absorbs mostly red and blue light, and the light reactions split water, releasing oxygen."
)


def chat(user: str, reply: str, **metadata) -> SFTSample:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return SFTSample(messages, SampleMetadata(**metadata))


def test_normalization_ignores_case_width_and_whitespace():
    assert normalize_text("  Hello\tWORLD \n ！") == "hello world !"
    assert conversation_text(chat("Hi  there", "OK").messages) == conversation_text(chat("hi there", "ok").messages)


def test_exact_duplicates_keep_the_first_and_are_counted():
    samples = [chat("a", "1", source="first"), chat("b", "2"), chat("A ", "1", source="second"), chat("a", "2")]
    result = deduplicate(samples, DedupConfig(exact=True, near=False))
    assert result.exact_duplicates == 1 and result.near_duplicates == 0
    assert [s.metadata.source for s in result.samples][0] == "first"
    assert len(result.samples) == 3


def test_near_duplicates_by_minhash_and_distinct_texts_survive():
    samples = [
        chat("Explain photosynthesis.", ESSAY),
        chat("Explain photosynthesis!", ESSAY.replace("mostly", "mainly")),  # near-duplicate
        chat("Explain gravity.", "Masses attract each other with a force proportional to their product."),
        chat("Explain photosynthesis.", ESSAY),  # exact duplicate
    ]
    result = deduplicate(samples, DedupConfig(exact=True, near=True, threshold=0.8))
    assert result.exact_duplicates == 1 and result.near_duplicates == 1
    assert [s.messages[0]["content"] for s in result.samples] == ["Explain photosynthesis.", "Explain gravity."]
    assert deduplicate(samples, DedupConfig(exact=False, near=False)).samples == samples


def test_near_dedup_is_deterministic():
    samples = [chat(f"q{i % 7}", ESSAY[: 60 + i % 5]) for i in range(40)]
    config = DedupConfig(near=True, threshold=0.7)
    first = deduplicate(samples, config)
    assert [id(s) for s in first.samples] == [id(s) for s in deduplicate(samples, config).samples]


def test_heldout_split_by_prompt_hash_never_overlaps_and_is_stable():
    samples = [chat(f"{a}+{b}=", str(a + b)) for a in range(40) for b in range(10)]
    samples += [chat(f"{a}+0=", "again") for a in range(40)]  # repeated prompts must stay on one side
    train, heldout = split_by_hash(samples, 0.2)
    assert len(train) + len(heldout) == len(samples)
    assert 0.12 < len(heldout) / len(samples) < 0.28
    assert not {s.prompt_text for s in train} & {s.prompt_text for s in heldout}
    again_train, again_heldout = split_by_hash(list(reversed(samples)), 0.2)
    assert {s.prompt_text for s in again_heldout} == {s.prompt_text for s in heldout}
    _, other_salt = split_by_hash(samples, 0.2, salt="other")
    assert {s.prompt_text for s in other_salt} != {s.prompt_text for s in heldout}
    assert split_by_hash(samples, 0.0)[1] == []
