"""A calculator tool: exact arithmetic on integers and decimals, without `eval`.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary signs and parentheses
are evaluated; exponents and results are bounded so a model cannot make the trainer compute
10**10**10.

Numbers are exact: a decimal literal is read from its text (`0.1` is 1/10, `1e-5` is 1/100000, not
the nearest float), and every number written or computed has at most `MAX_DIGITS` digits in its
numerator and denominator, so `1e999` and `1e-400` are refused rather than read as infinity or 0.
Whatever cannot be computed (too many digits, division by zero, `0**-1`, a name or call) raises
`ToolError` with the reason, which the model is shown.
"""

from __future__ import annotations

import ast
import operator
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from agentgrpo.env.tool import ToolError, tool

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 60


def _bounded(x: Fraction, what: str) -> Fraction:
    if len(str(abs(x.numerator))) > MAX_DIGITS or len(str(x.denominator)) > MAX_DIGITS:
        raise ToolError(f"{what} has more than {MAX_DIGITS} digits")
    return x


def _number(node: ast.Constant, source: str) -> Fraction:
    """A literal, exactly: an int as it is, a decimal from its text (not the float Python made)."""
    text = ast.get_source_segment(source, node) or repr(node.value)
    shown = repr(text) if len(text) <= 24 else repr(f"{text[:20]}...")
    if isinstance(node.value, int):
        return _bounded(Fraction(node.value), f"number {shown}")
    try:
        d = Decimal(text)
    except InvalidOperation:
        d = Decimal(repr(node.value))
    if not d.is_finite():
        raise ToolError(f"number {shown} is not finite")
    # checked before Fraction(d) builds 10**exponent: `1e999999999` must cost nothing
    if d and (abs(d.adjusted()) > MAX_DIGITS or len(d.as_tuple().digits) > 2 * MAX_DIGITS):
        raise ToolError(f"number {shown} has more than {MAX_DIGITS} digits")
    return _bounded(Fraction(d), f"number {shown}")


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raise ToolError with a reason on anything else
    (see the module docstring)."""
    if len(expression) > 500:
        raise ToolError("expression too long (over 500 characters)")
    source = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return _number(node, source)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 64:
                    raise ToolError("exponents must be integers between -64 and 64")
                if left == 0 and right < 0:
                    raise ToolError("division by zero (0 to a negative power)")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ToolError("division by zero")
            try:
                out = Fraction(_BINOPS[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            return _bounded(out, "result")
        raise ToolError(
            f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}"
        )

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
