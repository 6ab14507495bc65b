"""The verifier registry and `verify` dispatch, bad input (never an exception), and the non-sandbox verifiers:
structured extraction, format checks (regex and grammar), exact answers and combined rewards."""

from __future__ import annotations

import pytest

from posttrain.types import FailureClass, Reward, Task, Trajectory
from posttrain.verify import (
    Grammar,
    VerifyError,
    check_task,
    combine,
    get_verifier,
    list_verifiers,
    register_verifier,
    verifier,
    verify,
    verify_exact,
    verify_format,
    verify_structured,
)


def task(name: str, **args) -> Task:
    return Task(id="t1", domain="d", messages=[{"role": "user", "content": "q"}], verifier=name, verifier_args=args)


def test_builtin_verifiers_are_registered():
    assert {"math", "code", "structured", "format", "exact", "reasoning_gym", "combined"} <= set(list_verifiers())


def test_unknown_verifier_and_bad_arguments_are_clear_errors():
    with pytest.raises(VerifyError, match="unknown verifier 'mth'.*registered: .*math"):
        get_verifier("mth")
    typo = r"task 't1'.*unknown argument 'refrence' \(did you mean 'reference'\?\).*takes: reference"
    with pytest.raises(VerifyError, match=typo):
        check_task(task("math", refrence="1"))
    with pytest.raises(VerifyError, match="missing a required argument: 'answer'"):
        check_task(task("exact"))
    with pytest.raises(VerifyError, match="invalid JSON schema"):
        check_task(task("structured", schema={"type": "no-such-type"}, reference={"a": 1}))
    with pytest.raises(VerifyError, match="extract must be one of"):
        verify(task("exact", answer="1", extract="middle"), "1")
    check_task(task("exact", answer="1"))  # a good spec passes


def test_user_verifiers_register_with_a_decorator():
    @verifier("test_length")
    def verify_length(completion: str, *, target: int, final_state=None) -> Reward:
        return Reward(float(len(completion) == target), len(completion) == target)

    assert verify(task("test_length", target=3), "abc").passed
    assert get_verifier("test_length")("abcd", target=3).score == 0.0
    with pytest.raises(VerifyError, match="already registered"):
        register_verifier("test_length", lambda completion, final_state=None: Reward(1.0, True))


def test_a_verifier_that_crashes_is_an_infra_failure_not_a_zero():
    def explode(completion: str, *, final_state=None) -> Reward:
        raise RuntimeError("bug in the verifier")

    register_verifier("test_explodes", explode, replace=True)
    reward = verify(task("test_explodes"), "anything")
    assert reward.failure == FailureClass.INFRA and reward.is_infrastructure_failure
    assert "bug in the verifier" in reward.details["error"]


@pytest.mark.parametrize("garbage, reason", [
    (b"\xff\xfe\xfa garbage", "non_utf8"),
    ("\ud800 lone surrogate", "non_utf8"),
    ("\x00\x01\x02\x03" * 40, "binary"),
    ("x" * 250_000, "too_long"),
    (3.14, "not_text"),
])
@pytest.mark.parametrize("name, args", [
    ("exact", {"answer": "1"}),
    ("format", {"pattern": "1"}),
    ("structured", {"schema": {"type": "object"}, "reference": {"a": "1"}}),
])
def test_bad_completions_score_zero_with_a_failure_class(garbage, reason, name, args):
    reward = verify(task(name, **args), garbage)
    assert reward.score == 0 and reward.failure == FailureClass.FORMAT and reward.details["reason"] == reason


def test_trajectory_uses_the_last_assistant_message_and_final_state_the_answer():
    trajectory = Trajectory(task_id="t", domain="d", token_ids=[], loss_mask=[], behaviour_logprobs=[],
                            policy_versions=[], prompt_length=0, reward=Reward(0.0, False),
                            messages=[{"role": "assistant", "content": "1"}, {"role": "tool", "content": "x"},
                                      {"role": "assistant", "content": "632"}])
    assert verify(task("exact", answer="632"), trajectory).passed
    assert verify(task("exact", answer="632"), "", final_state={"answer": "632", "files": {}}).passed


# ---- structured ----------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "amount": {"type": "number"},
                                           "address": {"type": "object"}},
          "required": ["name", "amount"]}
SOURCE = "Invoice for Ana María Souza: total due $1,234.50, shipped to 5 Rue Cler, Paris."
REFERENCE = {"name": "Ana María Souza", "amount": 1234.5, "address": {"city": "Paris"}}


def test_structured_fields_right_and_grounded():
    good = '{"name": "ana maría souza", "amount": 1234.50, "address": {"city": "PARIS"}}'
    assert verify_structured(good, SCHEMA, REFERENCE, SOURCE).passed
    partly = verify_structured('{"name": "Ana Souza", "amount": 1234.5, "address": {"city": "Paris"}}',
                               SCHEMA, REFERENCE, SOURCE)
    assert partly.score == pytest.approx(2 / 3) and partly.details["fields"]["name"] == "wrong"


def test_structured_invalid_json_or_schema_is_zero():
    assert verify_structured("{'name': 'x'}", SCHEMA, REFERENCE, SOURCE).details["reason"] == "invalid_json"
    invalid = verify_structured('{"name": "Ana María Souza"}', SCHEMA, REFERENCE, SOURCE)
    assert invalid.score == 0 and invalid.details["reason"] == "schema_invalid"


def test_structured_ungrounded_values_do_not_count():
    reward = verify_structured('{"name": "Ana María Souza", "amount": 1234.5, "address": {"city": "Paris"}}',
                               SCHEMA, REFERENCE, "Invoice total $1,234.50, Paris.")
    assert reward.details["fields"]["name"] == "not_grounded" and reward.score == pytest.approx(2 / 3)
    assert verify_structured('{"name": "Ana María Souza", "amount": 1234.5, "address": {"city": "Paris"}}',
                             SCHEMA, REFERENCE, "Invoice total $1,234.50, Paris.", ground=False).passed


# ---- format, exact, combined -------------------------------------------------------------------------------


def test_format_regex_full_match_and_search():
    assert verify_format("Answer: 42", r"Answer: \d+").passed
    assert not verify_format("So. Answer: 42", r"Answer: \d+").passed
    assert verify_format("So. Answer: 42", r"Answer: \d+", full_match=False).passed
    assert verify_format("ANSWER: 42", r"answer: \d+", flags="i").passed


def test_format_regex_cannot_be_made_to_backtrack_forever():
    reward = verify_format("a" * 5000 + "!", r"(a+)+$")
    assert reward.score == 0 and reward.details["reason"] in ("format_gave_up", "format_check_gave_up",
                                                               "format_mismatch")


def test_grammar_matches_whole_text_and_rejects_malformed_grammars():
    grammar = Grammar('list ::= "[" (item ("," item)*)? "]"\nitem ::= /[0-9]+/ | list')
    assert grammar.matches("[1,[2,3],[]]") and not grammar.matches("[1,2") and not grammar.matches("[1]x")
    with pytest.raises(VerifyError, match="undefined rule 'nope'"):
        Grammar("a ::= nope")
    with pytest.raises(VerifyError, match="unbalanced"):
        Grammar('a ::= ( "x"')
    with pytest.raises(VerifyError, match="exactly one of"):
        verify_format("x")
    assert verify_format("[1,[2]]", grammar='l ::= "[" (i ("," i)*)? "]"\ni ::= /[0-9]+/ | l').passed


def test_exact_normalizes_and_refuses_several_answers():
    assert verify_exact("  632. ", "632").passed
    assert verify_exact("<think>7+5=12</think>\n632", "632").passed
    assert not verify_exact("632 or 633", "632").passed
    assert verify_exact("work\nDone: 12\n12", 12, extract="last_line").passed
    assert verify_exact(r"\boxed{12} and \boxed{13}", 12, extract="boxed").details["reason"] == "multiple_answers"
    assert verify_exact("<answer>Paris</answer>", "paris", extract="answer_tag").passed
    assert not verify_exact("<answer>Paris</answer>", "paris", extract="answer_tag", case_sensitive=True).passed


def test_combined_reward_reports_each_component():
    components = {
        "correct": {"verifier": "exact", "args": {"answer": "42", "extract": "answer_tag"}, "weight": 0.8},
        "format": {"verifier": "format", "args": {"pattern": r"(?s)<think>.+</think>\s*<answer>.+</answer>"},
                   "weight": 0.2},
    }
    full = verify(task("combined", components=components), "<think>6*7</think><answer>42</answer>")
    assert full.passed and full.score == 1.0 and full.components == {"correct": 1.0, "format": 1.0}
    unformatted = verify(task("combined", components=components), "<answer>42</answer>")
    assert not unformatted.passed and unformatted.score == pytest.approx(0.8)
    assert unformatted.components == {"correct": 1.0, "format": 0.0}
    assert unformatted.failure == FailureClass.FORMAT and "format" in unformatted.details
    with pytest.raises(VerifyError, match="component 'x' needs a 'verifier'"):
        check_task(task("combined", components={"x": {}}))


def test_combine_keeps_infrastructure_failures_whole():
    broken = Reward(0.0, False, FailureClass.SANDBOX)
    combined = combine({"a": Reward(1.0, True), "b": broken}, {"a": 1.0, "b": 1.0})
    assert combined.is_infrastructure_failure and combined.components == {"a": 1.0, "b": 0.0}
    with pytest.raises(VerifyError, match="same parts"):
        combine({"a": Reward(1.0, True)}, {"b": 1.0})


@pytest.mark.parametrize("name, args", [
    ("exact", {"answer": "1", "extract": "answer_tag"}),
    ("exact", {"answer": "1", "extract": "boxed"}),
    ("math", {"reference": "1"}),
    ("structured", {"schema": {"type": "object"}, "reference": {"a": "1"}}),
    ("format", {"pattern": r"\d+"}),
])
@pytest.mark.parametrize("attack", [
    "<answer>" * 24_000,
    "Answer: " + " " * 190_000 + "x",
    "#### " + "\t " * 90_000 + "x",
    "\\boxed{" * 20_000,
    "{" * 100_000,
    "```python\n" * 15_000,
])
def test_pathological_completions_are_judged_in_linear_time(name, args, attack):
    import time

    started = time.monotonic()
    reward = verify(task(name, **args), attack)
    assert not reward.passed and time.monotonic() - started < 2.0
