"""posttrain: turn a base or instruct causal LM into one that reliably does tasks.

Stages: SFT, preference optimization (DPO family, reward models), RL with verifiable rewards
(single-turn and agentic), with sandboxed execution, a task scheduler/curriculum and evaluation.
See README.md and docs/ for the tour; ARCHITECTURE.md in the shared folder for the rooms.
"""

import logging as _logging

__version__ = "0.1.0"

# transformers imports torchao (when installed: the `quantize` extra) with its model classes; on a CPU-only
# torch torchao logs a warning per GPU kernel library it cannot load (none is needed on a CPU) and torch one per
# enum torchao registers. Raised to ERROR here, before any room imports transformers, so that no stage starts
# with five lines of noise.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
del _name
