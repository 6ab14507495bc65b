"""Mixing by metadata weights: shares, upsampling, dropping, determinism per (seed, epoch)."""

from collections import Counter

import pytest

from posttrain.config import MixConfig
from posttrain.data import DataError, SampleMetadata, SFTSample, group_name, mix, mixture_table


def corpus(counts: dict[tuple[str, int], int]) -> list[SFTSample]:
    samples = []
    for (domain, difficulty), n in counts.items():
        for i in range(n):
            messages = [{"role": "user", "content": f"{domain}{difficulty}-{i}"}, {"role": "assistant", "content": "x"}]
            samples.append(SFTSample(messages, SampleMetadata(domain=domain, difficulty=difficulty)))
    return samples


def domains(samples):
    return Counter(s.metadata.domain for s in samples)


def test_weights_give_target_shares_and_small_groups_are_repeated():
    samples = corpus({("arithmetic", 1): 300, ("extraction", 1): 20})
    result = mix(samples, MixConfig(by=["domain"], weights={"arithmetic": 3, "extraction": 1}), seed=0, epoch=0)
    assert len(result.samples) == 320
    assert domains(result.samples) == {"arithmetic": 240, "extraction": 80}
    extraction = result.groups["extraction"]
    assert extraction.available == 20 and extraction.target_share == 0.25 and extraction.realized_share == 0.25
    assert extraction.repeats == 4.0
    # Upsampled evenly: every extraction sample appears exactly 4 times.
    assert set(Counter(s.messages[0]["content"] for s in result.samples if s.metadata.domain == "extraction").values()) == {4}
    # Subsampled without replacement.
    arithmetic = [s.messages[0]["content"] for s in result.samples if s.metadata.domain == "arithmetic"]
    assert len(set(arithmetic)) == 240


def test_default_weight_zero_weight_and_samples_per_epoch():
    samples = corpus({("a", 1): 10, ("b", 1): 10, ("c", 1): 10})
    config = MixConfig(by=["domain"], weights={"c": 0}, default_weight=2.0, samples_per_epoch=50)
    result = mix(samples, config, seed=1, epoch=0)
    assert domains(result.samples) == {"a": 25, "b": 25}
    report = result.report()
    assert report["groups"]["c"]["count"] == 0 and report["groups"]["c"]["available"] == 10
    assert report["total"] == 50
    assert "realized" in mixture_table(report)


def test_groups_over_several_keys_are_slash_joined():
    samples = corpus({("arithmetic", 1): 5, ("arithmetic", 3): 5})
    assert group_name(samples[-1].metadata, ["domain", "difficulty"]) == "arithmetic/3"
    assert group_name(SampleMetadata(), ["difficulty"]) == "none"
    result = mix(samples, MixConfig(by=["domain", "difficulty"], weights={"arithmetic/3": 4}), seed=0, epoch=0)
    assert Counter(s.metadata.difficulty for s in result.samples) == {3: 8, 1: 2}


def test_mixture_is_deterministic_per_seed_and_epoch_and_redrawn_across_epochs():
    samples = corpus({("a", 1): 50, ("b", 1): 7})
    config = MixConfig(by=["domain"], weights={"a": 1, "b": 1}, samples_per_epoch=40)

    def draw(seed, epoch):
        return [s.messages[0]["content"] for s in mix(samples, config, seed=seed, epoch=epoch).samples]

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(0, 1)
    assert draw(0, 0) != draw(1, 0)


def test_no_grouping_keeps_everything_shuffled():
    samples = corpus({("a", 1): 30})
    result = mix(samples, MixConfig(), seed=0, epoch=0)
    assert sorted(id(s) for s in result.samples) == sorted(id(s) for s in samples)
    assert result.samples != samples
    assert list(result.groups) == ["all"]


def test_a_weight_for_a_group_with_no_samples_is_an_error():
    samples = corpus({("arithmetic", 1): 3})
    with pytest.raises(DataError, match="'arithmetc'.*arithmetic"):
        mix(samples, MixConfig(by=["domain"], weights={"arithmetc": 1}), seed=0, epoch=0)
    with pytest.raises(DataError, match="weight 0"):
        mix(samples, MixConfig(by=["domain"], default_weight=0), seed=0, epoch=0)
