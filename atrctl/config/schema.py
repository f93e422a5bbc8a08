"""A recipe's sections: every setting, its type, its default and a one-line meaning, so a recipe only
names what it changes.  `atrctl.config.loading` reads, checks and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    per process for every shape (atrctl.model.decoder_pass): faster steps after 10-60 s of compiling at the first
    step (a restart compiles again, faster from torch's on-disk cache), so worth it for long runs (figures:
    docs/performance.md, `benchmarks/step_throughput.py --arms compile`).  Other models warn and run eagerly;
    not with model.shard = "fsdp"."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: far less memory for ~30% more compute."""
    lora: dict[str, Any] = field(default_factory=dict)
    """Train LoRA adapters instead of every weight (needs peft), e.g. {r = 16, alpha = 32, dropout = 0.0,
    target_modules = ["q_proj", "v_proj"]}; unnamed settings take atrctl.model.adapters.LORA_DEFAULTS (target_modules
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
    """Rollout backend that generates the completions (`atrctl ls`): "hf" is atrctl's KV-cache sampler, "vllm"
    vLLM's engine in this process (docs/backends.md)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Settings for the backend's engine: vLLM's engine arguments for "vllm" (e.g. {kv_cache_memory_bytes =
    2_000_000_000, enforce_eager = false}); "hf" takes none."""
    correction: str = "none"
    """How the update treats the mismatch between the policy μ the backend sampled from and π_old, the trainer's
    (`atrctl ls`; docs/backends.md): "none"; "token-tis" or "sequence-tis", importance weights π_old/μ truncated
    at cap; "token-mask" or "sequence-mask", tokens or whole completions dropped where a divergence measure of
    π_old/μ exceeds δ.  Every step reports mismatch/* whichever is chosen."""
    correction_args: dict[str, Any] = field(default_factory=dict)
    """The correction's parameters beyond its defaults, e.g. {cap = 3.0} or {measure = "kl3", delta = 0.05}."""


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
    benchmarks: list[str] = field(default_factory=list)
    """Benchmark tasks (`atrctl ls`: aime24, aime25, math500, ...) on which `atrctl compare` also evaluates every
    final model, each at its preset, beside the held-out problems of the training task."""


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
