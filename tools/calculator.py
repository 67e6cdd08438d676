"""A calculator tool: exact arithmetic on integers and decimals, without `eval`.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary signs and parentheses
are evaluated; exponents and results are bounded so a model cannot make the trainer compute
10**10**10.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from agentgrpo.tool import ToolError, tool

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 60


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raise ToolError with a reason on anything else."""
    if len(expression) > 500:
        raise ToolError("expression too long (over 500 characters)")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 64:
                    raise ToolError("exponents must be integers between -64 and 64")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ToolError("division by zero")
            out = _BINOPS[type(node.op)](left, right)
            out = Fraction(out)
            if len(str(abs(out.numerator))) > MAX_DIGITS or len(str(out.denominator)) > MAX_DIGITS:
                raise ToolError(f"result has more than {MAX_DIGITS} digits")
            return out
        raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")

    return ev(tree)


def format_number(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.10g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(12+7)*3"
    """
    return format_number(evaluate(expression))
