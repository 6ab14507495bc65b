"""Verifiers: turn a task's outcome into a `Reward` that cannot be talked into a pass.

    from posttrain.verify import verify, verify_math, verify_code
    reward = verify(task, completion_or_trajectory, final_state)   # dispatches on task.verifier
    verify_math("... so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5").score      # 1.0

Registered verifiers (all of them on ``import posttrain.verify``): ``math``, ``code``, ``structured``, ``format``,
``exact``, ``refusal``, ``reasoning_gym``, ``repo_tests``, ``combined``, ``environment`` (an external
environment's own reward) and ``verifiers`` (a prime-rl verifiers task's rewards); register your own with
``@verifier("name")`` (and name its module in a recipe's ``imports:``). A verifier never trusts what the model says
about itself, gives 0 (with a failure class) to anything it cannot judge, and reports its own infrastructure failures
as ``FailureClass.SANDBOX``/``INFRA`` so they are retried instead of learned from. See docs/verifiers.md.
"""

from posttrain.verify.channel import read_record
from posttrain.verify.code_tests import normalize_stdout, parse_tests, strict_equal, verify_code
from posttrain.verify.completion import code_block, final_text, strip_reasoning
from posttrain.verify.environment import ENV_REWARD_KEY, verify_environment
from posttrain.verify.errors import VerifyError
from posttrain.verify.exact import verify_exact
from posttrain.verify.formats import combine, verify_combined, verify_format
from posttrain.verify.grammar import Grammar
from posttrain.verify.gym import verify_reasoning_gym
from posttrain.verify.math_answer import stated_answers, verify_math
from posttrain.verify.math_rational import parse_rational
from posttrain.verify.refusal import is_refusal, verify_refusal
from posttrain.verify.registry import (
    Verifier,
    check_task,
    check_verifier_args,
    get_verifier,
    is_blocking,
    list_verifiers,
    register_verifier,
    verifier,
    verify,
)
from posttrain.verify.repo_tests import verify_repo_tests
from posttrain.verify.structured import verify_structured
from posttrain.verify.verifiers_rubric import verifiers_tasks, verify_verifiers
from posttrain.verify.refusal import REFUSAL
from posttrain.verify.rewards import REWARD_TERMS_KEY, check_terms, judge_terms, with_reward_terms

__all__ = [
    "ENV_REWARD_KEY",
    "Grammar",
    "REFUSAL",
    "REWARD_TERMS_KEY",
    "Verifier",
    "VerifyError",
    "check_task",
    "check_terms",
    "check_verifier_args",
    "code_block",
    "combine",
    "final_text",
    "get_verifier",
    "is_blocking",
    "is_refusal",
    "judge_terms",
    "list_verifiers",
    "normalize_stdout",
    "parse_rational",
    "parse_tests",
    "read_record",
    "register_verifier",
    "stated_answers",
    "strict_equal",
    "strip_reasoning",
    "verifier",
    "verify",
    "verify_code",
    "verify_combined",
    "verify_environment",
    "verify_exact",
    "verify_format",
    "verify_math",
    "verify_reasoning_gym",
    "verify_refusal",
    "verify_repo_tests",
    "verify_structured",
    "verify_verifiers",
    "verifiers_tasks",
    "with_reward_terms",
]
