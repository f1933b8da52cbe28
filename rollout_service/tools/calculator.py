"""The ``calculator`` tool: arithmetic on numbers, never Python.

Design: the expression is parsed with ``ast`` and walked by a tiny interpreter that knows only
number literals, + - * / // % **, unary +/-, and calls of whitelisted ``math`` functions and names
of constants. Anything else (attribute access, other names, subscripts, lambdas, strings) is
refused, so nothing the model writes can reach Python objects. Integer arithmetic is unbounded in
Python, so every result's size is checked *before* computing it (exponent and bit-length caps,
factorial/comb arguments), which keeps ``9**9**9`` from eating the CPU and memory.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rollout_service.tools.base import TOOLS, ToolContext, ToolResult, function_schema, invalid_args

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 10_000  # about 3000 decimal digits
MAX_EXPONENT = 10_000
MAX_FACTORIAL_ARG = 1000

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the text is shown to the model."""


def _check_size(x: Number) -> Number:
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    return x


def _int_arg(x: Number, limit: int, fname: str) -> int:
    if isinstance(x, float):
        if not x.is_integer():
            raise CalculatorError(f"{fname}() needs integers")
        x = int(x)
    if abs(x) > limit:
        raise CalculatorError(f"{fname}() argument too large (limit {limit})")
    return x


def _pow(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and abs(a) > 1:
        # Exact integer powers grow without bound: estimate the size first.
        if abs(b) > MAX_EXPONENT or a.bit_length() * abs(b) > MAX_INT_BITS:
            raise CalculatorError("power too large")
    result = operator.pow(a, b)
    if isinstance(result, complex):
        raise CalculatorError("result is complex (negative number to a fractional power)")
    return result


def _mul(a: Number, b: Number) -> Number:
    if (
        isinstance(a, int)
        and isinstance(b, int)
        and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1
    ):
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    return a * b


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _pow,
}

_UNARYOPS: dict[type[ast.unaryop], Callable[[Any], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}

_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}


def _abs(x: Number) -> Number:
    return abs(x)


def _log(x: Number, base: Number | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    **{
        name: getattr(math, name)
        for name in (
            "sqrt",
            "cbrt",
            "exp",
            "log10",
            "log2",
            "sin",
            "cos",
            "tan",
            "asin",
            "acos",
            "atan",
            "atan2",
            "sinh",
            "cosh",
            "tanh",
            "asinh",
            "acosh",
            "atanh",
            "floor",
            "ceil",
            "trunc",
            "hypot",
            "degrees",
            "radians",
            "gcd",
            "lcm",
            "isqrt",
            "fabs",
        )
        if hasattr(math, name)
    },
    "log": _log,
    "ln": math.log,
    "abs": _abs,
    "round": round,
    "min": min,
    "max": max,
    "factorial": lambda n: math.factorial(_int_arg(n, MAX_FACTORIAL_ARG, "factorial")),
    "comb": lambda n, k: math.comb(
        _int_arg(n, MAX_INT_BITS, "comb"), _int_arg(k, MAX_INT_BITS, "comb")
    ),
    "perm": lambda n, k: math.perm(
        _int_arg(n, MAX_FACTORIAL_ARG, "perm"), _int_arg(k, MAX_FACTORIAL_ARG, "perm")
    ),
}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _check_size(_BINOPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        return _UNARYOPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}; constants: {', '.join(_CONSTANTS)}")
    if isinstance(node, ast.Call):
        return _call(node)
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _call(node: ast.Call) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
        what = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
        raise CalculatorError(
            f"unknown function {what!r}; functions: {', '.join(sorted(_FUNCTIONS))}"
        )
    if node.keywords:
        raise CalculatorError("keyword arguments are not supported")
    args = [_eval(arg) for arg in node.args]
    return _check_size(_FUNCTIONS[node.func.id](*args))


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression; raise CalculatorError with a readable message."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    # Accept the usual ways of writing a power and a product that are not Python.
    expression = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _eval(tree)
    except CalculatorError:
        raise
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"{type(e).__name__}: {e}") from None


def format_number(x: Number) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))  # 4.0 -> "4": what a person would write
    return repr(x)


class Calculator:
    name = "calculator"

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            (
                "Evaluate an arithmetic expression: numbers, + - * / // % ** (or ^), parentheses, "
                "constants pi e tau, and functions such as sqrt, log, exp, sin, factorial, comb."
            ),
            {"expression": {"type": "string", "description": "e.g. (3 + 4) * sqrt(2) / 7"}},
            ["expression"],
        )

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if bad := invalid_args(self, args):
            return bad
        try:
            return ToolResult(text=format_number(evaluate(args["expression"])))
        except CalculatorError as e:
            return ToolResult(text=f"Error: {e}", ok=False)


@TOOLS.register("calculator")
def make_calculator(**options: Any) -> Calculator:
    if options:
        raise TypeError(f"calculator takes no options, got {sorted(options)}")
    return Calculator()
