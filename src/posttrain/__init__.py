"""posttrain: turn a base or instruct causal LM into one that reliably does tasks.

Stages: SFT, preference optimization (DPO family, reward models), RL with verifiable rewards
(single-turn and agentic), with sandboxed execution, a task scheduler/curriculum and evaluation.
See README.md and docs/ for the tour; ARCHITECTURE.md in the shared folder for the rooms.
"""

__version__ = "0.1.0"
