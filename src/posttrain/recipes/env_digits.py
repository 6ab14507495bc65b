"""The small environment the adapter recipes train on, written once for each ecosystem: "reply with digits only".

The reward is dense enough for the built-in tiny model to learn from scratch in minutes: a reply's *digit share*
(the fraction of its non-space characters that are digits), and it succeeds when the reply is all digits. The
same task three ways:

* Gymnasium: ``posttrain/Digits-v0`` (registered on import; ``turns`` prompts per episode, each step's reward the
  reply's digit share, ``info["success"]`` when every reply was all digits) -- ``grpo-gym.yaml``;
* OpenEnv: `app` (`create_fastapi_app` over `DigitsEnvironment`), served by ``python env_digits.py --port 8765``
  -- ``grpo-openenv.yaml``;
* verifiers (v1): `DigitsTaskset`, a taskset of prompts with a ``@vf.reward`` digit share -- ``grpo-verifiers.yaml``
  (the file is this module; verifiers' loader finds the taskset through ``__all__``).
"""

from __future__ import annotations

PROMPTS = ["Reply with digits only.", "Give me a number.", "Write digits, nothing else.", "Numbers only, please.",
           "Answer with a long number.", "Type some digits.", "Only digits.", "Say a number."]


def digit_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


# ---- Gymnasium ----------------------------------------------------------------------------------------------

try:
    import gymnasium
    from gymnasium import spaces
except ImportError:  # pragma: no cover - gymnasium is an optional dependency
    gymnasium = None

if gymnasium is not None:

    class AnyText(spaces.Text):
        """Any string up to `max_length` characters (a model may write anything; the reward judges it)."""

        def contains(self, x) -> bool:
            return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    class DigitsEnv(gymnasium.Env):
        metadata = {"render_modes": []}

        def __init__(self, turns: int = 1):
            self.turns = turns
            self.action_space = AnyText(max_length=4096)
            self.observation_space = spaces.Text(max_length=256, min_length=0, charset=[chr(i) for i in range(32, 127)])

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.step_index, self.all_digits = 0, True
            return self._prompt(), {}

        def _prompt(self) -> str:
            return PROMPTS[int(self.np_random.integers(len(PROMPTS)))]

        def step(self, action):
            share = digit_share(action)
            self.all_digits = self.all_digits and share == 1.0
            self.step_index += 1
            done = self.step_index >= self.turns
            return ("" if done else self._prompt()), share, done, False, {"success": done and self.all_digits}

    gymnasium.register("posttrain/Digits-v0", entry_point=DigitsEnv)


# ---- verifiers (v1) -----------------------------------------------------------------------------------------

try:
    import verifiers.v1 as vf
except ImportError:  # pragma: no cover - verifiers is an optional dependency
    vf = None

__all__: list[str] = []

if vf is not None:

    class DigitsTask(vf.Task[vf.TaskData]):
        @vf.reward(weight=1.0)
        async def digits(self, trace: vf.Trace) -> float:
            return digit_share(trace.last_reply)

    class DigitsConfig(vf.TasksetConfig):
        num_tasks: int = 400

    class DigitsTaskset(vf.Taskset[DigitsTask, DigitsConfig]):
        def load(self):
            return [DigitsTask(vf.TaskData(prompt=f"{PROMPTS[i % len(PROMPTS)]} (#{i})"))
                    for i in range(self.config.num_tasks)]

    __all__ = ["DigitsTaskset"]


# ---- OpenEnv ------------------------------------------------------------------------------------------------


def make_app():
    """The OpenEnv server app: each session one episode of `turns` prompts (``reset(seed=..., turns=...)``)."""
    import random

    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

    class DigitsAction(Action):
        message: str

    class DigitsObservation(Observation):
        prompt: str = ""

    class DigitsEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed=None, episode_id=None, turns: int = 1, **kwargs):
            self.rng, self.turns = random.Random(seed), int(turns)
            self._state = State(episode_id=episode_id, step_count=0)
            return DigitsObservation(prompt=self.rng.choice(PROMPTS))

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            done = self._state.step_count >= self.turns
            prompt = "" if done else self.rng.choice(PROMPTS)
            return DigitsObservation(prompt=prompt, done=done, reward=digit_share(action.message))

        @property
        def state(self):
            return self._state

    return create_fastapi_app(DigitsEnvironment, DigitsAction, DigitsObservation, max_concurrent_envs=256)


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description="serve the digits OpenEnv environment")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    options = parser.parse_args()
    uvicorn.run(make_app(), host=options.host, port=options.port, log_level="warning")
