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
from posttrain.config.common import ActorResources, ClusterConfig
from posttrain.config.rl import AlarmConfig, CurriculumConfig, DynamicSamplingConfig, GuardConfig, MixingConfig, PolicyLossConfig, PriorityConfig, ReturnConfig, ScheduleConfig

__all__ = [
    "ActorResources",
    "AlarmConfig",
    "ClusterConfig",
    "ConfigError",
    "CurriculumConfig",
    "DPOLossConfig",
    "DPORecipe",
    "DataSource",
    "DatasetSuite",
    "DecontaminationConfig",
    "DedupConfig",
    "DemoRecipe",
    "DomainConfig",
    "DynamicSamplingConfig",
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
    "GuardConfig",
    "LoraConfig",
    "MixConfig",
    "MixingConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "PreferenceDataConfig",
    "PreferenceTrainConfig",
    "PriorityConfig",
    "RECIPES",
    "RLRecipe",
    "RMLossConfig",
    "RMRecipe",
    "RegressionSuite",
    "ReturnConfig",
    "RewardModelConfig",
    "RewardTerm",
    "RuntimeConfig",
    "SFTDataConfig",
    "SFTRecipe",
    "SFTTrainConfig",
    "ScheduleConfig",
    "Section",
    "StreamConfig",
    "TrackingConfig",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "recipe",
]
