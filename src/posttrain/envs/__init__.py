"""Environments: the world a policy acts in, and the episode loop that turns a task into a trajectory.

    from posttrain.envs import rollout_episode, rollout_many
    trajectory = await rollout_episode(policy, task, tokenizer, SamplingParams(max_new_tokens=64))

`rollout_episode` builds the trajectory token-exactly (the engine's ids plus chat-template deltas for
observations), verifies the env's final state with `posttrain.verify`, and labels failures (see
`posttrain.envs.episode`). Environments (``single_turn``, ``tools``, ``agent``: a black-box agent program run in
the sandbox against a recording OpenAI endpoint, `posttrain.envs.agent`; adapters of other ecosystems: ``gym``,
``openenv``, ``verifiers``) and tools (``calculator``, ``list_files``,
``read_file``, ``write_file``, ``run_tests``) are registries a user extends with ``@environment`` and ``@tool``.
"""

from posttrain.envs import gym_env as _gym_env  # noqa: F401  (registers "gym")
from posttrain.envs import openenv_env as _openenv_env  # noqa: F401  (registers "openenv")
from posttrain.envs import single_turn as _single_turn  # noqa: F401  (registers "single_turn")
from posttrain.envs.agent import AgentEnv, DrivenEpisode  # (registers "agent")
from posttrain.envs.agent_endpoint import EndpointLimits, RecordingEndpoint
from posttrain.envs import tool_env as _tool_env  # noqa: F401  (registers "tools")
from posttrain.envs import verifiers_env as _verifiers_env  # noqa: F401  (registers "verifiers")
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
from posttrain.envs.external import env_reward, guarded, observation_text
from posttrain.envs.gym_env import GymTextEnv
from posttrain.envs.openenv_env import OpenEnvEnv
from posttrain.envs.episode import (
    judging_wall_seconds,
    episode_policy_tokens,
    oldest_policy_version,
    process_reward,
    rollout_episode,
    rollout_group,
    rollout_many,
    rollout_stats,
    run_episodes,
    trajectory_segments,
)
from posttrain.envs.parsing import (PARSERS, ParsedTurn, TagJsonParser, ToolCall, ToolCallParser, get_parser,
                                    lone_surrogate)
from posttrain.envs.policy import AsyncPolicy, SyncEnginePolicy, as_policy
from posttrain.envs.single_turn import SingleTurnEnv
from posttrain.envs.tokens import PromptRenderer, TranscriptTokens
from posttrain.envs.tool_env import ToolEnv
from posttrain.envs.verifiers_env import VerifiersEnv, vf_task_messages
from posttrain.envs.tools import TOOLS, ToolContext, ToolError, ToolSpec, get_tool, tool, tool_schemas
from posttrain.envs.workspace import Workspace, WorkspaceError

__all__ = [
    "ENVIRONMENTS",
    "PARSERS",
    "TOOLS",
    "Action",
    "AgentEnv",
    "AsyncPolicy",
    "CalculatorError",
    "DrivenEpisode",
    "EndpointLimits",
    "EnvError",
    "Environment",
    "GymTextEnv",
    "Observation",
    "OpenEnvEnv",
    "ParsedTurn",
    "RecordingEndpoint",
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
    "VerifiersEnv",
    "Workspace",
    "WorkspaceError",
    "as_policy",
    "env_reward",
    "environment",
    "evaluate_expression",
    "get_parser",
    "get_tool",
    "guarded",
    "judging_wall_seconds",
    "lone_surrogate",
    "make_environment",
    "observation_text",
    "episode_policy_tokens",
    "oldest_policy_version",
    "process_reward",
    "PromptRenderer",
    "rollout_episode",
    "rollout_group",
    "rollout_many",
    "rollout_stats",
    "run_episodes",
    "tool",
    "tool_schemas",
    "trajectory_segments",
    "vf_task_messages",
]
