"""Tasks from files (the `tasks` domain): every shipped sample kind, JSONL / Parquet / a dataset through
`datasets.load_dataset`, HumanEval- and MBPP-style code tests judged in the real sandbox, difficulty levels, and
one-line errors naming the file, the row and the field."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.tasks import TaskError, get_domain
from posttrain.verify import verify

DATA = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes" / "data"


def _solution_text(domain, task) -> str:
    return domain.demonstration(task).messages[-1]["content"]


@pytest.mark.parametrize("kind, columns, verifier", [
    ("math", {"difficulty": "level", "reference": "answer"}, "math"),
    ("structured", {}, "structured"),
    ("format", {}, "format"),
])
def test_each_shipped_sample_loads_and_its_solutions_pass(kind, columns, verifier):
    domain = get_domain("tasks", kind=kind, path=str(DATA / f"tasks-{kind}.jsonl"), columns=columns)
    tasks = domain.tasks()
    assert len(tasks) == sum(1 for _ in open(DATA / f"tasks-{kind}.jsonl"))
    assert {t.verifier for t in tasks} == {verifier}
    for task in tasks:
        assert verify(task, _solution_text(domain, task)).passed, task.metadata["source"]
        assert not verify(task, "I do not know.").passed
    if kind == "math":
        assert sorted(domain.by_level) == [1, 2, 3] and domain.max_level == 3  # the curriculum's levels
        assert domain.make_task(random.Random(0), 3).difficulty == 3


@pytest.mark.bwrap
def test_code_tasks_in_every_test_shape_are_judged_in_the_sandbox():
    domain = get_domain("tasks", kind="code", path=str(DATA / "tasks-code.jsonl"))
    tasks = domain.tasks()
    shapes = [type(t.verifier_args["tests"]).__name__ for t in tasks]
    assert shapes.count("dict") == 3 and shapes.count("list") == 2 and shapes.count("str") == 5
    humaneval = [t for t in tasks if "check(count_vowels)" in str(t.verifier_args["tests"])]
    assert len(humaneval) == 1 and "def count_vowels" in _solution_text(domain, humaneval[0])
    for task in tasks:
        solution = _solution_text(domain, task)
        assert verify(task, solution).passed, (task.metadata["source"], verify(task, solution).details)
        broken = solution.replace("return ", "return None and ").replace("print(", "print('x', ")
        assert not verify(task, broken).passed, task.metadata["source"]
    assert sorted(domain.by_level) == [1, 2, 3]


def test_parquet_and_a_dataset_directory_through_load_dataset(tmp_path):
    import datasets

    rows = [json.loads(line) for line in open(DATA / "tasks-math.jsonl")]
    frame = datasets.Dataset.from_list(rows)
    frame.to_parquet(str(tmp_path / "math.parquet"))
    from_parquet = get_domain("tasks", kind="math", path=str(tmp_path / "math.parquet"),
                              columns={"difficulty": "level"})
    hub_dir = tmp_path / "hub_like"
    hub_dir.mkdir()
    frame.to_json(str(hub_dir / "train.jsonl"))  # a dataset directory, as load_dataset reads a hub repo
    from_hub = get_domain("tasks", kind="math", hf=str(hub_dir), split="train", columns={"difficulty": "level"})
    assert [t.verifier_args for t in from_parquet.tasks()] == [t.verifier_args for t in from_hub.tasks()]
    assert [t.difficulty for t in from_hub.tasks()] == [r["level"] for r in rows]
    with pytest.raises(TaskError, match="hf dataset 'no/such-dataset-here' split 'train' could not be loaded"):
        get_domain("tasks", kind="math", hf="no/such-dataset-here")


def test_eval_dataset_suites_read_task_files_too():
    source = get_domain("dataset", path=str(DATA / "tasks-format.jsonl"), domain_name="fmt", kind="format")
    assert [t.domain for t in source.tasks()] == ["fmt"] * 4


def test_bad_records_name_file_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:2: field 'reference' missing; fields present: question"):
        get_domain("tasks", kind="math", path=str(path))
    path.write_text(json.dumps({"prompt": "write f", "tset": "assert f()"}) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:1: a code task needs tests: a 'tests' column"):
        get_domain("tasks", kind="code", path=str(path))
    path.write_text(json.dumps({"prompt": "write f", "tests": {"function": "f", "cases": "none"}}) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:1: .*cases"):
        get_domain("tasks", kind="code", path=str(path))
    path.write_text(json.dumps({"prompt": "p", "level": "hard", "answer": "1"}) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:1: field 'level' must hold a level >= 1, got 'hard'"):
        get_domain("tasks", kind="math", path=str(path), columns={"difficulty": "level"})
    path.write_text("")
    with pytest.raises(TaskError, match="bad.jsonl"):
        get_domain("tasks", kind="math", path=str(path))
    with pytest.raises(TaskError, match="kind must be one of math, code, structured, format"):
        get_domain("tasks", kind="poetry", path=str(path))


def test_one_file_domain_twice_under_labels_keeps_the_two_apart(tmp_path):
    import yaml

    from posttrain.config import ConfigError, load_recipe
    from posttrain.schedule import Scheduler

    domains = [{"name": "tasks/algebra", "args": {"kind": "math", "path": str(DATA / "tasks-math.jsonl")}},
               {"name": "tasks/formats", "args": {"kind": "format", "path": str(DATA / "tasks-format.jsonl")}}]
    def recipe_of(domain_list):
        path = tmp_path / "rl.yaml"
        path.write_text(yaml.safe_dump({"stage": "rl", "domains": domain_list}))
        return load_recipe(path)

    recipe = recipe_of(domains)
    scheduler = Scheduler(recipe.domains, recipe.schedule, seed=0)
    assert scheduler.sources["tasks/algebra"].kind == "math"
    assert scheduler.sources["tasks/formats"].kind == "format"
    drawn = {task.domain for task in get_domain("tasks/algebra", **domains[0]["args"]).tasks(split="train")}
    assert drawn == {"tasks/algebra"}  # its tasks carry the label: statistics, curriculum and logs see two domains

    with pytest.raises(ConfigError, match="tasks/<label>"):
        recipe_of([domains[0] | {"name": "tasks"}, domains[1] | {"name": "tasks"}])
    with pytest.raises(TaskError, match="cannot be labelled"):
        get_domain("arithmetic/mine")
