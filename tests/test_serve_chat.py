"""`posttrain chat`: the terminal loop driven through its streams, and the command through a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from posttrain.serve import load_engine
from posttrain.serve.chat import ChatSettings, run_chat
from serve_support import ANSWER, QUESTION, train_tool_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    return train_tool_model(tiny_tokenizer, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    return load_engine(checkpoint, precision="fp32", num_threads=1)


class _Recorder(io.StringIO):
    """stdout that remembers each write: streaming means many writes per answer."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def _chat(engine, lines: list[str], **settings) -> tuple[str, _Recorder, ChatSettings]:
    out = _Recorder()
    chosen = ChatSettings(temperature=0, **settings)
    run_chat(engine, chosen, io.StringIO("".join(line + "\n" for line in lines)), out)
    return out.getvalue(), out, chosen


def test_streams_an_answer_and_keeps_the_history(engine):
    text, out, _ = _chat(engine, ["Say hello.", "/show", "/reset", "/show", "/quit"])
    assert "assistant> Hello there, friend." in text
    answer_writes = out.writes[out.writes.index("assistant> ") + 1:]
    assert len([w for w in answer_writes[:8] if w.strip()]) >= 3  # token by token, not one block
    shows = [line for line in text.splitlines() if "history=" in line]
    assert "history=2 messages" in shows[0] and "history=0 messages" in shows[1]


def test_shows_a_tool_call_runs_it_and_the_model_answers(engine):
    text, _, _ = _chat(engine, [QUESTION], tools=["calculator"])
    assert '[tool call] calculator({"expression": "2+3"})' in text
    assert "[tool result] 5" in text
    assert ANSWER in text.split("[tool result] 5")[1]


def test_system_prompt_and_sampling_settings(engine):
    text, _, settings = _chat(engine, ["/system Be brief.", "/set temperature 0.5", "/set top_p 2",
                                       "/set max_tokens 3", "/set seed 4", "Say hello.", "/show"])
    assert settings.system == "Be brief." and settings.temperature == 0.5 and settings.max_tokens == 3
    assert settings.seed == 4 and settings.top_p == 1.0
    assert "[/set top_p: must be in (0, 1]]" in text
    assert "system='Be brief.'" in text
    answer = text.split("assistant> ")[1].split("\n")[0]
    assert len(engine.tokenizer.encode(answer, add_special_tokens=False)) <= 3


def test_a_prompt_too_long_is_an_error_line_not_a_crash(engine):
    text, _, _ = _chat(engine, ["x " * 3000, "Say hello."])
    assert "[error]" in text and "context" in text
    assert "Hello there, friend." in text  # the session goes on


def test_a_line_that_is_not_utf8_is_an_error_line_not_a_crash(engine):
    # a terminal's stray byte reaches Python as a lone surrogate (surrogateescape), which no tokenizer encodes
    text, _, _ = _chat(engine, ["hi \udcff there", "/system \udcff", "Say hello.", "/show"])
    assert text.count("[error] that line is not valid UTF-8 text") == 2
    assert "Hello there, friend." in text and "history=2 messages" in text and "system=None" in text


@pytest.mark.slow
def test_the_chat_command_over_a_pipe(checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "chat", str(checkpoint), "--temperature", "0", "--precision", "fp32",
         "--threads", "1"],
        input="Say hello.\n/quit\n", capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "assistant> Hello there, friend." in result.stdout
