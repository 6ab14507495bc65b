"""Task domains: generators (and dataset adapters) that yield Tasks and SFT demonstrations.

    from posttrain.tasks import get_domain, sample_tasks
    tasks = sample_tasks(get_domain("arithmetic"), 100, level=3, split="heldout")
"""

from posttrain.tasks import arithmetic as _arithmetic  # noqa: F401  (registers the domain)
from posttrain.tasks.base import (
    DOMAINS,
    Domain,
    TaskError,
    demonstrations,
    domain,
    get_domain,
    sample_tasks,
    split_of,
)

__all__ = ["DOMAINS", "Domain", "TaskError", "demonstrations", "domain", "get_domain", "sample_tasks", "split_of"]
