"""The demo recipe: the whole pipeline on the built-in tiny model, as a sequence of stages.

    posttrain demo                       (the packaged recipes/demo.yaml)
    posttrain demo sft.train.max_minutes=2

Each stage section is that stage's own recipe (the same schema `posttrain sft` takes); the demo fills in
the paths (the base model it built, the data it generated, the previous stage's checkpoint).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.common import Section
from posttrain.config.load import recipe
from posttrain.config.distill import DistillLossConfig, DistillRecipe
from posttrain.config.dpo import DPORecipe
from posttrain.config.rl import RLRecipe
from posttrain.config.sft import SFTRecipe, SFTTrainConfig


class DemoDomain(Section):
    """A task domain of the demo: where its demonstrations come from and how it is held out."""

    name: str
    args: dict[str, Any] = {}
    sft_levels: list[int] = [1]  # levels the SFT demonstrations cover
    demos: int = Field(1000, ge=0)  # how many demonstrations SFT gets (scarce on purpose), spread over sft_levels
    level_demos: dict[int, int] = {}  # beyond those: level -> demonstrations of that one level (a few hard ones)
    heldout_levels: list[int] = [1]  # levels of the held-out evaluation set
    heldout: int = Field(200, ge=0)
    validation: int = Field(50, ge=0)  # held-out-split items, apart from the test set, for SFT early stopping

    @model_validator(mode="after")
    def _levels_apart(self):
        shared = sorted(set(self.level_demos) & set(self.sft_levels))
        if shared:
            raise ValueError(f"level_demos: levels {shared} are in sft_levels already (demos covers them)")
        if any(count < 0 for count in self.level_demos.values()):
            raise ValueError(f"level_demos: counts must be >= 0, got {self.level_demos}")
        return self

    @property
    def demo_count(self) -> int:
        return self.demos + sum(self.level_demos.values())


class DemoPairs(Section):
    """How the DPO stage builds pairs from the SFT model's own verified samples."""

    prompts: int = Field(600, gt=0)  # fresh train-split tasks, spread over the RL stage's domains and levels
    samples: int = Field(4, gt=1)  # completions per prompt
    temperature: float = Field(1.0, gt=0)
    per_task: int = Field(2, gt=0)  # pairs per task at most


class DemoEval(Section):
    max_new_tokens: int = Field(96, gt=0)
    batch_size: int = Field(64, gt=0)
    # pass@1 and pass@k per level from `pass_k_samples` sampled episodes per held-out item of these domains
    pass_k_domains: list[str] = ["code"]
    pass_k_samples: int = Field(0, ge=0)  # 0: greedy pass@1 only
    pass_k: list[int] = [4]
    temperature: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _k_fits(self):
        if self.pass_k_samples and any(not 1 <= k <= self.pass_k_samples for k in self.pass_k):
            raise ValueError(f"eval.pass_k: every k must be in 1..pass_k_samples ({self.pass_k_samples}), "
                             f"got {self.pass_k}")
        return self


@recipe("demo")
class DemoRecipe(Section):
    stage: Literal["demo"] = "demo"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/demo"
    seed: int = 0
    preset: Literal["tiny-1m", "tiny-3m", "tiny-10m", "tiny-30m"] = "tiny-3m"
    vocab_size: int = Field(512, ge=300)
    stages: list[str] = ["sft"]  # in order; later issues add dpo, rl, sft_control, report
    domains: list[DemoDomain] = [DemoDomain(name="arithmetic", sft_levels=[1, 2, 3], heldout_levels=[3])]
    sft: SFTRecipe = SFTRecipe()
    dpo: DPORecipe = DPORecipe()
    dpo_pairs: DemoPairs = DemoPairs()
    rl: RLRecipe = RLRecipe()
    # where `rl` starts: "latest" the newest trained model (DPO's when that stage ran, else SFT's); "sft" the SFT
    # checkpoint even after DPO, so DPO and RL are each measured from SFT (and against the control, which always
    # continues from SFT)
    rl_from: Literal["latest", "sft"] = "latest"
    # the RL stage's forgetting guard watches, per domain SFT trained and RL does not, this many held-out items
    # drawn apart from the test and validation sets (fewer where the split runs out); a regression replays that
    # domain's demonstrations (docs/demo.md). 0: no such suites
    guard_items: int = Field(30, ge=0)
    eval: DemoEval = DemoEval()
    # stage `distill`: the newest policy into a fresh tiny-1m, on-policy (the demo fills in the teacher, the RL
    # stage's domains and the SFT demonstrations for data_fraction)
    distill: DistillRecipe = DistillRecipe(mode="on_policy", distill=DistillLossConfig(loss="jsd", data_fraction=0.5),
                                           train=SFTTrainConfig(max_steps=2000, max_minutes=5))
