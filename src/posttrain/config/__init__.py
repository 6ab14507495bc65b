"""Typed recipes: YAML + `a.b=c` overrides validated by pydantic, with errors that name the key.

    from posttrain.config import load_recipe, SFTRecipe
    recipe = load_recipe("recipe.yaml", ["optim.lr=3e-4"], SFTRecipe)
    recipe = load_recipe("rl.yaml")   # the schema from the file's `stage:` (every stage is registered here)
"""

from posttrain.config.common import (
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RuntimeConfig,
    Section,
    TrackingConfig,
)
from posttrain.config.dpo import (
    DPOLossConfig,
    DPORecipe,
    PreferenceDataConfig,
    PreferenceTrainConfig,
    RMLossConfig,
    RMRecipe,
)
from posttrain.config.eval import (
    DatasetSuite,
    EvalCheckpoint,
    EvalContamination,
    EvalFreshDraw,
    EvalRecipe,
    EvalReport,
    EvalRuntime,
    EvalSampling,
    EvalSuites,
    EvalTrainingRun,
    GeneratedSuite,
    RegressionSuite,
)
from posttrain.config.rl import DomainConfig, RewardModelConfig, RewardTerm, RLRecipe  # registers stage "rl" on import of config
from posttrain.config.demo import DemoRecipe  # noqa: I001  (after rl: the demo recipe holds the stage recipes)
from posttrain.config.load import RECIPES, ConfigError, dump_recipe, load_recipe, parse_override, recipe
from posttrain.config.sft import (
    DataSource,
    DecontaminationConfig,
    DedupConfig,
    MixConfig,
    SFTDataConfig,
    StreamConfig,
    SFTRecipe,
    SFTTrainConfig,
)

__all__ = [
    "RECIPES",
    "ConfigError",
    "DPOLossConfig",
    "DPORecipe",
    "DataSource",
    "DatasetSuite",
    "DecontaminationConfig",
    "DedupConfig",
    "DemoRecipe",
    "DomainConfig",
    "EvalCheckpoint",
    "EvalContamination",
    "EvalFreshDraw",
    "EvalRecipe",
    "EvalReport",
    "EvalRuntime",
    "EvalSampling",
    "EvalSuites",
    "EvalTrainingRun",
    "GeneratedSuite",
    "LoraConfig",
    "MixConfig",
    "ModelConfig",
    "OptimConfig",
    "PreferenceDataConfig",
    "PreferenceTrainConfig",
    "RegressionSuite",
    "RLRecipe",
    "RMRecipe",
    "RMLossConfig",
    "RewardTerm",
    "RewardModelConfig",
    "RuntimeConfig",
    "SFTDataConfig",
    "StreamConfig",
    "SFTRecipe",
    "SFTTrainConfig",
    "Section",
    "TrackingConfig",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "recipe",
]
