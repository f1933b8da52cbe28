"""Our calculator as a verl function tool (``rollout.multi_turn.function_tool_path``).

The schema verl shows the model must be ours byte for byte: the warmed model learnt the prompt that
the tool agent renders (``Calculator.schema``, with ``additionalProperties: false``). verl's pydantic
schema classes drop that key when they dump the schema, so the registered tool gets a schema object
whose dump is exactly our dict (verl only reads ``model_dump`` and ``function.name`` from it). The
call runs our own evaluator, so the tool outputs are the same text on both sides.
"""

from __future__ import annotations

import copy
from typing import Any

from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY, function_tool
from verl.tools.schemas import OpenAIFunctionToolSchema

from rollout_service.tools.calculator import Calculator, CalculatorError, evaluate, format_number

_SCHEMA: dict[str, Any] = Calculator().schema


class _ExactSchema(OpenAIFunctionToolSchema):
    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(_SCHEMA)


def calculate(expression: str) -> str:
    """What our calculator answers for ``expression`` (its error text on a bad one)."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


function_tool("calculator", schema=_SCHEMA)(calculate)
FUNCTION_TOOL_REGISTRY["calculator"].tool_schema = _ExactSchema.model_validate(_SCHEMA)
