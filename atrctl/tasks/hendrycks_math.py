r"""MATH (Hendrycks et al.): competition problems whose answer is the last \boxed{...} of the solution."""

from atrctl.tasks.answer import last_boxed
from atrctl.tasks.data import dataset_format, load_problems
from atrctl.tasks.mathcheck import score_latex
from atrctl.tasks.problem import Problem, Score, check_request
from atrctl.tasks.split import stable_hash, take

FIELDS = ("problem", "solution")


class MathTask:
    r"""path: hub name or local .json/.jsonl/.parquet with problem/solution rows (an `answer` field, as in
    MATH-500, is used when present); config: hub config; test_path: optional separate local test file;
    format: compact (the problem and a newline) or instruct (the problem, and an instruction to box the answer).

    A completion's answer is found by `atrctl.tasks.answer` (last \boxed{}, "####", "answer is", the last
    line) and compared with math-verify, so 0.5 matches \frac{1}{2}.
    """

    name = "math"

    def __init__(
        self,
        path: str = "DigitalLearningGmbH/MATH-lighteval",
        config: str | None = None,
        test_path: str | None = None,
        format: str = "compact",
    ):
        self.format = format
        self.instruction, suffix = dataset_format(self.name, format)
        self._problems = load_problems(self.name, path, config, test_path, FIELDS, lambda row: to_problem(row, suffix))

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        return take(self._problems[split], n, seed, f"math {split} problems")

    def score(self, problem: Problem, completion: str) -> Score:
        return score_latex(problem.answer, completion)


def to_problem(row: dict, suffix: str) -> Problem | None:
    statement, solution = str(row["problem"]), str(row["solution"])
    answer = row.get("answer") or last_boxed(solution)
    if not answer:
        return None
    return Problem(
        id=f"math-{stable_hash(statement):016x}", prompt=statement + suffix, answer=str(answer), solution=solution
    )
