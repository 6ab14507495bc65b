"""Task domains: generators (and dataset adapters) that yield Tasks and SFT demonstrations.

    from posttrain.tasks import get_domain, sample_tasks
    tasks = sample_tasks(get_domain("arithmetic"), 100, level=3, split="heldout")

Domains: ``arithmetic``, ``fractions`` (judged by the math verifier), ``extraction``, ``calculator`` (multi-turn
tool use), ``code``, ``repo_fix`` (agentic), ``long_doc_qa``, ``needle`` and ``multi_doc_qa`` (long-context: levels
are lengths in tokens, up to 32k), ``agent`` (another domain's tasks done by a black-box agent program in the
sandbox), ``dataset`` (a JSONL file or saved Hugging Face dataset of problems with answers), ``tasks``
(a file or hub dataset of math, code, structured or format tasks: `posttrain.tasks.task_file`),
``shape_count``, ``largest_colour``, ``read_digits`` (images drawn with Pillow: `posttrain.tasks.shapes`),
``bar_value`` (a bar's value in a Pillow-drawn bar chart: `posttrain.tasks.charts`) and
``reasoning_gym/<name>`` (every generator of the installed reasoning-gym, registered on first use), and other
ecosystems' environments: ``gym`` (Gymnasium text envs), ``openenv`` (OpenEnv servers) and ``verifiers`` (prime-rl verifiers
tasksets), `posttrain.tasks.external`. See docs/tasks.md to add one.
"""

from posttrain.tasks import agent as _agent  # noqa: F401  (each import registers its domain)
from posttrain.tasks import arithmetic as _arithmetic  # noqa: F401
from posttrain.tasks import calculator as _calculator  # noqa: F401
from posttrain.tasks import code as _code  # noqa: F401
from posttrain.tasks import dataset as _dataset  # noqa: F401
from posttrain.tasks import external as _external  # noqa: F401
from posttrain.tasks import extraction as _extraction  # noqa: F401
from posttrain.tasks import fractions as _fractions  # noqa: F401
from posttrain.tasks import long_doc_qa as _long_doc_qa  # noqa: F401
from posttrain.tasks import multi_doc_qa as _multi_doc_qa  # noqa: F401
from posttrain.tasks import needle as _needle  # noqa: F401
from posttrain.tasks import reasoning_gym as _reasoning_gym  # noqa: F401
from posttrain.tasks import repo_fix as _repo_fix  # noqa: F401
from posttrain.tasks import safety as _safety  # noqa: F401
from posttrain.tasks import shapes as _shapes  # noqa: F401
from posttrain.tasks import charts as _charts  # noqa: F401  (registers bar_value)
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
from posttrain.tasks.haystack import TokenCounter, filler_vocabulary
from posttrain.tasks.reasoning_gym import reasoning_gym_names
from posttrain.tasks.shapes import data_url as png_data_url

__all__ = [
    "DOMAINS",
    "Domain",
    "TaskError",
    "TokenCounter",
    "demo_conversation",
    "demonstrations",
    "domain",
    "filler_vocabulary",
    "get_domain",
    "png_data_url",
    "reasoning_gym_names",
    "sample_tasks",
    "split_of",
    "tool_call_message",
    "tool_result_message",
]
