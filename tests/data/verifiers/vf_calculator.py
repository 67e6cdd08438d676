"""A multi-turn tool environment, written as verifiers' docs show ("Tool Environments"): a typed,
documented Python function as the tool, a ToolEnv with max_turns, and a Rubric."""

import verifiers as vf
from datasets import Dataset


async def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum, as text.
    """
    return str(a + b)


def load_environment(max_turns: int = 3):
    dataset = Dataset.from_list(
        [
            {"question": "What is 56 + 55? Use the add tool.", "answer": "111"},
            {"question": "What is 12 + 30? Use the add tool.", "answer": "42"},
        ]
    )

    async def correct_answer(completion, answer) -> float:
        return 1.0 if answer in (completion[-1]["content"] or "") else 0.0

    return vf.ToolEnv(
        dataset=dataset,
        tools=[add],
        max_turns=max_turns,
        system_prompt="Use the add tool, then answer with the number.",
        rubric=vf.Rubric(funcs=[correct_answer]),
    )
