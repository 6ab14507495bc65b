"""Typed recipes: YAML + `a.b=c` overrides validated by pydantic, with errors that name the key.

    from posttrain.config import load_recipe, SFTRecipe
    recipe = load_recipe("recipe.yaml", ["optim.lr=3e-4"], SFTRecipe)
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
from posttrain.config.load import RECIPES, ConfigError, dump_recipe, load_recipe, parse_override, recipe
from posttrain.config.rl import RLRecipe  # registers stage "rl": `load_recipe(path)` needs no other import
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
