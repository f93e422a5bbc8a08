"""GSM8K: grade-school word problems whose answer is the number after "####" in the worked solution."""

from atrctl.tasks.data import load_problems
from atrctl.tasks.mathcheck import extract, final_number, matches
from atrctl.tasks.problem import Problem, Score, check_request
from atrctl.tasks.split import stable_hash, take

FIELDS = ("question", "answer")


class GSM8KTask:
    """path: hub name or local .json/.jsonl/.parquet with question/answer rows; config: hub config;
    test_path: optional separate local test file (else one file is split 90/10 by a hash of the question).

    Prompt: the question and a newline. A completion's answer is the number after its last "####", else its
    last number; it is compared with math-verify.
    """

    name = "gsm8k"

    def __init__(self, path: str = "openai/gsm8k", config: str | None = "main", test_path: str | None = None):
        self._problems = load_problems(self.name, path, config, test_path, FIELDS, _problem)

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        return take(self._problems[split], n, seed, f"gsm8k {split} problems")

    def score(self, problem: Problem, completion: str) -> Score:
        parsed = final_number(completion)
        if parsed is None:
            return Score(0.0, None)
        return Score(float(matches(problem.answer, extract(parsed))), parsed)


def _problem(row: dict) -> Problem | None:
    question, worked = str(row["question"]), str(row["answer"])
    answer = final_number(worked.rpartition("####")[2]) if "####" in worked else None
    if answer is None:
        return None
    return Problem(id=f"gsm8k-{stable_hash(question):016x}", prompt=f"{question}\n", answer=answer, solution=worked)
