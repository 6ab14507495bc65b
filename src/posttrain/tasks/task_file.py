"""Tasks from files, for RL and evaluation: the ``tasks`` domain reads a JSONL, a Parquet file, a saved dataset or a
hub dataset of tasks and maps its columns to a verifier's arguments.

    domains:                                            # an RL recipe
      - name: tasks/mine                                # one file: name: tasks; more: tasks/<label> each
        args: {path: my_problems.jsonl, kind: code}
      - name: tasks/humaneval
        args: {hf: openai/openai_humaneval, split: test, kind: code}   # via datasets.load_dataset

Kinds, and the columns each reads (``columns: {key: column}`` renames any of them; unset, the key's own name):

* ``math`` - ``prompt`` and ``reference`` (the answer), judged by ``math``;
* ``code`` - ``prompt`` and tests in any shape of the ``code`` verifier under ``tests`` (stdin/stdout cases,
  ``{function, cases}``, or assert source; a JSON string of the first two is read too), or HumanEval style
  (``test`` defining ``check(candidate)`` + ``entry_point``), or MBPP style (``test_list`` of assert lines, with
  an optional ``test_setup_code``); judged by ``code`` in the sandbox;
* ``structured`` - ``prompt``, ``schema`` (a JSON schema, or its JSON text), ``reference`` (the expected fields)
  and an optional ``source`` (the text the fields must be grounded in); judged by ``structured``;
* ``format`` - ``prompt`` and ``pattern`` (a regex) or ``grammar``; judged by ``format``.

``prompt`` falls back to the first of ``prompt``, ``question``, ``problem``, ``text``, ``instruction`` present.
A ``difficulty`` column (an integer, or text holding one: "Level 3") gives the task's level, which the curriculum
moves along; without one every task is level 1. ``id`` (default: the prompt) is the task's identity and decides
its train / held-out split. ``solution`` (or HumanEval's ``canonical_solution``, completed with its prompt, or MBPP's
``code``) makes the SFT demonstration. ``args`` adds fixed verifier arguments (``{timeout_s: 8}``).

Every bad record is a `TaskError` naming the file, the row and the field. Samples of each kind ship in
``posttrain/recipes/data/`` (``tasks-math.jsonl``, ``tasks-code.jsonl``, ``tasks-structured.jsonl``,
``tasks-format.jsonl``).
"""

from __future__ import annotations

import difflib
import json
import random
import re
from typing import Any, Iterator

from posttrain.data import SFTSample
from posttrain.tasks.base import (
    TaskError,
    demo_sample,
    domain,
    draw_task,
    file_tasks,
    task_id,
    task_records,
    tasks_by_level,
)
from posttrain.types import Task
from posttrain.verify import VerifyError, check_task

KINDS = {"math": "math", "code": "code", "structured": "structured", "format": "format"}
PROMPT_COLUMNS = ("prompt", "question", "problem", "text", "instruction")
SOLUTION_COLUMNS = ("solution", "canonical_solution", "code")
INSTRUCTIONS = {
    "math": "Put the final answer in \\boxed{}.",
    "code": "Write the solution in Python, in one ```python code block.",
    "structured": "Answer with one JSON object.",
    "format": None,
}


@domain("tasks")
class TaskFileDomain:
    def __init__(self, kind: str, path: str | None = None, *, hf: str | None = None, subset: str | None = None,
                 split: str = "train", columns: dict[str, str] | None = None, args: dict[str, Any] | None = None,
                 instruction: str | None = "", system_prompt: str | None = None, domain_name: str = "tasks",
                 timeout_s: float = 60.0):
        if kind not in KINDS:
            raise TaskError(f"tasks: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if (path is None) == (hf is None):
            raise TaskError("tasks: give exactly one of path (JSONL, Parquet, a saved dataset) or hf (a hub dataset)")
        self.name, self.kind, self.verifier = domain_name, kind, KINDS[kind]
        self.source = path or f"hf:{hf}" + (f"/{subset}" if subset else "") + f"[{split}]"
        self.columns = dict(columns or {})
        self.extra_args = dict(args or {})
        self.instruction = INSTRUCTIONS[kind] if instruction == "" else instruction
        self.system_prompt, self.timeout_s = system_prompt, timeout_s
        rows = _file_rows(path) if path is not None else _hub_rows(hf, subset, split)  # type: ignore[arg-type]
        self.by_level = tasks_by_level((self._task(where, row, record) for where, row, record in rows), self.source)
        self.max_level = max(self.by_level)

    # ---- the Domain protocol ------------------------------------------------------------------------------

    def make_task(self, rng: random.Random, level: int) -> Task:
        return draw_task(self.by_level, rng, level, self.source)

    def tasks(self, split: str | None = None, heldout_fraction: float = 0.1) -> list[Task]:
        """Every task of the file (of one split, if given), in file order: what an evaluation suite runs."""
        return file_tasks(self.by_level, split, heldout_fraction)

    def demonstration(self, task: Task) -> SFTSample:
        solution = task.metadata.get("solution")
        if not solution:
            raise TaskError(f"{task.metadata['source']}: no solution column for an SFT demonstration "
                            f"(map one with columns: {{solution: ...}})")
        if self.kind == "code":
            answer = f"```python\n{solution.strip()}\n```"
        elif self.kind == "math":
            answer = f"{solution}\nThe answer is \\boxed{{{task.verifier_args['reference']}}}."
        else:
            answer = solution
        return demo_sample(task, answer, None, source=self.source)

    # ---- one record -> one task --------------------------------------------------------------------------

    def _task(self, where: str, row: int, record: Any) -> Task:
        if not isinstance(record, dict):
            raise TaskError(f"{where}: expected an object, got {type(record).__name__}")
        prompt = self._text(where, record, "prompt", PROMPT_COLUMNS)
        verifier_args = {**getattr(self, f"_{self.kind}_args")(where, record, prompt), **self.extra_args}
        content = f"{prompt}\n{self.instruction}" if self.instruction else prompt
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = str(record[self._column("id")]) if self._column("id") in record else prompt
        task = Task(
            id=task_id(self.name, key), domain=self.name, difficulty=self._level(where, record), messages=messages,
            verifier=self.verifier, verifier_args=verifier_args, max_steps=1, timeout_s=self.timeout_s,
            metadata={"problem_key": key, "row": row, "source": where, "solution": self._solution(record, prompt)},
        )
        try:
            check_task(task)
        except VerifyError as error:
            raise TaskError(f"{where}: {str(error).split(': ', 1)[-1]}") from None
        return task

    def _math_args(self, where: str, record: dict, prompt: str) -> dict[str, Any]:
        return {"reference": self._text(where, record, "reference", ("reference", "answer"))}

    def _code_args(self, where: str, record: dict, prompt: str) -> dict[str, Any]:
        tests, test, entry, asserts = (self._column(k) for k in ("tests", "test", "entry_point", "test_list"))
        if tests in record:
            value = record[tests]
            if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass  # assert source that happens to start with a bracket
            return {"tests": value}
        if test in record and entry in record:  # HumanEval: check(candidate) run on the entry point
            source, name = record[test], record[entry]
            if not isinstance(source, str) or not isinstance(name, str) or not name.isidentifier():
                raise TaskError(f"{where}: '{test}' must be test source and '{entry}' a function name")
            return {"tests": f"{source.rstrip()}\n\n\ncheck({name})\n"}
        if asserts in record:  # MBPP: a list of assert statements, perhaps with set-up code
            lines = record[asserts]
            if hasattr(lines, "tolist"):
                lines = lines.tolist()  # a Parquet list column
            if not isinstance(lines, list) or not lines or not all(isinstance(x, str) for x in lines):
                raise TaskError(f"{where}: field '{asserts}' must be a non-empty list of assert statements")
            setup = record.get(self._column("test_setup_code")) or ""
            return {"tests": "\n".join([setup, *lines]).strip() + "\n"}
        raise TaskError(f"{where}: a code task needs tests: a '{tests}' column, '{test}' + '{entry}' (HumanEval) "
                        f"or '{asserts}' (MBPP); fields present: {', '.join(record)}")

    def _structured_args(self, where: str, record: dict, prompt: str) -> dict[str, Any]:
        args = {"schema": self._json(where, record, "schema"), "reference": self._json(where, record, "reference")}
        if self._column("source") in record and record[self._column("source")] is not None:
            args["source"] = self._text(where, record, "source", ("source",))
        return args

    def _format_args(self, where: str, record: dict, prompt: str) -> dict[str, Any]:
        for key in ("pattern", "grammar"):
            if self._column(key) in record:
                return {key: self._text(where, record, key, (key,))}
        raise TaskError(f"{where}: a format task needs a '{self._column('pattern')}' (regex) or "
                        f"'{self._column('grammar')}' column; fields present: {', '.join(record)}")

    # ---- fields ------------------------------------------------------------------------------------------

    def _column(self, key: str) -> str:
        return self.columns.get(key, key)

    def _text(self, where: str, record: dict, key: str, fallbacks: tuple[str, ...]) -> str:
        candidates = [self.columns[key]] if key in self.columns else list(fallbacks)
        field = next((c for c in candidates if c in record), None)
        if field is None:
            close = difflib.get_close_matches(candidates[0], list(record), n=1)
            hint = f" (did you mean '{close[0]}'? map it with columns: {{{key}: {close[0]}}})" if close else ""
            raise TaskError(f"{where}: field '{candidates[0]}' missing{hint}; fields present: {', '.join(record)}")
        value = record[field]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise TaskError(f"{where}: field '{field}' must be a non-empty string, got {value!r:.80}")
        return value.strip()

    def _json(self, where: str, record: dict, key: str) -> Any:
        field = self._column(key)
        if field not in record:
            raise TaskError(f"{where}: field '{field}' missing; fields present: {', '.join(record)}")
        value = record[field]
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as error:
                raise TaskError(f"{where}: field '{field}' is not JSON ({error.msg})") from None
        return value

    def _level(self, where: str, record: dict) -> int:
        field = self._column("difficulty")
        if field not in record or record[field] is None:
            if "difficulty" in self.columns:
                raise TaskError(f"{where}: field '{field}' missing; fields present: {', '.join(record)}")
            return 1
        match = re.search(r"\d+", str(record[field]))
        if not match or int(match.group()) < 1:
            raise TaskError(f"{where}: field '{field}' must hold a level >= 1, got {record[field]!r}")
        return int(match.group())

    def _solution(self, record: dict, prompt: str) -> str | None:
        candidates = [self.columns["solution"]] if "solution" in self.columns else list(SOLUTION_COLUMNS)
        field = next((c for c in candidates if isinstance(record.get(c), str) and record[c].strip()), None)
        if field is None:
            return None
        solution = record[field]
        entry = record.get(self._column("entry_point"))
        if isinstance(entry, str) and f"def {entry}" not in solution:
            # HumanEval: canonical_solution is the body of the function the prompt begins
            solution = prompt.rstrip("\n") + "\n" + solution
        return solution


def _file_rows(path: str) -> Iterator[tuple[str, int, Any]]:
    yield from task_records(path)  # JSONL, Parquet, saved datasets: the data room's reader


def _hub_rows(name: str, subset: str | None, split: str) -> Iterator[tuple[str, int, Any]]:
    """Rows of a hub dataset (or a local dataset directory or loading script) through `datasets.load_dataset`."""
    import datasets

    try:
        rows = datasets.load_dataset(name, subset, split=split)
    except Exception as error:  # noqa: BLE001 - datasets raises many types for one user mistake
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise TaskError(f"tasks: hf dataset '{name}'" + (f" ({subset})" if subset else "")
                        + f" split '{split}' could not be loaded: {first}") from None
    for index, record in enumerate(rows):
        yield f"{name}[{split}]:row {index}", index, record
