"""Load a recipe: YAML file + `a.b=c` overrides -> a validated, typed pydantic model.

Errors name where the mistake is and how to fix it, in one line each:

    recipe.yaml:12: unknown key 'train.lrr' (did you mean 'train.lr'?)
    override 'optim.lr=fast': optim.lr: expected a number, got 'fast'

Stage schemas register themselves with `@recipe("sft")`; `posttrain.config` imports every one of them, so
`load_recipe(path)` can pick the schema from the file's `stage:` key in a library call too.

A recipe's `imports:` (modules or ``.py`` files, relative to the recipe's directory) are made absolute and imported
once the recipe is valid, before anything else of the run (`posttrain.usercode`): the user's ``@verifier``,
``@domain``, ``@environment`` and ``@tool`` are registered in this process, and workers import the same list.

``${recipe_dir}`` in any string value of the file is replaced by the recipe file's directory (absolute), so a
recipe can name the data and code that sit beside it (the packaged recipes do) and run from any directory.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.types import PosttrainError
from posttrain.usercode import UserCodeError, import_all, is_file_ref, resolve_entry

T = TypeVar("T", bound=BaseModel)
RECIPES: dict[str, type[BaseModel]] = {}


class ConfigError(PosttrainError):
    """A recipe or an override is wrong: the message says which key, where, and what was expected."""


def recipe(stage: str):
    """Register a recipe schema under its stage name (`posttrain <stage> recipe.yaml`)."""

    def register(cls: type[T]) -> type[T]:
        RECIPES[stage] = cls
        return cls

    return register


def load_recipe(
    path: str | Path | None, overrides: list[str] | None = None, schema: type[T] | None = None
) -> T:
    """Read `path` (or start from the schema's defaults when None), apply overrides, validate."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    key_lines: dict[tuple, int] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{source}: recipe file not found")
        text = file.read_text(encoding="utf-8")
        try:
            loaded = yaml.safe_load(text)
            tree = yaml.compose(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark else source
            raise ConfigError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
        _refuse_repeated_keys(tree, source)
        key_lines = _key_lines(tree)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: a recipe is a mapping of sections, got {type(loaded).__name__}")
        data = _with_recipe_dir(loaded, str(file.resolve().parent))
    override_origin: dict[tuple, str] = {}
    for override in overrides or []:
        key_path = _apply_override(data, override)
        override_origin[key_path] = override
    base_dir = Path(path).resolve().parent if path is not None else Path.cwd()
    if isinstance(data.get("imports"), list):
        data["imports"] = [resolve_entry(e, base_dir) if isinstance(e, str) else e for e in data["imports"]]
    for term in data.get("rewards") or [] if isinstance(data.get("rewards"), list) else []:
        if isinstance(term, dict) and isinstance(term.get("function"), str):
            term["function"] = _function_beside(term["function"], base_dir)
    if schema is None:
        stage = data.get("stage")
        if stage not in RECIPES:
            known = ", ".join(sorted(RECIPES))
            raise ConfigError(f"{source}: 'stage' must be one of {known}; got {stage!r}")
        schema = RECIPES[stage]  # type: ignore[assignment]
    try:
        loaded_recipe = schema.model_validate(data)  # type: ignore[union-attr]
    except ValidationError as error:
        problems = [_describe(item, schema, source, key_lines, override_origin) for item in error.errors()]
        raise ConfigError("; ".join(problems)) from None
    try:
        import_all(getattr(loaded_recipe, "imports", []), base_dir)
    except UserCodeError as error:
        where = f"{source}:{key_lines[('imports',)]}" if ("imports",) in key_lines else source
        raise ConfigError(f"{where}: {error}") from None
    return loaded_recipe


RECIPE_DIR = "${recipe_dir}"


def _function_beside(ref: str, base_dir: Path) -> str:
    """A reward function's `module:function` made absolute when the module is a file beside the recipe, so every
    process (a Ray worker in another directory too) finds the same file."""
    module, sep, name = ref.rpartition(":")
    if not sep or not module:
        return ref  # the schema reports the malformed reference
    if is_file_ref(module):
        return f"{resolve_entry(module, base_dir)}:{name}"
    beside = base_dir / (module.replace(".", "/") + ".py")
    return f"{beside}:{name}" if beside.is_file() else ref


def _with_recipe_dir(value: Any, directory: str) -> Any:
    if isinstance(value, str):
        return value.replace(RECIPE_DIR, directory)
    if isinstance(value, dict):
        return {key: _with_recipe_dir(item, directory) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_recipe_dir(item, directory) for item in value]
    return value


def dump_recipe(config: BaseModel) -> str:
    """The fully resolved recipe as YAML (saved beside every run so it can be re-run as is)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def parse_override(override: str) -> tuple[list[str], Any]:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key.path=value, e.g. optim.lr=3e-4")
    key, raw = override.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {override!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep the string and let the schema judge it
    return parts, value


def _apply_override(data: dict[str, Any], override: str) -> tuple:
    """Set `a.b.c=value` in the raw recipe; a numeric part indexes a list (`domains.0.weight=2`)."""
    parts, value = parse_override(override)
    node: Any = data
    path: list[Any] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                where = ".".join(parts[:i]) or "<recipe>"
                raise ConfigError(f"override {override!r}: {where} is a list of {len(node)}; '{part}' is not an index in it")
            key: Any = int(part)
        elif isinstance(node, dict):
            key = part
        else:
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:i])} is a value, not a section")
        path.append(key)
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]
    return tuple(path)


def _refuse_repeated_keys(node: yaml.Node | None, source: str, prefix: tuple = ()) -> None:
    """A key given twice in one mapping is an error: YAML loaders keep the last silently, so a recipe with
    two `train:` sections would run with the second alone."""
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":  # merge keys may repeat
                if key_node.value in first:
                    dotted = ".".join(str(part) for part in (*prefix, key_node.value))
                    raise ConfigError(f"{source}:{line}: '{dotted}' is given twice (first on line "
                                      f"{first[key_node.value]}); keep one")
                first[key_node.value] = line
            _refuse_repeated_keys(value_node, source, (*prefix, key_node.value))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_repeated_keys(item, source, (*prefix, index))


def _key_lines(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[prefix + (index,)] = item.start_mark.line + 1
            lines.update(_key_lines(item, prefix + (index,)))
    return lines


def _describe(item: dict, schema: type[BaseModel], source: str, key_lines: dict, overrides: dict) -> str:
    loc = tuple(part for part in item["loc"] if not _is_union_tag(part))
    dotted = ".".join(str(p) for p in loc) or "<recipe>"
    where = _where(loc, source, key_lines, overrides)
    if item["type"] == "extra_forbidden":
        hint = _closest_key(schema, loc)
        return f"{where}: unknown key '{dotted}'" + (f" (did you mean '{hint}'?)" if hint else "")
    if item["type"] == "missing":
        return f"{where}: missing required key '{dotted}'"
    expected = _expected(item)
    got = item.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"{where}: {dotted}: {expected}, got {shown}"


def _where(loc: tuple, source: str, key_lines: dict, overrides: dict) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in overrides:
            return f"override '{overrides[loc[:end]]}'"
        if loc[:end] in key_lines:
            return f"{source}:{key_lines[loc[:end]]}"
    return source


def _is_union_tag(part: Any) -> bool:
    # pydantic inserts the member type name into `loc` for unions ('int', 'function-after[...]').
    return isinstance(part, str) and (part in {"int", "float", "str", "bool", "none"} or "[" in part)


_EXPECTED = {
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping (a section)",
    "model_attributes_type": "expected a mapping (a section)",
    "tuple_type": "expected a list",
}


def _expected(item: dict) -> str:
    if item["type"] == "literal_error":
        return "expected one of " + item.get("ctx", {}).get("expected", "?")
    return _EXPECTED.get(item["type"], item["msg"][:1].lower() + item["msg"][1:])


def _closest_key(schema: type[BaseModel], loc: tuple) -> str | None:
    """The valid key closest to the mistyped last part of `loc`, among its siblings first, then anywhere."""
    parent = _model_at(schema, loc[:-1])
    wrong = str(loc[-1])
    prefix = ".".join(str(p) for p in loc[:-1])
    if parent is not None:
        match = difflib.get_close_matches(wrong, list(parent.model_fields), n=1, cutoff=0.6)
        if match:
            return f"{prefix}.{match[0]}" if prefix else match[0]
    everywhere = _all_paths(schema)
    by_leaf = {path.rsplit(".", 1)[-1]: path for path in everywhere}
    match = difflib.get_close_matches(wrong, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[match[0]] if match else None


def _model_at(schema: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = schema
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue  # an index into a list of sections: the element type was already taken
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _section_type(field.annotation)
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, dict, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _section_type(arg)
            if found is not None:
                return found
    return None


def _all_paths(schema: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in schema.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        inner = _section_type(field.annotation)
        if inner is not None and inner is not schema:
            paths.extend(_all_paths(inner, path + "."))
    return paths
