"""The `vlm-demo` recipe: SFT then GRPO on generated image tasks with the built-in tiny VLM (`posttrain.demo.vlm`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from posttrain.config.common import Section
from posttrain.config.load import recipe


class VLMSFTConfig(Section):
    steps: int = Field(60, ge=1)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    warmup_steps: int = Field(0, ge=0)


class VLMRLConfig(Section):
    domains: list[str] = Field(default_factory=list, description="the domains GRPO trains on (a subset of the "
                                                                   "recipe's; empty: all of them)")
    steps: int = Field(20, ge=0)
    tasks_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(1e-3, gt=0)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(4, ge=1)


@recipe("vlm-demo")
class VLMDemoRecipe(Section):
    stage: str = "vlm-demo"
    output_dir: str = "runs/vlm-demo"
    seed: int = 0
    domains: list[str] = Field(default_factory=lambda: ["largest_colour", "bar_value"])
    levels: list[int] = Field(default_factory=lambda: [1])
    canvas: int = Field(32, ge=32, le=512)
    vocab_size: int = Field(384, ge=300)
    demos: int = Field(96, ge=1, description="SFT demonstrations per domain")
    heldout: int = Field(48, ge=1, description="held-out tasks per domain (split by hash)")
    sft: VLMSFTConfig = Field(default_factory=VLMSFTConfig)
    rl: VLMRLConfig = Field(default_factory=VLMRLConfig)

    @model_validator(mode="after")
    def _rl_domains_are_the_recipes(self) -> VLMDemoRecipe:
        unknown = [name for name in self.rl.domains if name not in self.domains]
        if unknown:
            raise ValueError(f"rl.domains: {unknown} not in domains {self.domains}")
        return self
