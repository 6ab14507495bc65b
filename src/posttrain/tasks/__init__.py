"""Task domains: generators (and dataset adapters) that yield Tasks and SFT demonstrations.

    from posttrain.tasks import get_domain, sample_tasks
    tasks = sample_tasks(get_domain("arithmetic"), 100, level=3, split="heldout")

Domains: ``arithmetic``, ``fractions`` (judged by the math verifier), ``extraction``, ``calculator`` (multi-turn tool use), ``code``, ``repo_fix`` (agentic),
``long_doc_qa``, ``dataset`` (a JSONL file or saved Hugging Face dataset of problems with answers), ``tasks``
(a file or hub dataset of math, code, structured or format tasks: `posttrain.tasks.task_file`) and
``reasoning_gym/<name>`` (every generator of the installed reasoning-gym, registered on first use). See docs/tasks.md to add one.
"""

from posttrain.tasks import arithmetic as _arithmetic  # noqa: F401  (each import registers its domain)
from posttrain.tasks import calculator as _calculator  # noqa: F401
from posttrain.tasks import code as _code  # noqa: F401
from posttrain.tasks import dataset as _dataset  # noqa: F401
from posttrain.tasks import extraction as _extraction  # noqa: F401
from posttrain.tasks import fractions as _fractions  # noqa: F401
from posttrain.tasks import long_doc_qa as _long_doc_qa  # noqa: F401
from posttrain.tasks import reasoning_gym as _reasoning_gym  # noqa: F401
from posttrain.tasks import repo_fix as _repo_fix  # noqa: F401
from posttrain.tasks import safety as _safety  # noqa: F401
from posttrain.tasks import task_file as _task_file  # noqa: F401
from posttrain.tasks.base import (
    DOMAINS,
    Domain,
    TaskError,
    demo_conversation,
    demonstrations,
    domain,
    get_domain,
    sample_tasks,
    split_of,
    tool_call_message,
    tool_result_message,
)
from posttrain.tasks.reasoning_gym import reasoning_gym_names

__all__ = [
    "DOMAINS",
    "Domain",
    "TaskError",
    "demo_conversation",
    "demonstrations",
    "domain",
    "get_domain",
    "reasoning_gym_names",
    "sample_tasks",
    "split_of",
    "tool_call_message",
    "tool_result_message",
]
