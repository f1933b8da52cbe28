"""Built-in tools: calculator safety and correctness, the sandboxed python tool, answer tools,
argument validation and registration."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from rollout_service.tools import TOOLS, ToolContext, check_args, load_builtin_tools
from rollout_service.tools.calculator import CalculatorError, evaluate
from rollout_service.tools.python_exec import truncate_middle

CTX = ToolContext(episode_id="ep-test")


def test_builtin_tools_are_registered_with_valid_schemas() -> None:
    assert {"calculator", "python", "finish", "answer"} <= set(load_builtin_tools().names())
    for name in ("calculator", "python", "finish", "answer"):
        tool = TOOLS.get(name)()
        fn = tool.schema["function"]
        assert tool.schema["type"] == "function" and fn["name"] == name == tool.name
        assert fn["description"] and fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])


def test_factories_reject_unknown_options() -> None:
    with pytest.raises(TypeError, match="bogus"):
        TOOLS.get("python")(bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        TOOLS.get("calculator")(bogus=1)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("2 ^ 10", 1024),
        ("2 ** -1", 0.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("-(3 - 5)", 2),
        ("1 / 4", 0.25),
        ("sqrt(16) + log(8, 2)", 7.0),
        ("sin(pi / 2)", 1.0),
        ("factorial(5) / comb(5, 2)", 12.0),
        ("max(1, 7, 3) - abs(-2)", 5),
        ("2 ** 100", 2**100),
    ],
)
def test_calculator_evaluates(expr: str, value: float) -> None:
    assert math.isclose(evaluate(expr), value)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 100000", "too large"),
        ("(2 ** 9000) * (2 ** 9000)", "too large"),
        ("factorial(100000)", "too large"),
        ("10.0 ** 400", "Overflow"),
        ("1 / 0", "division by zero"),
        ("(1).__class__", "Attribute"),
        ("__import__('os').system('true')", "unknown function"),
        ("open('/etc/passwd')", "unknown function"),
        ("x + 1", "unknown name"),
        ("'a' * 3", "only numbers"),
        ("[1, 2][0]", "unsupported"),
        ("lambda: 1", "unsupported"),
        ("True + 1", "only numbers"),
        ("round(2.5, ndigits=1)", "keyword"),
        ("2 +", "syntax"),
        ("1" * 2000, "longer than"),
        ("(-8) ** 0.5", "complex"),
    ],
)
def test_calculator_refuses(expr: str, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=message):
        evaluate(expr)
    assert time.monotonic() - start < 1.0  # refused before doing the huge work


@pytest.mark.anyio
async def test_calculator_tool_results() -> None:
    calc = TOOLS.get("calculator")()
    ok = await calc.call({"expression": "6 * 7"}, CTX)
    assert ok.ok and ok.text == "42" and not ok.terminal
    bad = await calc.call({"expression": "9**9**9"}, CTX)
    assert not bad.ok and bad.text.startswith("Error:")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "missing required argument 'expression'"),
        ({"expression": 3}, "argument 'expression' must be of type string"),
        ({"expression": "1", "extra": 1}, "unexpected argument 'extra'"),
    ],
)
async def test_calculator_argument_validation(args: dict[str, Any], message: str) -> None:
    res = await TOOLS.get("calculator")().call(args, CTX)
    assert not res.ok and message in res.text


def test_check_args_types() -> None:
    params = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": ["string", "number"]}},
        "required": ["n"],
    }
    assert check_args(params, {"n": 1, "x": 2.5}) is None
    assert check_args(params, {"n": 1, "x": "a", "other": 1}) is None  # extra allowed by default
    assert "'n' must be of type integer" in (check_args(params, {"n": True}) or "")
    assert "'n' must be of type integer" in (check_args(params, {"n": 1.5}) or "")
    assert "'x' must be of type string or number" in (check_args(params, {"n": 1, "x": None}) or "")
    assert "JSON object" in (check_args(params, ["n"]) or "")


@pytest.mark.anyio
@pytest.mark.integration
async def test_python_tool_runs_code() -> None:
    tool = TOOLS.get("python")(timeout_s=5.0)
    res = await tool.call(
        {"code": "import sys; print(sum(range(10)), sys.stdin.read())", "stdin": "in"}, CTX
    )
    assert res.ok and res.text == "45 in"


@pytest.mark.anyio
@pytest.mark.integration
async def test_python_tool_reports_errors_readably() -> None:
    tool = TOOLS.get("python")(timeout_s=1.0)
    crash = await tool.call({"code": "1 / 0"}, CTX)
    assert not crash.ok
    assert "ZeroDivisionError" in crash.text and "exited with status 1" in crash.text
    slow = await tool.call({"code": "while True: pass"}, CTX)
    assert not slow.ok and "timed out after 1 s" in slow.text
    missing = await tool.call({"source": "print(1)"}, CTX)
    assert not missing.ok and "'code'" in missing.text


@pytest.mark.anyio
@pytest.mark.integration
async def test_python_tool_truncates_long_output_keeping_the_tail() -> None:
    tool = TOOLS.get("python")(max_output_chars=200)
    res = await tool.call({"code": "for i in range(1000): print(i)\nprint('LAST')"}, CTX)
    assert res.ok and len(res.text) <= 200
    assert (
        res.text.startswith("0\n1\n") and res.text.endswith("LAST") and "characters cut" in res.text
    )


def test_truncate_middle() -> None:
    assert truncate_middle("short", 10) == "short"
    cut = truncate_middle("a" * 50 + "b" * 50, 60)
    assert len(cut) <= 60 and cut.startswith("a") and cut.endswith("b")


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["finish", "answer"])
async def test_answer_tools_end_the_episode(name: str) -> None:
    tool = TOOLS.get(name)()
    res = await tool.call({"answer": "\\frac{1}{2}"}, CTX)
    assert res.ok and res.terminal and res.answer == "\\frac{1}{2}"
    num = await tool.call({"answer": 42}, CTX)
    assert num.terminal and num.answer == "42"
    bad = await tool.call({"answer": ["x"]}, CTX)
    assert not bad.ok and not bad.terminal and "'answer'" in bad.text
    missing = await tool.call({}, CTX)
    assert not missing.ok and "missing required argument 'answer'" in missing.text
