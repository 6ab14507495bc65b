"""Tools, the calculator's parser, tool-call parsing and the workspace."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import pytest

from posttrain.envs import (
    TOOLS,
    CalculatorError,
    EnvError,
    TagJsonParser,
    ToolContext,
    ToolError,
    Workspace,
    WorkspaceError,
    evaluate_expression,
    get_parser,
    get_tool,
    tool,
    tool_schemas,
)
from posttrain.envs.calculator import calculate
from posttrain.sandbox import find_bubblewrap


def bwrap_available() -> bool:
    try:
        find_bubblewrap()
        return True
    except Exception:
        return False


needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not available")


@pytest.mark.parametrize("expression,value", [
    ("4821*397", "1913937"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-2**2", "-4"), ("2**-1", "0.5"),
    ("2**3**2", "512"), ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("-7%3", "2"), ("0.1+0.2", "0.3"),
    ("1/3", "0.3333333333"), ("10/4", "2.5"), (" 12 - -3 ", "15"), ("3×4÷2", "6"), (".5*4", "2"),
])
def test_calculator_values(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize("expression,message", [
    ("", "empty"), ("2+", "ends too early"), ("(1+2", "missing"), ("1+2)", "unexpected '\\)'"),
    ("__import__('os')", "unexpected character"), ("2 ** 99999", "exponent"), ("9**9**9", "exponent"),
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("2**0.5", "integer exponents"),
    ("(" * 60 + "1" + ")" * 60, "nested too deeply"), ("1,000+1", "unexpected character"), ("1" * 600, "longer"),
    ("10**400*10**400*10**400", "digits"),
])
def test_calculator_refuses_bad_or_huge_input_quickly(expression, message):
    started = time.monotonic()
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)
    assert time.monotonic() - started < 0.1


def test_calculator_is_exact():
    assert calculate("1/3*3") == Fraction(1)


def test_tag_parser_reads_calls_in_order_and_keeps_malformed_text():
    parser = get_parser("tool_call_tags")
    turn = parser.parse('Let me see. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
                        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>')
    assert turn.content == "Let me see. "
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    bad = parser.parse('<tool_call>{"name": 3}</tool_call> and <tool_call>{"name": "c"')
    assert [c.error is not None for c in bad.calls] == [True, True]
    assert bad.content == '<tool_call>{"name": 3}</tool_call> and <tool_call>{"name": "c"'
    assert parser.parse("just an answer").calls == []
    assert get_parser("hermes").parse('<tool_call>{"name": "a"}</tool_call>').calls[0].arguments == {}
    custom = TagJsonParser("<function_call>", "</function_call>")
    assert get_parser(custom) is custom and custom.parse('<function_call>{"name": "f"}</function_call>').calls
    with pytest.raises(EnvError, match="unknown tool-call parser"):
        get_parser("xml")


def test_tool_registry_and_schemas():
    assert {"calculator", "list_files", "read_file", "write_file", "run_tests"} <= set(TOOLS)
    [schema] = tool_schemas(["calculator"])
    assert schema["type"] == "function" and schema["function"]["parameters"]["required"] == ["expression"]

    @tool("test_echo", "Echo the text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                          "required": ["text"]})
    async def echo(ctx, text):
        return text * 2

    assert asyncio.run(get_tool("test_echo")(ToolContext(), {"text": "ab"})) == "abab"
    with pytest.raises(ToolError, match="bad arguments"):
        asyncio.run(get_tool("test_echo")(ToolContext(), {"text": 3}))
    with pytest.raises(EnvError, match="unknown tool"):
        get_tool("nope")


def test_file_tools_stay_inside_the_workspace():
    ctx = ToolContext(workspace=Workspace({"src/a.py": "x = 1\n"}))

    def use(name, **arguments):
        return asyncio.run(get_tool(name)(ctx, arguments))

    assert use("list_files") == "src/a.py"
    assert use("read_file", path="./src//a.py") == "x = 1\n"
    assert use("write_file", path="src/b.py", content="y = 2\n") == "wrote 6 bytes to src/b.py"
    assert use("list_files") == "src/a.py\nsrc/b.py"
    for path in ("/etc/passwd", "../secret", "src/../../x", "", "a\x00b"):
        with pytest.raises(ToolError):
            use("read_file", path=path)
        with pytest.raises(ToolError):
            use("write_file", path=path, content="x")
    with pytest.raises(ToolError, match="no such file"):
        use("read_file", path="missing.py")
    small = Workspace(max_files=1, max_file_bytes=10)
    small.write("a", "1")
    with pytest.raises(WorkspaceError, match="too many files"):
        small.write("b", "2")
    with pytest.raises(WorkspaceError, match="too large"):
        small.write("a", "x" * 11)
    # one tree, as on a disk: a sandbox run of a workspace holding "src/a.py" as a file and a directory could not
    # start, and the episode would count as an infrastructure failure instead of being scored
    with pytest.raises(ToolError, match="would be a file and the directory"):
        use("write_file", path="src/a.py/c.py", content="z = 3\n")
    with pytest.raises(ToolError, match="would be a file and the directory"):
        use("write_file", path="src", content="z = 3\n")
    assert use("list_files") == "src/a.py\nsrc/b.py"


def test_long_tool_output_is_capped():
    ctx = ToolContext(workspace=Workspace({"big.txt": "x" * 10_000}))
    text = asyncio.run(get_tool("read_file")(ctx, {"path": "big.txt"}))
    assert len(text) < 4100 and text.endswith("characters cut]")


@needs_bwrap
@pytest.mark.bwrap
def test_run_tests_runs_the_projects_tests_in_the_sandbox():
    files = {
        "calc/__init__.py": "",
        "calc/ops.py": "def double(x):\n    return x + x\n\ndef half(x):\n    return x / 3\n",
        "tests/test_ops.py": "from calc.ops import double, half\n\ndef test_double():\n    assert double(2) == 4\n\n"
                             "def test_half():\n    assert half(4) == 2\n",
    }
    ctx = ToolContext(workspace=Workspace(files))
    report = asyncio.run(get_tool("run_tests")(ctx, {}))
    assert "PASSED tests/test_ops.py::test_double" in report
    assert "FAILED tests/test_ops.py::test_half - AssertionError" in report and report.endswith("1 passed, 1 failed")
    ctx.workspace.write("calc/ops.py", "import time\ndef double(x):\n    time.sleep(60)\n\ndef half(x):\n    pass\n")
    ctx.options["test_timeout_s"] = 1.0
    with pytest.raises(ToolError, match="did not finish"):
        asyncio.run(get_tool("run_tests")(ctx, {}))
    # What the tests see is the jail, not the host: no network, no project tree.
    ctx.workspace.write("tests/test_ops.py", "import os, socket\n\ndef test_jail():\n"
                                             "    assert not os.path.exists(os.path.expanduser('~/.bashrc'))\n"
                                             "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n")
    ctx.options["test_timeout_s"] = 10.0
    report = asyncio.run(get_tool("run_tests")(ctx, {}))
    assert "FAILED tests/test_ops.py::test_jail - OSError" in report or "ERROR" in report
