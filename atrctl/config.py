"""Recipes: TOML files plus command-line overrides, resolved into validated dataclasses.

Every setting has a default here and a one-line meaning in its docstring, so a
recipe only names what it changes.  Validation is strict because a typo in a
hyperparameter silently ignored is a wasted experiment: an unknown key or a
wrong type is an error that names the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atrctl import numbers
from atrctl.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class TaskConfig:
    """What the policy is trained and evaluated on."""

    name: str = "arith"
    """Registered task (`atrctl ls` lists them with their parameters)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Task parameters beyond the task's defaults, e.g. {digits = 2} for arith or {path = "gsm8k.jsonl"} for gsm8k."""
    chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template (instruct models)."""
    system_prompt: str = ""
    """The chat's system message ("": the template's own default; needs chat_template)."""
    instruction: str = "auto"
    """Appended on its own line after each problem: "auto" is the task format's own (args.format = "instruct"
    asks for a boxed or "Answer:" line; compact has none), "" is none, any other text replaces it."""


@dataclass
class ModelConfig:
    """The policy network."""

    base: str = "tiny"
    """A preset (tiny, small, medium: built from config and warmed up), a local HF model directory or a hub name."""
    arch: str = "llama"
    """Architecture of a preset (one of models.ARCHS)."""
    device: str = "auto"
    """One of models.DEVICES: auto (CUDA when present), cpu or cuda."""
    dtype: str = "auto"
    """auto (bf16 on a capable GPU, else float32), float32 or bfloat16: the dtype of the frozen copies
    (reference model, evaluation).  The trained policy always keeps float32 master weights; what its
    forward passes compute in is `autocast`."""
    autocast: str = "auto"
    """bf16 autocast of the trained policy's sampling and update passes (the weights stay float32): "auto" =
    on a CUDA GPU with bf16, and on a CPU with native bf16 instructions (avx512_bf16 or amx_bf16) for models
    at least 256 wide (narrower ones measured no faster there; without those instructions bf16 products are
    emulated, 2-4x slower than float32); "bfloat16" = always; "off" = float32 everywhere."""
    compile: bool = False
    """torch.compile a Llama or Qwen2 policy's update passes and its sampler's prefill and decoding steps, once
    per process for every shape (atrctl.decoder_pass): faster steps after 10-60 s of compiling at the first
    step (a restart compiles again, faster from torch's on-disk cache), so worth it for long runs (figures:
    docs/performance.md, `benchmarks/step_throughput.py --arms compile`).  Other models warn and run eagerly;
    not with model.shard = "fsdp"."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: far less memory for ~30% more compute."""
    lora: dict[str, Any] = field(default_factory=dict)
    """Train LoRA adapters instead of every weight (needs peft), e.g. {r = 16, alpha = 32, dropout = 0.0,
    target_modules = ["q_proj", "v_proj"]}; unnamed settings take atrctl.adapters.LORA_DEFAULTS (target_modules
    "all-linear": every linear layer but the output projection).  {} = off: every weight trains."""
    shard: str = "none"
    """"fsdp": under --nproc N / torchrun, shard parameters, gradients and AdamW state over the N processes
    with FSDP2 (one unit per decoder layer, plus the root), ~1/N of the memory each; "none": every process
    holds the whole model (data parallelism).  Checkpoints are the same either way."""


@dataclass
class WarmupConfig:
    """Supervised warm-up of a from-scratch preset until it solves some held-out problems (SFT)."""

    target_accuracy: float = 0.2
    """Stop once held-out greedy accuracy reaches this: good enough to get rewards, imperfect enough to improve."""
    max_steps: int = 3000
    """Give up after this many optimiser steps (the base is kept and its accuracy recorded)."""
    batch_size: int = 128
    """Solutions per SFT step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm-up (from-scratch tiny models tolerate a large one)."""
    eval_every: int = 25
    """Measure held-out greedy accuracy every this many steps."""
    eval_problems: int = 200
    """Held-out test problems in each warm-up measurement."""
    seed: int = 0
    """Seed of the initial weights and the SFT data order: part of the cached base's identity."""


@dataclass
class RolloutConfig:
    """Sampling of the training batch: `prompts` × `group_size` completions per step."""

    prompts: int = 64
    """Distinct prompts per step."""
    group_size: int = 8
    """Completions per prompt (G): the group whose rewards define each advantage."""
    max_new_tokens: int = 8
    """Longest completion; 3-digit sums need 4 digits plus EOS."""
    temperature: float = 1.0
    """Sampling temperature; the policy's logprobs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    sample_batch: int = 0
    """Most completions per sampling call, in whole groups (0 = all of a process's share at once): caps KV-cache
    memory.  Each call's generator is seeded from (seed, step, first prompt), so the value changes the samples."""
    backend: str = "hf"
    """Rollout backend that generates the completions (`atrctl ls`): "hf" is atrctl's KV-cache sampler."""


@dataclass
class AlgoConfig:
    """The policy loss and how it is applied (docs/design.md §1-2)."""

    loss: str = "atr"
    """Registered policy loss (`atrctl ls` lists them with their parameters)."""
    args: dict[str, Any] = field(default_factory=dict)
    """The loss's parameters beyond its defaults, e.g. {max_kl3 = 0.05} for atr or {eps = 0.1} for grpo."""
    advantage: str = "grpo"
    """Registered advantage estimator, e.g. grpo (mean/std), drgrpo (mean only), rloo (leave-one-out)."""
    agg: str = "token-mean"
    """Registered loss aggregation, e.g. token-mean (DAPO), seq-mean-token-mean (GRPO)."""
    num_iterations: int = 1
    """Passes (μ) over each rollout batch; with μ = 1 and one mini-batch the ratio is 1 throughout."""
    minibatches: int = 4
    """Optimiser steps per pass: the batch is split into this many mini-batches of whole groups.
    All but the first are off-policy (w != 1), which is where the trust region binds."""
    old_logprobs: str = "auto"
    """Where the sampling policy's logprobs (the ratio's denominator) come from: "sampler" keeps the ones the
    rollout computed token by token (no extra forward pass); "recompute" runs a no-grad forward pass with
    the update's numerics over every mini-batch but the first (whose own first pass, before any optimiser
    step, gives its old logprobs); "auto" = the sampler's when the rollout backend says they may stand in
    (the hf sampler in float32, where they match the training pass, and in bf16 on a CPU, where they differ
    by bf16 rounding but the update on them was measured as close to float32's), else recompute (bf16 on
    CUDA).  Only read when the update is off-policy (several mini-batches or μ > 1)."""
    micro_batch: int = 0
    """Most completions per forward/backward: gradients accumulate over micro-batches, weighted so that the
    optimiser step is the same as without them, for every aggregation.  The rows are cut longest completion
    first, so each micro-batch pads its rows to similar lengths.  0 = as many as 4 GiB of activations (on a GPU,
    a quarter of its memory) hold at each micro-batch's longest row (`models.sized_micro_batch`): on a CPU a
    whole mini-batch of the tiny presets, 5 rows of SmolLM2-135M at 320 tokens, more where replies are shorter."""
    skip_zero_advantage: bool = True
    """Leave out of the forward/backward the rows whose advantage is exactly 0 (every completion of a group
    with one reward): they carry no policy-loss gradient.  Only where no other term needs them (beta = 0,
    entropy_coef = 0); the mini-batch's normaliser still counts them, so the step is the same to float
    noise.  The step's loss diagnostics (clip/*, kl3/*, ratio/*, entropy) then describe the rows trained on;
    `rows/skipped` is the share left out.  false = every row, e.g. to log entropy over the whole batch."""
    beta: float = 0.0
    """KL-to-reference coefficient; 0 loads no reference model."""
    kl_estimator: str = "k3"
    """Schulman's estimator of KL(π_θ‖π_ref) for beta > 0: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off; entropy is logged either way)."""


@dataclass
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = 2e-4
    """Peak learning rate (tiny models collapse above ~5e-4)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    schedule: str = "constant"
    """constant or cosine (to 10% of lr), each after `warmup_steps` of linear warm-up."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""


@dataclass
class EvalConfig:
    """Held-out evaluation during training: greedy accuracy and sampled pass@1."""

    every: int = 25
    """Evaluate every this many steps (and at the start and the end)."""
    problems: int = 200
    """Held-out test problems; the same ones every time, for every run."""
    samples: int = 4
    """Samples per problem for pass@1 (the mean correctness of samples)."""
    temperature: float = 1.0
    """Temperature of the pass@1 samples."""
    seed: int = 1234
    """Seed of the held-out problems and their samples: shared by runs so they are comparable."""
    batch: int = 0
    """Completions sampled at once in held-out checks and compare's evaluation; 0 sizes it from the model:
    as many as a fixed 2 GiB of KV cache holds at the longest prompt (models.sized_batch), at most 1024."""


@dataclass
class RunConfig:
    """Length, seed and bookkeeping of one training run."""

    steps: int = 300
    """RL steps (one rollout batch each, `minibatches × num_iterations` optimiser steps per RL step)."""
    seed: int = 0
    """Seed of prompt order and sampling (the base has its own, warmup.seed)."""
    checkpoint_every: int = 50
    """Write a resumable checkpoint every this many steps (and on Ctrl-C and at the end)."""
    max_bad_steps: int = 3
    """Stop after this many consecutive bad steps: a NaN/inf loss or gradient, or an update after which
    the policy samples non-finite probabilities (each is skipped, with `rollback` undone)."""
    rollback: bool = True
    """Keep the weights and optimiser state from before each update in host memory, so a bad step is
    undone and a diverging run stops on weights that sample (costs 3× the float32 model in host RAM)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package): the same as "tensorboard" in
    report_to."""
    report_to: list[str] = field(default_factory=list)
    """Trackers that get every metric, the recipe, the held-out completions and the evaluation tables, besides
    metrics.jsonl: "tensorboard" (<run>/tensorboard/) and "wandb" (needs wandb; WANDB_MODE=offline works
    without a server); e.g. ["wandb"]."""


@dataclass
class Recipe:
    """A whole experiment; sections map one to one to TOML tables."""

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


# --------------------------------------------------------------- validation


def _registry(module: str, name: str):
    """A registry read when a recipe is checked (not copied at import), so a newly registered entry is valid
    at once; imported lazily because the loss and rollout registries bring torch."""
    import importlib

    return lambda: getattr(importlib.import_module(module), name)


_CHOICES = {
    ("model", "arch"): _registry("atrctl.models", "ARCHS"),
    ("model", "device"): _registry("atrctl.models", "DEVICES"),
    ("model", "dtype"): _registry("atrctl.models", "DTYPES"),
    ("model", "autocast"): lambda: ("auto", "bfloat16", "off"),
    ("model", "shard"): lambda: ("none", "fsdp"),
    ("rollout", "backend"): _registry("atrctl.rollout", "ROLLOUT_BACKENDS"),
    ("algo", "advantage"): _registry("atrctl.core.advantages", "ADVANTAGE_ESTIMATORS"),
    ("algo", "agg"): _registry("atrctl.core.losses", "AGGREGATIONS"),
    ("algo", "kl_estimator"): _registry("atrctl.core.losses", "KL_ESTIMATORS"),
    ("algo", "old_logprobs"): lambda: ("auto", "sampler", "recompute"),
    ("optim", "schedule"): lambda: ("constant", "cosine"),
}
_POSITIVE = {
    ("warmup", "max_steps"),
    ("warmup", "batch_size"),
    ("warmup", "lr"),
    ("warmup", "eval_every"),
    ("warmup", "eval_problems"),
    ("rollout", "prompts"),
    ("rollout", "max_new_tokens"),
    ("algo", "num_iterations"),
    ("algo", "minibatches"),
    ("optim", "lr"),
    ("optim", "grad_clip"),
    ("eval", "every"),
    ("eval", "problems"),
    ("eval", "samples"),
    ("run", "steps"),
    ("run", "checkpoint_every"),
    ("run", "max_bad_steps"),
}
_NON_NEGATIVE = {
    ("algo", "beta"),
    ("optim", "weight_decay"),
    ("optim", "warmup_steps"),
    ("algo", "micro_batch"),
    ("eval", "batch"),
    ("rollout", "sample_batch"),
}
_FRACTIONS = {("warmup", "target_accuracy")}
_SAMPLING = {"temperature": numbers.temperature, "top_p": numbers.top_p}  # rollout.* and eval.*


def _closest(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    valid = list(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid: {', '.join(prefix + v for v in valid)}"


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a table",
    list: "a list",
}


def _type_name(annotation: Any) -> str:
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation) or annotation
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (int, float) and isinstance(value, bool):
        raise UserError(f"{where} must be {_type_name(origin)}, got the boolean {value!r}")
    if origin in (types.UnionType, typing.Union):
        return value
    if not isinstance(value, origin):
        raise UserError(f"{where} must be {_type_name(origin)}, got {value!r}")
    return value


def _check_value(section: str, key: str, value: Any) -> None:
    where = f"{section}.{key}"
    if key == "seed":
        numbers.seed(value, where)
    if isinstance(value, int | float) and not isinstance(value, bool):
        numbers.number(value, where)
    if key in _SAMPLING:
        _SAMPLING[key](value, where)
    if (section, key) in _CHOICES and value not in (choices := _CHOICES[section, key]()):
        raise UserError(f"{where} = {value!r} is not one of {', '.join(choices)}")
    if (section, key) in _POSITIVE and not (value > 0 and math.isfinite(value)):
        raise UserError(f"{where} must be > 0, got {value}")
    if (section, key) in _NON_NEGATIVE and not (value >= 0 and math.isfinite(value)):
        raise UserError(f"{where} must be >= 0, got {value}")
    if (section, key) in _FRACTIONS and not 0 < value <= 1:
        raise UserError(f"{where} must be in (0, 1], got {value}")
    if (section, key) == ("run", "report_to"):
        check_report_to(value)
    if (section, key) == ("model", "lora"):
        from atrctl.adapters import lora_settings

        lora_settings(value)
    if (section, key) == ("rollout", "group_size") and value < 2:
        raise UserError(f"{where} must be at least 2 (a group of one has no baseline), got {value}")


MAX_NESTING = 16
"""Most levels of lists and tables inside one another a recipe value may have: real ones have 2 (lora's
target_modules); past a few hundred, parsing and copying a value exhaust Python's recursion."""


def _nesting(value: Any) -> int:
    """Levels of lists and tables in `value`, counted level by level (no recursion, whatever the depth)."""
    depth, level = 0, [value]
    while any(isinstance(item, list | dict) for item in level):
        depth += 1
        level = [child for item in level if isinstance(item, list | dict)
                 for child in (item.values() if isinstance(item, dict) else item)]  # fmt: skip
    return depth


def _too_deep(what: str) -> UserError:
    return UserError(f"{what} nests lists or tables too deeply: at most {MAX_NESTING} levels")


def loads_toml(text: str, what: str) -> dict[str, Any]:
    """tomllib.loads, whose parser recurses once per level: a value nested a few hundred deep is refused."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise _too_deep(what) from None


TRACKERS = ("tensorboard", "wandb")
"""The names run.report_to takes; `reporting.REPORTERS` implements one each (a test checks that they agree).
Kept here, where recipes are read, so that checking a recipe needs no tracker code."""


def check_report_to(names: typing.Sequence[str]) -> None:
    """run.report_to names known trackers, each once (checked while the recipe is read)."""
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UserError(f'run.report_to must be a list of tracker names such as ["wandb"], got {names!r}')
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"run.report_to: '{name}' is not one of {', '.join(TRACKERS)}")
    if len(set(names)) < len(names):
        raise UserError(f"run.report_to names a tracker twice: {names}")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UserError(f"unknown key '{section}.{key}'{_closest(key, names, section + '.')}")
        if _nesting(value) > MAX_NESTING:
            raise _too_deep(f"{section}.{key}")
        value = _coerce(value, hints[key], f"{section}.{key}")
        _check_value(section, key, value)
        kwargs[key] = value
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Validate a nested dict (a parsed TOML recipe) into a Recipe."""
    hints = typing.get_type_hints(Recipe)
    sections = {}
    for section, values in data.items():
        if section not in hints:
            raise UserError(f"unknown section '[{section}]'{_closest(section, hints)}")
        if not isinstance(values, dict):
            raise UserError(f"'{section}' must be a table ([{section}]), got {type(values).__name__}")
        sections[section] = _build_section(section, hints[section], values)
    recipe = Recipe(**sections)
    _check_loss_args(recipe.algo)
    if recipe.task.system_prompt and not recipe.task.chat_template:
        raise UserError("task.system_prompt needs the chat template: set task.chat_template = true")
    return recipe


def _check_loss_args(algo: AlgoConfig) -> None:
    """Each of algo.args a number, or a word where the loss's default is one: the loss itself would pass a
    string through `float()` and train on it.  Names the loss does not take are left to `training.checks.validate_algo`,
    which lists the ones it does."""
    if not algo.args:
        return
    from atrctl.core.losses import POLICY_LOSSES, loss_parameters

    defaults = loss_parameters(algo.loss) if algo.loss in POLICY_LOSSES else {}
    for key, value in algo.args.items():
        if key in defaults:
            numbers.loss_value(value, defaults[key], f"algo.args.{key}")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


def changed_keys(before: dict, after: dict, ignored: typing.Collection[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The (section, key) pairs whose values differ between two recipes as `recipe_to_dict` writes them (a key
    `before` lacks counts as changed), `ignored` left out: what a resume or a kept run may not have changed."""
    return [(section, key) for section in after for key in after[section]
            if (section, key) not in ignored and before.get(section, {}).get(key) != after[section][key]]  # fmt: skip


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A two-level dict (tables of scalars, lists and inline tables) as TOML that load_recipe reads back."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ loading


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value read as TOML (bare words as strings)."""
    path, sep, raw = assignment.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise UserError(f"--set {assignment!r}: write section.key=value, e.g. --set optim.lr=2e-4")
    return keys, read_value(raw)


def read_value(raw: str) -> Any:
    """A value as TOML reads it (0.1, 2, true, "x"); a bare word such as cosine or cuda stays a string."""
    try:
        return loads_toml(f"v = {raw.strip()}", f"the value {raw.strip()[:20]}…")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def _merge(base: dict[str, Any], keys: list[str], value: Any) -> None:
    node = base
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {'.'.join(keys)}: '{key}' is a value, not a table")
    node[keys[-1]] = value


def load_recipe(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Defaults, then the TOML file (if any), then each `section.key=value` override, validated once."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"recipe {path} does not exist; pass a TOML file such as recipes/default.toml")
        try:
            data = loads_toml(path.read_text(encoding="utf-8"), f"recipe {path}")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise UserError(f"recipe {path} is not valid TOML: {error}") from None
    for assignment in overrides:
        keys, value = parse_override(assignment)
        _merge(data, keys, value)
    return recipe_from_dict(data)


def load_recipe_with_flags(
    path: str | Path | None,
    flags: dict[str, Any],
    sets: typing.Sequence[str],
    max_kl3: float | None = None,
    eps: float | None = None,
    eps_high: float | None = None,
) -> Recipe:
    """`load_recipe` with a command's flags applied after the file and before its --set overrides (flags
    that are None are not given); --max-kl3 / --eps / --eps-high become parameters of whichever loss the
    recipe ends up with (`losses.flag_parameters`)."""
    from atrctl.core.losses import POLICY_LOSSES, flag_parameters

    common = [f"{key}={value}" for key, value in flags.items() if value is not None]
    loss = load_recipe(path, [*common, *sets]).algo.loss
    # an unknown loss gets no parameters: validate_algo refuses it with the list of registered ones
    loss_args = flag_parameters(loss, max_kl3, eps, eps_high) if loss in POLICY_LOSSES else {}
    return load_recipe(path, [*common, *(f"algo.args.{key}={value}" for key, value in loss_args.items()), *sets])


def parse_task_args(pairs: typing.Sequence[str]) -> dict[str, Any]:
    """--task-arg key=value pairs, values read as TOML (bare words as strings)."""
    args = {}
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip() or "." in key:
            raise UserError(f"--task-arg {pair!r}: write key=value, e.g. --task-arg digits=2")
        args[key.strip()] = parse_override(f"task.{pair}")[1]
    return args
