"""Evaluating a model: n samples and a greedy completion per problem, scored by the task.

`evaluate_model` samples and scores (sharded over ranks under torchrun); `evaluate_target` is the one
path that evaluates a run directory or a model directory, used by `atrctl eval` and by `atrctl compare`
alike; `run_evaluation` is `atrctl eval` without its display.  The figures themselves are
`atrctl.core.passk`'s pure functions.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atrctl import distributed
from atrctl.core.passk import EvalResult, default_ks
from atrctl.core.seeds import derive_seed
from atrctl.errors import UserError
from atrctl.prompts import PLAIN, PromptStyle
from atrctl.rundir import RunDir
from atrctl.tasks import Problem, Task

DEFAULT_KEEP = 4  # sampled completions per problem written to samples.jsonl (beside its greedy one)


@dataclass(frozen=True)
class EvalTarget:
    """What a model is evaluated with: a run directory brings its own recipe, a bare model the caller's."""

    model: str  # a model directory or hub name for load_model
    task: str
    task_args: dict
    chat_template: bool
    max_new_tokens: int
    dtype: str
    problem_seed: int  # the held-out problems training evaluated on (eval.seed), shared by every run
    directory: Path  # where its evaluation files go
    backend: str = "hf"  # the rollout backend that samples (a run's rollout.backend)
    system_prompt: str = ""  # the [task] prompt keys (`atrctl.prompts`)
    instruction: str = "auto"
    strict: bool = False  # a run's own final model: any missing or unexpected weight is an error

    def style(self, task: Task):
        """The prompt style for `task` (its "auto" instruction resolved)."""
        from atrctl.prompts import prompt_style

        return prompt_style(task, self.chat_template, self.system_prompt, self.instruction)


def eval_target(
    target: str,
    task: str | None = None,
    task_args: dict | None = None,
    max_new_tokens: int | None = None,
    out: Path | None = None,
    *,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> EvalTarget:
    """TARGET resolved: a run directory brings its own recipe (task, prompt style, lengths, dtype), which the
    arguments given override; a model directory or hub name needs `task` and `max_new_tokens`, and its
    prompts are the task's as written unless the style arguments say otherwise."""
    from dataclasses import replace

    from atrctl.config import EvalConfig

    given = {"chat_template": chat_template, "system_prompt": system_prompt, "instruction": instruction}
    overrides = {key: value for key, value in given.items() if value is not None}

    task_args = task_args or {}
    run = RunDir(Path(target).expanduser())
    if run.is_run:
        recipe = run.recipe()
        if not run.finished:  # evaluation needs the final model
            raise UserError(f"run {run.path} has no final model in {run.model}: finish (or resume) its training")
        name, args = (task, task_args) if task else (recipe.task.name, {**recipe.task.args, **task_args})
        spec = EvalTarget(
            str(run.model),
            name,
            args,
            recipe.task.chat_template,
            max_new_tokens or recipe.rollout.max_new_tokens,
            recipe.model.dtype,
            recipe.eval.seed,
            out or run.eval,
            recipe.rollout.backend,
            recipe.task.system_prompt,
            recipe.task.instruction,
            strict=True,
        )
        return replace(spec, **overrides)
    if task is None:
        raise UserError(f"{target} is not a run directory (no config.toml): name its task, e.g. --task arith")
    if max_new_tokens is None:
        raise UserError(
            f"{target} is not a run directory: give --max-new-tokens (e.g. 8 for 3-digit arith, "
            f"512 for gsm8k) so answers are not silently cut short"
        )
    path = run.path
    stem = path.name if path.name != "model" else path.parent.name
    spec = EvalTarget(
        target,
        task,
        task_args,
        False,
        max_new_tokens,
        "auto",
        EvalConfig().seed,
        out or Path("results") / f"eval-{stem}",
    )
    return replace(spec, **overrides)


def evaluate_target(
    spec: EvalTarget,
    task: Task,
    problems: Sequence[Problem],
    *,
    n: int,
    temperature: float,
    seed: int,
    device: str,
    top_p: float = 1.0,
    batch_size: int = 0,
    keep: int | None = DEFAULT_KEEP,
    on_progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Load the target's model and evaluate it on `problems` of `task` (the caller builds the task and picks
    the problems once, so that a comparison gives every arm the same ones)."""
    from atrctl.models import load_model

    model, tokenizer = load_model(spec.model, device, spec.dtype, strict=spec.strict)
    return evaluate_model(
        model,
        tokenizer,
        task,
        problems,
        n=n,
        temperature=temperature,
        seed=seed,
        max_new_tokens=spec.max_new_tokens,
        style=spec.style(task),
        top_p=top_p,
        batch_size=batch_size,
        keep=keep,
        backend=spec.backend,
        on_progress=on_progress,
    )


def evaluation_key(spec: EvalTarget, problems: Sequence[Problem], **settings) -> dict:
    """Everything an evaluation's samples depend on, as JSON values: the model's files (path, size, mtime),
    the target, the problems, the sampling settings, the torch version and threads, and a digest of atrctl's
    own source (a changed verifier or sampler must not be answered from a cache)."""
    import dataclasses
    import hashlib
    import json

    import torch

    model = Path(spec.model)
    files = sorted((str(p.relative_to(model)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in model.glob("*") if p.is_file()) if model.is_dir() else []  # fmt: skip
    problems_digest = hashlib.sha256(json.dumps([(p.id, p.prompt, p.answer) for p in problems]).encode()).hexdigest()
    target = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(spec).items()}
    return {"model": str(model.resolve()) if model.is_dir() else spec.model, "files": files, "target": target,
            "problems": problems_digest, "settings": settings, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "code": _source_digest()}  # fmt: skip


@functools.cache
def _source_digest() -> str:
    """SHA-256 of atrctl's Python source files (names and contents), read once per process: a comparison asks
    for it for every run it evaluates."""
    import hashlib

    package, digest = Path(__file__).parent, hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_evaluation(
    spec: EvalTarget,
    target: str,
    *,
    split: str,
    problems: int,
    n: int,
    ks: Sequence[int],
    temperature: float,
    seed: int,
    device: str,
    batch_size: int,
    top_p: float = 1.0,
    keep: int | None = DEFAULT_KEEP,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[EvalResult, str, list[Path]] | None:
    """`atrctl eval`: sample (this process's share of) the problems; rank 0 writes the three files and gets
    (result, a one-line description of the setting, the files), the other ranks None."""
    from atrctl.allocator import keep_freed_memory
    from atrctl.eval_report import write_eval
    from atrctl.models import resolve_device, set_cpu_threads
    from atrctl.tasks import get_task

    with distributed.process_group(resolve_device(device)):
        task = get_task(spec.task, **spec.task_args)
        style = spec.style(task)  # a bad combination of prompt settings: refused before the model loads
        picked = task.problems(split, problems, spec.problem_seed)
        check_samples_fit(len(picked), n)
        set_cpu_threads(distributed.cpu_threads_per_rank())
        keep_freed_memory()
        result = evaluate_target(
            spec,
            task,
            picked,
            n=n,
            temperature=temperature,
            seed=seed,
            device=device,
            top_p=top_p,
            batch_size=batch_size,
            keep=keep,
            on_progress=on_progress if distributed.is_main() else None,
        )
        if not distributed.is_main():
            return None
        nucleus = f", top-p={top_p:g}" if top_p < 1 else ""
        setting = f"{spec.task} {split}, {len(picked)} problems, n={n}, T={temperature:g}{nucleus}, {style.describe()}"
        try:
            paths = write_eval(result, ks, spec.directory, f"{target}: {setting}")
        except OSError as error:
            raise UserError(f"cannot write to {spec.directory} ({error.strerror}); use --out elsewhere") from None
        return result, setting, paths


def parse_ks(text: str | None, n: int) -> list[int]:
    """--k '1,2,4' -> [1, 2, 4] (sorted, distinct), each in [1, n]; None -> 1, 2, 4, ... and n."""
    if text is None:
        return default_ks(n)
    try:
        ks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise UserError(f"--k {text!r}: give comma-separated integers, e.g. --k 1,2,4,8") from None
    if ks[0] < 1 or ks[-1] > n:
        raise UserError(f"--k {text!r}: every k must be between 1 and --n ({n}); raise --n or drop the larger k")
    return ks


# What holding one sample's outcome costs until the figures are computed: its reward and parsed answer as Python
# objects plus their list slots (~100 bytes measured with tracemalloc for short answers), rounded up for longer ones.
BYTES_PER_SAMPLE = 128


def check_samples_fit(problems: int, n: int, flag: str = "--n", problems_flag: str = "--problems") -> None:
    """Refuse, before a model is loaded or a file written, an evaluation whose problems × n outcomes could not
    be held in this machine's available memory (else it would run for hours and then be killed)."""
    check_fits(f"{problems} problems × {flag} {n} = {problems * n:,} samples", problems * n * BYTES_PER_SAMPLE,
               f"lower {flag} or {problems_flag}")  # fmt: skip


def check_fits(what: str, needed: int, fix: str) -> None:
    """The one memory check: refuse `what`, which needs at least `needed` bytes, where this machine has fewer
    available, before any work (else it runs, perhaps for hours, and is then killed); `fix` says what to lower."""
    available = available_memory()
    if available is not None and needed > available:
        raise UserError(f"{what} need about {needed / 2**30:,.1f} GiB to hold, more than the "
                        f"{available / 2**30:,.1f} GiB available: {fix}")  # fmt: skip


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable; else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def sample_chunks(problems: int, n: int, batch_size: int) -> list[range]:
    """The problems sampled together: runs of max(1, batch_size // n), cut at multiples of that size."""
    width = max(1, batch_size // n)
    return [range(first, min(first + width, problems)) for first in range(0, problems, width)]


def eval_chunk_seed(seed: int, first: int) -> int:
    """Seed of the generator that samples the chunk whose first problem has index `first`."""
    return derive_seed(seed, first)


def evaluate_model(
    model,
    tokenizer,
    task,
    problems: Sequence,
    *,
    n: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    style: PromptStyle = PLAIN,
    top_p: float = 1.0,
    batch_size: int = 0,
    backend: str = "hf",
    keep: int | None = DEFAULT_KEEP,
    on_progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """A greedy completion and n samples for each problem, scored by the task; the greedy completion and the
    first `keep` samples of every problem (None: all) are kept as text in `result.completions`.

    `batch_size` 0 is sized from the model (`models.sized_batch`: a fixed KV-cache budget at the longest
    prompt + max_new_tokens).  Problems are sampled in chunks of max(1, batch_size // n) whole problems (at most about
    `batch_size` completions, cut at multiples of the chunk size), each chunk from its own generator
    seeded by (seed, index of its first problem) on the model's device.  Greedy completions go in
    blocks of `batch_size` problems.  Under a joined process group (torchrun) rank r takes chunks and
    blocks r, r + W, ... and every rank receives the whole result, in problem order: the samples of a
    problem do not depend on the world size, so W processes give the 1-process result.
    on_progress(problems sampled, total) follows this process's share of the sampling.
    """
    import torch

    from atrctl.models import numerics, sized_batch
    from atrctl.prompts import check_lengths, encode_prompts, model_positions, prompt_text
    from atrctl.rollout import rollout_backend
    from atrctl.scoring import sampled_scores

    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    started = time.perf_counter()
    rank, world = distributed.shard()
    prompt_ids = encode_prompts(tokenizer, problems, style)
    check_lengths(prompt_ids, max_new_tokens, model_positions(model), "--max-new-tokens")
    batch_size = sized_batch(model, max((len(ids) for ids in prompt_ids), default=0) + max_new_tokens, batch_size)
    device = next(model.parameters()).device
    sampler = rollout_backend(backend, model, tokenizer, numerics(device, autocast=False))  # the dtype loaded

    def shown(i: int, label: str, texts: list[str], scores: list) -> list[dict]:
        """What samples.jsonl says of completions of problem i: enough to see why a score is what it is."""
        problem = problems[i]
        prompt = prompt_text(tokenizer, problem.prompt, style)
        return [completion_row(problem, prompt, label if label == "greedy" else j, text, score)
                for j, (text, score) in enumerate(zip(texts, scores, strict=True))]  # fmt: skip

    kept: dict[int, list[dict]] = {}
    greedy: dict[int, bool] = {}
    blocks = [range(f, min(f + batch_size, len(problems))) for f in range(0, len(problems), batch_size)]
    for block in blocks[rank::world]:
        texts: list[list[str]] = []
        scores = sampled_scores(
            sampler,
            tokenizer,
            task,
            problems[block.start : block.stop],
            prompt_ids[block.start : block.stop],
            samples=1,
            greedy=True,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            texts=texts,
        )
        greedy.update((i, row[0].reward >= 1) for i, row in zip(block, scores, strict=True))
        for i, row, text in zip(block, scores, texts, strict=True):
            kept[i] = shown(i, "greedy", text, row)

    sampled: dict[int, tuple] = {}  # problem -> (rewards, parsed, forms, (nats, tokens) per sample)
    mine = sample_chunks(len(problems), n, batch_size)[rank::world]
    total = sum(len(chunk) for chunk in mine)
    for chunk in mine:
        generator = torch.Generator(device).manual_seed(eval_chunk_seed(seed, chunk.start))
        texts, surprisal = [], []
        scores = sampled_scores(
            sampler,
            tokenizer,
            task,
            problems[chunk.start : chunk.stop],
            prompt_ids[chunk.start : chunk.stop],
            samples=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            generator=generator,
            batch_size=batch_size,
            texts=texts,
            surprisal=surprisal,
        )
        sampled.update(
            (i, ([s.reward for s in row], [s.parsed for s in row], [s.form for s in row], pairs))
            for i, row, pairs in zip(chunk, scores, surprisal, strict=True)
        )
        for i, row, text in zip(chunk, scores, texts, strict=True):
            kept[i] = kept.get(i, []) + shown(i, "sample", text[:keep], row[:keep])
        if on_progress is not None:
            on_progress(len(sampled), total)

    shown_rows: dict[int, list[dict]] = {}
    for rank_greedy, rank_sampled, rank_kept in distributed.all_gather_objects((greedy, sampled, kept)):
        greedy.update(rank_greedy)
        sampled.update(rank_sampled)
        for i, rows in rank_kept.items():  # a problem's greedy and sampled rows may come from two ranks
            shown_rows.setdefault(i, []).extend(rows)
    order = range(len(problems))
    surprisal = np.array([sampled[i][3] for i in order], dtype=np.float64).reshape(len(problems), n, 2)
    return EvalResult(
        problem_ids=[p.id for p in problems],
        n=n,
        rewards=np.array([sampled[i][0] for i in order], dtype=np.float32).reshape(len(problems), n),
        parsed=[sampled[i][1] for i in order],
        greedy=np.array([greedy[i] for i in order], dtype=bool),
        temperature=temperature,
        seed=seed,
        seconds=time.perf_counter() - started,
        completions=[row for i in order for row in sorted(shown_rows.get(i, []), key=_greedy_first)],
        nats=surprisal[..., 0],
        lengths=surprisal[..., 1].astype(int),
        forms=[sampled[i][2] for i in order],
    )


def _greedy_first(row: dict) -> bool:
    """Sort key: a problem's greedy row before its samples (False sorts first; sorted() is stable)."""
    return row["sample"] != "greedy"


def completion_row(problem, prompt: str, sample: int | str, text: str, score) -> dict:
    """One line of samples.jsonl: the problem, the prompt the model read, its completion and how it scored."""
    return {"problem": problem.id, "sample": sample, "prompt": prompt, "completion": text,
            "answer": score.parsed, "gold": problem.answer, "reward": score.reward}  # fmt: skip
