import asyncio

import pytest

from agentgrpo.tool import Tool, ToolError, tool


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second
            term, wrapped
    """
    return a + b


def test_schema_comes_from_signature_and_docstring():
    fn = add.schema["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two integers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first term"}
    assert props["b"]["default"] == 2 and props["b"]["description"] == "the second term, wrapped"
    assert fn["parameters"]["required"] == ["a"]
    assert fn["parameters"]["additionalProperties"] is False


def test_call_validates_and_renders():
    assert asyncio.run(add.acall({"a": 1})) == "3"
    assert asyncio.run(add.acall({"a": "4", "b": 1})) == "5"  # pydantic's lax int parsing


@pytest.mark.parametrize("args, needle", [
    ({}, "a: Field required"),
    ({"a": "x"}, "a: Input should be a valid integer"),
    ({"a": 1, "c": 3}, "c: Extra inputs are not permitted"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_arguments_name_the_problem(args, needle):
    with pytest.raises(ToolError, match=needle):
        asyncio.run(add.acall(args))


def test_tool_exception_becomes_tool_error():
    @tool
    def boom(x: int) -> int:
        """Always fails."""
        return 1 // 0

    with pytest.raises(ToolError, match="boom raised ZeroDivisionError"):
        asyncio.run(boom.acall({"x": 1}))


def test_async_tool_and_method_binding():
    class Holder:
        base = 10

        @tool
        async def plus(self, x: int) -> dict:
            """Add the base."""
            return {"value": self.base + x}

    h = Holder()
    assert isinstance(Holder.plus, Tool)
    assert "self" not in h.plus.schema["function"]["parameters"]["properties"]
    assert asyncio.run(h.plus.acall({"x": 1})) == '{"value": 11}'


def test_definition_errors_are_loud():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="needs a description"):
        tool(undocumented)
    with pytest.raises(TypeError, match="needs a type annotation"):
        @tool
        def f(x):
            """Doc."""
    with pytest.raises(ValueError, match="tool name"):
        tool(name="bad name!")(add.fn)
