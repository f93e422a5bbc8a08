"""Evaluating a run directory or a model directory, the one path `atrctl eval` and `atrctl compare` share.

`eval_target` resolves what is evaluated and with which prompts, `evaluate_target` loads it and calls
`atrctl.rollout.evaluate`, `run_evaluation` is `atrctl eval` without its display, and `evaluation_key`
is what a cached evaluation must match to be reused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from atrctl.core.passk import EvalResult, default_ks
from atrctl.errors import UserError
from atrctl.rollout.evaluate import DEFAULT_KEEP, check_samples_fit, evaluate_model
from atrctl.runtime import distributed
from atrctl.tasks import Problem, Task
from atrctl.training.rundir import RunDir


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
    engine_args: dict = field(default_factory=dict)  # and its engine's settings (a run's rollout.engine_args)
    system_prompt: str = ""  # the [task] prompt keys (`atrctl.rollout.prompts`)
    instruction: str = "auto"
    strict: bool = False  # a run's own final model: any missing or unexpected weight is an error

    def style(self, task: Task):
        """The prompt style for `task` (its "auto" instruction resolved)."""
        from atrctl.rollout.prompts import prompt_style

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
    backend: str | None = None,
) -> EvalTarget:
    """TARGET resolved: a run directory brings its own recipe (task, prompt style, lengths, dtype), which the
    arguments given override; a model directory or hub name needs `task` and `max_new_tokens`, and its
    prompts are the task's as written unless the style arguments say otherwise."""
    from dataclasses import replace

    from atrctl.config.schema import EvalConfig

    given = {"chat_template": chat_template, "system_prompt": system_prompt, "instruction": instruction,
             "backend": backend}  # fmt: skip
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
            recipe.rollout.engine_args,
            recipe.task.system_prompt,
            recipe.task.instruction,
            strict=True,
        )
        if backend is not None and backend != recipe.rollout.backend:  # the run's engine settings are its backend's
            overrides["engine_args"] = {}
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
    from atrctl.model.loading import load_model

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
        engine_args=spec.engine_args,
        on_progress=on_progress,
    )


def evaluation_key(spec: EvalTarget, problems: Sequence[Problem], **settings) -> dict:
    """Everything an evaluation's samples depend on, as JSON values: the model's files (path, size, mtime),
    the target, the problems, the sampling settings, the torch version and threads, and a digest of atrctl's
    own source (a changed verifier or sampler must not be answered from a cache)."""
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

    package, digest = Path(__file__).parents[1], hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_evaluation(
    spec: EvalTarget,
    target: str,
    *,
    split: str,
    problems: int | None,
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
    from atrctl.model.numerics import resolve_device
    from atrctl.reports.eval_report import write_eval
    from atrctl.runtime.allocator import keep_freed_memory
    from atrctl.runtime.machine import set_cpu_threads
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
        setting = (f"{spec.task} {split}, {len(picked)} problems, n={n}, T={temperature:g}{nucleus}, "
                   f"≤{spec.max_new_tokens:,} new tokens, {style.describe()}, {spec.backend} backend")  # fmt: skip
        try:
            paths = write_eval(result, ks, spec.directory, f"{target}: {setting}")
        except OSError as error:
            raise UserError(f"cannot write to {spec.directory} ({error.strerror}); use --out elsewhere") from None
        return result, setting, paths


def preset_settings(task: str | None, given: dict, **defaults) -> dict:
    """The settings of `atrctl eval`: each one given (not None) as it is; for a benchmark task the rest from its
    preset (all its problems, and the vllm backend where vLLM is installed); else `defaults` where they name one,
    and None (the run's own, or a plain default, decided by `eval_target`) where they do not."""
    import importlib.util

    from atrctl.tasks import PRESETS

    preset = PRESETS.get(task or "")
    if preset is None:
        return {key: defaults.get(key) if value is None else value for key, value in given.items()}
    fill = dataclasses.asdict(preset) | {"problems": None}
    if importlib.util.find_spec("vllm") is not None:
        fill["backend"] = "vllm"
    return {key: fill.get(key) if value is None else value for key, value in given.items()}


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
