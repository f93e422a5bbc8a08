"""GSM8K: grade-school word problems whose answer is the number after "####" in the worked solution."""

from atrctl.tasks.answer import Found, answer_number
from atrctl.tasks.data import dataset_format, load_problems
from atrctl.tasks.mathcheck import score_number
from atrctl.tasks.problem import Problem, Score, check_request
from atrctl.tasks.split import stable_hash, take

FIELDS = ("question", "answer")


class GSM8KTask:
    """path: hub name or local .json/.jsonl/.parquet with question/answer rows; config: hub config;
    test_path: optional separate local test file (else one file is split 90/10 by a hash of the question);
    format: compact (the question and a newline, for base models that continue in GSM8K's own style) or
    instruct (the question, and an instruction to box the answer).

    A completion's answer is found by `atrctl.tasks.answer` (last \\boxed{}, "####", "answer is", the last
    line) and compared with math-verify.
    """

    name = "gsm8k"

    def __init__(
        self,
        path: str = "openai/gsm8k",
        config: str | None = "main",
        test_path: str | None = None,
        format: str = "compact",
    ):
        self.format = format
        self.instruction, suffix = dataset_format(self.name, format)
        self._problems = load_problems(self.name, path, config, test_path, FIELDS, lambda row: to_problem(row, suffix))

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        return take(self._problems[split], n, seed, f"gsm8k {split} problems")

    def score(self, problem: Problem, completion: str) -> Score:
        return score_number(problem.answer, completion)


def to_problem(row: dict, suffix: str) -> Problem | None:
    question, worked = str(row["question"]), str(row["answer"])
    answer = answer_number(Found(worked.rpartition("####")[2], "hashes")) if "####" in worked else None
    if answer is None:
        return None
    return Problem(id=f"gsm8k-{stable_hash(question):016x}", prompt=question + suffix, answer=answer, solution=worked)
