"""A single-turn verifiers environment, written as verifiers' docs show ("Your First Environment"):
a dataset of prompts and answers, an async reward function, a Rubric, a SingleTurnEnv."""

import verifiers as vf
from datasets import Dataset


def load_environment(copies: int = 4):
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
        {"prompt": [{"role": "user", "content": "What is 3*5?"}], "answer": "15"},
    ]
    dataset = Dataset.from_list(rows * copies)
    eval_dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "What is 7-2?"}], "answer": "5"}]
    )

    async def correct_answer(completion, answer) -> float:
        response = completion[-1]["content"]
        return 1.0 if answer in response else 0.0

    def short(completion) -> float:
        return float(len(completion[-1]["content"]) < 40)

    rubric = vf.Rubric(funcs=[correct_answer, short], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, rubric=rubric)
