"""The built-in `calculator` tool: arithmetic on numbers (+ - * / // % ** and parentheses), nothing else.

The expression is parsed with Python's `ast` and evaluated node by node over int and float only: no names,
calls or attributes, so nothing a model writes can run code. Sizes are bounded (exponents, digits) so that
`9**9**9` is an error, not a hang; every result is a finite int or float (`(-1)**0.5`, complex in Python,
and anything that overflows to inf are errors).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

_MAX_DIGITS = 64
_MAX_EXPONENT = 256
_MAX_LENGTH = 512
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result is out of bounds."""


def _check(value: object) -> int | float:
    """`value` when it is a finite int or float in bounds; a negative base to a fractional power gives a
    complex number in Python, which is not a calculator result."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"result is not a real number ({type(value).__name__})")
    if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
        raise CalculatorError(f"result has more than {_MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("result is too large") from exc
    raise CalculatorError(f"not arithmetic: {ast.unparse(node) if hasattr(ast, 'unparse') else node}")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text: integers exactly, floats with up to 12 significant
    digits, an integral float without its ".0" ("7", not "7.0"). CalculatorError when it is not arithmetic."""
    if len(expression) > _MAX_LENGTH:
        raise CalculatorError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}") from exc
    value = _eval(tree)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class Calculator:
    """Tool `calculator(expression)`: evaluates plain arithmetic."""

    name = "calculator"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*34+5"}},
                "required": ["expression"],
            },
        },
    }

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise CalculatorError("argument `expression` (a string) is missing")
        return evaluate(expression)
