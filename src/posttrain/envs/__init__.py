"""Environments: the world a policy acts in, and the episode loop that turns a task into a trajectory.

    from posttrain.envs import rollout_episode, rollout_many
    trajectory = await rollout_episode(policy, task, tokenizer, SamplingParams(max_new_tokens=64))

`rollout_episode` builds the trajectory token-exactly (the engine's ids plus chat-template deltas for
observations), verifies the env's final state with `posttrain.verify`, and labels failures (see
`posttrain.envs.episode`). Environments (``single_turn``, ``tools``) and tools (``calculator``, ``list_files``,
``read_file``, ``write_file``, ``run_tests``) are registries a user extends with ``@environment`` and ``@tool``.
"""

from posttrain.envs import single_turn as _single_turn  # noqa: F401  (registers "single_turn")
from posttrain.envs import tool_env as _tool_env  # noqa: F401  (registers "tools")
from posttrain.envs.base import (
    ENVIRONMENTS,
    Action,
    EnvError,
    Environment,
    Observation,
    StepResult,
    ToolInfraError,
    environment,
    make_environment,
)
from posttrain.envs.calculator import CalculatorError
from posttrain.envs.calculator import evaluate as evaluate_expression
from posttrain.envs.episode import (
    judging_wall_seconds,
    rollout_episode,
    rollout_group,
    rollout_many,
    rollout_stats,
    run_episodes,
)
from posttrain.envs.parsing import PARSERS, ParsedTurn, TagJsonParser, ToolCall, ToolCallParser, get_parser
from posttrain.envs.policy import AsyncPolicy, SyncEnginePolicy, as_policy
from posttrain.envs.single_turn import SingleTurnEnv
from posttrain.envs.tokens import TranscriptTokens
from posttrain.envs.tool_env import ToolEnv
from posttrain.envs.tools import TOOLS, ToolContext, ToolError, ToolSpec, get_tool, tool, tool_schemas
from posttrain.envs.workspace import Workspace, WorkspaceError

__all__ = [
    "ENVIRONMENTS",
    "PARSERS",
    "TOOLS",
    "Action",
    "AsyncPolicy",
    "CalculatorError",
    "EnvError",
    "Environment",
    "Observation",
    "ParsedTurn",
    "SingleTurnEnv",
    "StepResult",
    "SyncEnginePolicy",
    "TagJsonParser",
    "ToolCall",
    "ToolCallParser",
    "ToolContext",
    "ToolEnv",
    "ToolError",
    "ToolInfraError",
    "ToolSpec",
    "TranscriptTokens",
    "Workspace",
    "WorkspaceError",
    "as_policy",
    "environment",
    "evaluate_expression",
    "get_parser",
    "get_tool",
    "judging_wall_seconds",
    "make_environment",
    "rollout_episode",
    "rollout_group",
    "rollout_many",
    "rollout_stats",
    "run_episodes",
    "tool",
    "tool_schemas",
]
