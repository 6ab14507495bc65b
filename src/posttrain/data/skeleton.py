"""Chat-template skeletons: render a conversation shape once, then fill in the contents.

Tokenizing a dataset renders the chat template twice per assistant turn (`posttrain.data.tokenize`), and
``apply_chat_template`` costs ~3 ms a call on a loaded machine: more than half of a streaming pass. Most rows
share a few shapes (the roles in order, with or without the generation prompt, the same tools), and most
templates paste each message's content verbatim. For such a shape the template is rendered once with a
placeholder for each content; the text between the placeholders is the skeleton, and a conversation of that
shape renders as the skeleton with its contents put back, with no template call.

That is exact only when the template never looks *into* a content. It is used when all of these hold, and
otherwise the template is called as before:

* the template, read as a Jinja syntax tree, uses a message's ``content`` only as output (``{{ m.content }}``,
  alone or joined with ``+`` / ``~``), in a truthiness test (``{% if m.content %}``: the fast path then takes
  only non-empty contents) or in a ``string`` / ``none`` / ``defined`` test. A template that trims, splits,
  searches, assigns or serializes a content (Qwen3's ``</think>`` split, Llama 3's ``| trim``), or passes a
  message (or ``messages``) to a filter or call other than ``length``, never takes the fast path;
* every message has only ``role`` and a non-empty string ``content`` (tool calls, names, list-of-parts content
  go to the template);
* the placeholders come back each exactly once and in order, and the first conversation of each shape renders
  the same both ways (checked with one template call; a shape that differs is never filled in again).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

from jinja2 import Environment, nodes

from posttrain.types import Message

_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: no template writes them
_SAFE_TESTS = {"string", "none", "defined", "undefined"}
_SHAPE_FILTERS = {"length", "count"}  # filters of a message list that depend on its shape only
_STILL_A_MESSAGE = {"previtem", "nextitem"}  # loop.previtem in a loop over messages
_CAPTURING = (nodes.AssignBlock, nodes.FilterBlock, nodes.Macro, nodes.CallBlock)


class Skeletons:
    """The skeletons of one tokenizer's template, by shape; `render` returns None where the template must be called."""

    def __init__(self, template: Any, render_slow: Callable[[Sequence[Message], bool, Any], str]):
        self.enabled = isinstance(template, str) and content_is_opaque(template)
        self.render_slow = render_slow
        self.shapes: dict[tuple, list[str] | None] = {}

    def render(self, messages: Sequence[Message], generation_prompt: bool, tools: Any, tools_key: Any) -> str | None:
        if not self.enabled or not all(_plain(m) for m in messages):
            return None
        key = (generation_prompt, tools_key, *(m["role"] for m in messages))
        if key in self.shapes:
            pieces = self.shapes[key]
            return None if pieces is None else _fill(pieces, messages)
        pieces = self._skeleton(messages, generation_prompt, tools)
        text = self.render_slow(messages, generation_prompt, tools)
        self.shapes[key] = pieces if pieces is not None and _fill(pieces, messages) == text else None
        return text

    def _skeleton(self, messages: Sequence[Message], generation_prompt: bool, tools: Any) -> list[str] | None:
        marked = [{"role": m["role"], "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        try:
            text = self.render_slow(marked, generation_prompt, tools)
        except Exception:  # noqa: BLE001 - the template may refuse placeholders; the real call reports errors
            return None
        pieces, rest = [], text
        for i in range(len(messages)):
            head, found, rest = rest.partition(_PLACEHOLDER.format(i))
            if not found or "\ue000" in head:
                return None
            pieces.append(head)
        if "\ue000" in rest:
            return None
        return [*pieces, rest]


def _plain(message: Message) -> bool:
    content = message.get("content")
    return isinstance(content, str) and content != "" and isinstance(message.get("role"), str) and len(message) == 2


def _fill(pieces: list[str], messages: Sequence[Message]) -> str:
    parts = [pieces[0]]
    for message, piece in zip(messages, pieces[1:]):
        parts.append(message["content"])
        parts.append(piece)
    return "".join(parts)


@lru_cache(maxsize=64)
def content_is_opaque(template: str) -> bool:
    """Whether `template` only pastes, or tests the truthiness or type of, a message's content (see the module
    docstring); a template Jinja cannot parse is not."""
    try:
        tree = Environment().parse(template)
    except Exception:  # noqa: BLE001 - a template error is reported by the real call
        return False
    derived = _message_names(tree)
    return all(_use_is_safe(path) for path in _name_paths(tree, derived))


def _mentions(node: nodes.Node, names: set[str]) -> bool:
    return any(isinstance(n, nodes.Name) and n.name in names for n in [node, *node.find_all(nodes.Name)])


def _message_names(tree: nodes.Template) -> set[str]:
    """`messages` and every variable assigned or looped from it (to a fixed point)."""
    names = {"messages", "loop"}  # loop: loop.previtem / loop.nextitem are messages
    while True:
        before = len(names)
        for loop in tree.find_all(nodes.For):
            if _mentions(loop.iter, names):
                names |= {n.name for n in [loop.target, *loop.target.find_all(nodes.Name)] if isinstance(n, nodes.Name)}
        for assign in tree.find_all(nodes.Assign):
            if _mentions(assign.node, names) and isinstance(assign.target, nodes.Name):
                names.add(assign.target.name)
        if len(names) == before:
            return names


def _name_paths(tree: nodes.Node, names: set[str]) -> list[list[nodes.Node]]:
    """For every load of a message-derived name: the nodes from it up to the root (innermost first)."""
    paths: list[list[nodes.Node]] = []

    def walk(node: nodes.Node, ancestors: list[nodes.Node]) -> None:
        if isinstance(node, nodes.Name) and node.name in names and node.ctx == "load":
            paths.append([node, *reversed(ancestors)])
        for child in node.iter_child_nodes():
            walk(child, [*ancestors, node])

    walk(tree, [])
    return paths


def _key(node: nodes.Node, parent: nodes.Node) -> tuple[bool, str | None]:
    """(parent reads one field of node, which field: None when it is not a constant)."""
    if isinstance(parent, nodes.Getattr) and parent.node is node:
        return True, parent.attr
    if isinstance(parent, nodes.Getitem) and parent.node is node:
        return True, parent.arg.value if isinstance(parent.arg, nodes.Const) else None
    return False, None


def _use_is_safe(path: list[nodes.Node]) -> bool:
    index = 0
    while index + 1 < len(path):
        node, parent = path[index], path[index + 1]
        is_read, field = _key(node, parent)
        call = path[index + 2] if index + 2 < len(path) else None
        if is_read and isinstance(call, nodes.Call) and call.node is parent:  # a method of the message
            if field != "get":
                return False  # items(), values(), ...: may read the content
            field = call.args[0].value if call.args and isinstance(call.args[0], nodes.Const) else None
            index, parent = index + 1, call  # m.get('role') reads as m['role']
        if is_read and field in _STILL_A_MESSAGE:
            index += 1
            continue
        if is_read and isinstance(field, str) and field != "content":
            return True  # role, tool_calls, ...: part of the shape (the fast path takes role + content only)
        if is_read and field == "content":
            return _content_use_is_safe(path[index + 2:], parent)
        branch = isinstance(parent, nodes.CondExpr) and parent.test is not node
        if is_read or branch or isinstance(parent, nodes.Slice):
            index += 1  # messages[0], messages[1:], m[i], `a if c else m`: still a message or a list of them
            continue
        if isinstance(parent, nodes.Assign):
            return isinstance(parent.target, nodes.Name)  # `set ns.x = message` would hide it from the check
        if isinstance(parent, (nodes.For, nodes.Test)) or (
                isinstance(parent, nodes.Filter) and parent.name in _SHAPE_FILTERS):
            return True
        if isinstance(parent, (nodes.If, nodes.CondExpr)) and parent.test is node:
            return True  # the truthiness of a message or of the list: the same in both renderings
        if isinstance(parent, nodes.Not):
            return True
        if isinstance(parent, (nodes.And, nodes.Or)):
            if _in_test(path[index + 1:], parent):
                return True
            index += 1  # `call.function or call`: the value may be the message itself
            continue
        return False
    return True


def _content_use_is_safe(above: list[nodes.Node], content: nodes.Node) -> bool:
    node = content
    for parent in above:
        if isinstance(parent, (nodes.Add, nodes.Concat)):
            node = parent
            continue
        if isinstance(parent, nodes.Output):  # pasted, unless the output is captured or filtered as a block
            return not any(isinstance(n, _CAPTURING) for n in above)
        if isinstance(parent, nodes.Test):
            return node is content and parent.name in _SAFE_TESTS
        if isinstance(parent, (nodes.If, nodes.CondExpr)):
            return node is content and parent.test is content
        if isinstance(parent, (nodes.And, nodes.Or, nodes.Not)) and node is content:
            return _in_test(above[above.index(parent):], parent)
        return False
    return False


def _in_test(above: list[nodes.Node], node: nodes.Node) -> bool:
    """Whether `node` (under `above`) is only ever read for its truth value: in and/or/not up to an if's test."""
    for parent in above[1:]:
        if isinstance(parent, (nodes.And, nodes.Or, nodes.Not)):
            node = parent
            continue
        return isinstance(parent, (nodes.If, nodes.CondExpr)) and parent.test is node
    return False
