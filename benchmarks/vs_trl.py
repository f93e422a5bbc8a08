"""atrctl's GRPO step against TRL's GRPOTrainer on the same experiment: steps/s, tokens/s, their ratio.

Not a test. Both sides get the same model directory (one freshly initialised preset, identical
weights), the same prompts in the same order (atrctl's seeded order, fed to TRL unshuffled), the
same group size, max_new_tokens, mini-batches per rollout (TRL's steps_per_generation), μ, AdamW
settings and loss: atr's interval as TRL's epsilon / epsilon_high with loss_type="dapo" (the same
token-mean clipped surrogate).  Each side runs in its own process and both stay alive: the parent tells
them in turn to take one step (a few unmeasured ones each first), so a pair is one atrctl step and one TRL
step on the same prompts, back to back, alternating which goes first, and the ratio is taken within each
pair.  The side not stepping waits on its stdin and uses no CPU.  Pairs of steps rather than of processes
because this VM changes speed every few minutes and between processes (up to 2x): two processes run a
minute apart can land in different modes, two steps a second apart rarely do.  A process can also run in a
slow or a fast mode for its whole life, which one pair of processes samples once: `--rounds R` (default 3)
starts fresh workers R times and pools the pairs.

One "step" is one rollout batch and its optimiser steps (`minibatches × μ` of them), on both sides.
The algorithm is the same; the work is not quite: on a CPU atrctl takes the ratio's denominator
from the sampler's logprobs (`algo.old_logprobs = auto`) where TRL, with several optimiser steps
per generation, runs an extra forward pass for it; atrctl runs a group's shared prompt once, drops
ended rows from the decoding batch, and cuts its update's micro-batches by completion length where TRL
pads every row to the longest (a fresh model's replies end at random: at 64 new tokens half the row-steps
are padding).  All of it is part of what is measured; the breakdown shows each phase.  atrctl's skipping of rows with
advantage 0 is off unless --skip-zero-advantage: the fresh models here earn (almost) no reward, so it
would skip the whole update, which says nothing about the engines.  TRL's phases come from its own
timers: its "reward" leaves out decoding the completions, which atrctl's includes.  Both compute in the
same dtype: `--autocast` is atrctl's model.autocast, and TRL gets bf16=True exactly where that resolves to
bf16 (auto: a CUDA GPU, or a bf16-native CPU for models >= 256 wide); under bf16 on CUDA atrctl recomputes
the old logprobs too, for all mini-batches but the first (whose own first pass gives them).
After the pairs, one more untimed eager process per side counts its matrix-product FLOPs per step
(`torch.utils.flop_counter`), so the ratio splits into work avoided × speed per FLOP: the first is what
the design buys, the second what the kernels and overheads give (`--no-flops` skips it).
TRL is a benchmark-only dependency:  pip install torch==2.13.0 -e ".[bench]"

    python benchmarks/vs_trl.py                         # tiny, default recipe batch, 3 rounds x 7 pairs of steps
    python benchmarks/vs_trl.py --max-new-tokens 64
    python benchmarks/vs_trl.py --preset medium --autocast off        # float32 on both, whatever the CPU
    python benchmarks/vs_trl.py --compile                # atrctl's model.compile (update, decoding), TRL eager
    python benchmarks/vs_trl.py --preset medium --old-logprobs recompute   # under bf16: what the recompute costs
    python benchmarks/vs_trl.py --device cuda --preset qwen2.5-0.5b-shape --max-new-tokens 256   # bf16 on both
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import parse_with_smoke  # benchmarks/ is on sys.path when run as a script

READY = "READY"  # a worker's stdout line once it is built and waits for its first step
STEP = "STEP "  # a worker's stdout line after each step: this marker and a JSON object
RESULT = "RESULT "  # a FLOP-counting worker's last stdout line, likewise
GO = "go\n"  # what the parent writes to a worker's stdin for each step
PHASES = ("rollout", "reward", "logprobs", "update")
SIDES = ("atrctl", "trl")


def recipe_for(args: argparse.Namespace):
    from atrctl.config.loading import load_recipe

    return load_recipe(
        "recipes/default.toml",
        [
            f"model.base={args.model_dir}",
            f"model.device={args.device}",
            f"algo.loss={args.algo}",
            f"rollout.prompts={args.prompts}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"algo.minibatches={args.minibatches}",
            f"algo.num_iterations={args.num_iterations}",
            f"run.steps={args.warmup + args.pairs}",
            f"algo.skip_zero_advantage={str(args.skip_zero_advantage).lower()}",
            f"model.autocast={args.autocast}",
            f"model.compile={str(args.compile).lower()}",
            f"algo.old_logprobs={args.old_logprobs}",
        ],
    )


def announce_ready() -> None:
    print("\n" + READY, flush=True)


def await_go() -> float:
    """Block until the parent says the next step may run (the other side's step runs meanwhile); its start time."""
    if sys.stdin.readline() != GO:
        sys.exit("the parent closed the pipe before all steps ran")
    return time.perf_counter()


def await_end() -> None:
    """After the last step, hold still until the parent closes the pipe: exiting (or TRL's end of training)
    would run beside the other side's last measured step."""
    sys.stdin.read()


def report_step(step: dict) -> None:
    print("\n" + STEP + json.dumps(step), flush=True)  # on a line of its own, whatever a library left unended


def atrctl_worker(args: argparse.Namespace) -> None:
    from atrctl.training.checkpoint import TrainState
    from atrctl.training.setup import build_run
    from atrctl.training.step import train_step

    recipe = recipe_for(args)
    run = build_run(recipe, Path(args.scratch) / "atrctl-run", Path(args.scratch))
    announce_ready()
    for step in range(args.warmup + args.pairs):
        started = await_go()
        record, _ = train_step(run, TrainState(step=step))
        report_step(
            {
                "seconds": time.perf_counter() - started,
                "tokens": record["len/mean"] * args.prompts * args.group_size,
                "bf16": run.numerics.autocast_enabled,
                **{phase: record[f"time/{phase}"] for phase in PHASES},
            }
        )
    await_end()


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from atrctl.core.divergence import trust_region
    from atrctl.model.numerics import numerics
    from atrctl.tasks import get_task, problem_pool
    from atrctl.training.schedule import PROMPT_POOL, prompts_for_step

    recipe = recipe_for(args)
    task = get_task(recipe.task.name, **recipe.task.args)
    pool = problem_pool(task, "train", PROMPT_POOL, recipe.run.seed)
    total = args.warmup + args.pairs
    order = [i for step in range(total) for i in prompts_for_step(len(pool), step, args.prompts, recipe.run.seed)]
    dataset = Dataset.from_dict({"prompt": [pool[i].prompt for i in order], "index": order})
    tokens = []

    def reward(completions, completion_ids, index, **_):
        tokens.append(sum(len(ids) for ids in completion_ids))  # EOS included, as atrctl's completion mask
        return [task.score(pool[i], text).reward for i, text in zip(index, completions, strict=True)]

    per_rollout = args.minibatches * args.num_iterations  # TRL optimiser steps per generation batch
    phases = [dict.fromkeys(PHASES[:3], 0.0) for _ in range(total)]  # update = the rest of the step

    class Gate(TrainerCallback):
        """Holds the trainer before each rollout (its generation opens the first optimiser step of one) until
        the parent says go, and reports the rollout's step after its last optimiser step."""

        def __init__(self):
            self.rollout, self.started = 0, 0.0

        def on_train_begin(self, *_, **__):
            announce_ready()
            self.started = await_go()

        def on_step_end(self, _args, state, *__, **___):
            if state.global_step % per_rollout:
                return
            if cuda:  # the optimiser step's kernels may still be queued; atrctl's step timer synchronises too
                torch.cuda.synchronize()
            seconds, k = time.perf_counter() - self.started, self.rollout
            update = seconds - sum(phases[k].values())
            report_step({"seconds": seconds, "tokens": tokens[k], "bf16": bf16, **phases[k], "update": update})
            self.rollout += 1
            if self.rollout < total:
                self.started = await_go()
            else:
                await_end()

    gate = Gate()

    def record(context, duration: float) -> None:
        """TRL times its own blocks (for wandb); file them under atrctl's phase names, per rollout."""
        name = context.name.removeprefix("GRPOTrainer.")
        phase = {"transformers.generate": "rollout", "_calculate_rewards": "reward"}.get(name)
        if name == "_get_per_token_logps_and_entropies" and not torch.is_grad_enabled():
            phase = "logprobs"  # the old-logprob pass; the training forward runs with grad
        if phase:
            phases[min(gate.rollout, total - 1)][phase] += duration

    profiling.ProfilingContext._log_metrics = record

    low, high = trust_region(args.algo, **({"max_kl3": args.max_kl3} if args.algo == "atr" else {}))
    cuda = args.device == "cuda"
    width = AutoConfig.from_pretrained(args.model_dir).hidden_size  # bf16 exactly where atrctl's policy puts it
    bf16 = numerics(torch.device(args.device), policy=args.autocast, width=width).autocast_enabled
    config = GRPOConfig(
        output_dir=str(Path(args.scratch) / "trl-run"),
        use_cpu=not cuda,
        bf16=bf16,
        seed=recipe.run.seed,
        per_device_train_batch_size=args.prompts // args.minibatches * args.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=args.minibatches,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        num_iterations=args.num_iterations,
        max_steps=total * per_rollout,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        top_k=0,
        learning_rate=recipe.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused",
        weight_decay=recipe.optim.weight_decay,
        max_grad_norm=recipe.optim.grad_clip,
        gradient_checkpointing=False,
        beta=0.0,
        loss_type="dapo",
        epsilon=1.0 - low,
        epsilon_high=high - 1.0,
        scale_rewards="group",
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[gate],
    )
    trainer.train()


def counted_flops(work, args: argparse.Namespace) -> float:
    """Matrix-product FLOPs per step (rollout and update, forward and backward) of `work`, counted by torch's
    FlopCounterMode on every product, attention and the group-shared prompt's copies included: what each
    side has its cores multiply, measured rather than estimated from the shapes.  Run eagerly and untimed
    (the mode intercepts every operator; atrctl's compiled functions compute the same products)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        work(args)
    return counter.get_total_flops() / (args.warmup + args.pairs)


def worker_command(side: str, args: argparse.Namespace, model_dir: Path, scratch: Path) -> tuple[list[str], dict]:
    command = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--model-dir",
        str(model_dir),
        "--scratch",
        str(scratch),
        *[
            f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in {"worker", "model_dir", "scratch", "threads", "preset", "no_flops"} and v is not False
        ],
    ]
    env = {
        **os.environ,
        "ATRCTL_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return command, env


class Worker:
    """One side's process, alive for the whole run, taking a step only when told to."""

    def __init__(self, side: str, args: argparse.Namespace, model_dir: Path, scratch: Path):
        command, env = worker_command(side, args, model_dir, scratch)
        scratch.mkdir(parents=True)
        self.side, self.errors = side, scratch / "stderr.txt"
        with self.errors.open("w") as errors:  # a file, not a pipe: nobody reads it while the worker runs
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env
            )

    def wait_for(self, marker: str) -> str:
        """The worker's next stdout line starting with `marker` (other lines are the libraries' own prints)."""
        for line in self.process.stdout:
            if line.startswith(marker):
                return line[len(marker) :]
        self.fail()

    def step(self) -> dict:
        """Let the worker take one step; its report (seconds from go to done, tokens, phases)."""
        try:
            self.process.stdin.write(GO)
            self.process.stdin.flush()
        except OSError:  # it has died
            self.fail()
        return json.loads(self.wait_for(STEP))

    def close(self) -> None:
        try:
            self.process.communicate(timeout=300)  # closes its stdin, drains what the libraries print while ending
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.fail()
        if self.process.returncode:
            self.fail()

    def fail(self) -> None:
        code = self.process.wait()
        sys.exit(f"{self.side} worker failed ({code}):\n{self.errors.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def run_round(args: argparse.Namespace, model_dir: Path, scratch: Path) -> tuple[list[dict], float]:
    """Fresh workers for both sides, their unmeasured steps, then `args.pairs` pairs of steps; the pairs and
    atrctl's unmeasured seconds (with --compile, its compilation)."""
    workers = {side: Worker(side, args, model_dir, scratch / side) for side in SIDES}
    try:
        for worker in workers.values():  # both built (in parallel) before either takes a step
            worker.wait_for(READY)
        warmup = sum(workers["atrctl"].step()["seconds"] for _ in range(args.warmup))
        for _ in range(args.warmup):
            workers["trl"].step()
        pairs = []
        for pair in range(args.pairs):
            order = SIDES if pair % 2 == 0 else SIDES[::-1]
            pairs.append({side: workers[side].step() for side in order})
            a, t = (1.0 / pairs[-1][side]["seconds"] for side in SIDES)
            print(f"pair {pair + 1}: atrctl {a:.2f} steps/s, TRL {t:.2f} steps/s, ratio {a / t:.2f}", flush=True)
        for worker in workers.values():
            worker.close()
    finally:  # a failed side must not leave the other running on a deleted scratch directory
        for worker in workers.values():
            worker.kill()
    return pairs, warmup


def count_flops(side: str, args: argparse.Namespace, model_dir: Path, scratch: Path) -> float:
    """One short eager process per side, untimed, told to go through both its steps at once."""
    counting = argparse.Namespace(**{**vars(args), "count_flops": True, "compile": False, "warmup": 0, "pairs": 2})
    command, env = worker_command(side, counting, model_dir, scratch)
    done = subprocess.run(command, input=GO * 2, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        sys.exit(f"{side} FLOP count failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])["flops"]


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def breakdown(steps: list[dict]) -> dict[str, float]:
    """Mean seconds per step in each phase over every measured step; 'other' is the rest of the step."""
    mean = {phase: statistics.fmean(s[phase] for s in steps) for phase in PHASES}
    total = statistics.fmean(s["seconds"] for s in steps)
    return {**mean, "other": total - sum(mean.values()), "step": total}


def rates(pairs: list[dict[str, dict]]) -> dict[tuple[str, str], list[float]]:
    """(side, "steps" or "tokens") -> that side's steps/s or tokens/s in each pair."""
    return {
        (side, measure): [
            (pair[side]["tokens"] if measure == "tokens" else 1.0) / pair[side]["seconds"] for pair in pairs
        ]
        for side in SIDES
        for measure in ("steps", "tokens")
    }


def ratios(pairs: list[dict[str, dict]]) -> dict[str, list[float]]:
    """ "steps" or "tokens" -> atrctl's rate over TRL's, pair by pair."""
    per_s = rates(pairs)
    return {
        measure: [a / b for a, b in zip(per_s["atrctl", measure], per_s["trl", measure], strict=True)]
        for measure in ("steps", "tokens")
    }


def report(args: argparse.Namespace, pairs: list[dict[str, dict]], warmups: list[float], flops: dict | None) -> None:
    per_s, ratio = rates(pairs), ratios(pairs)
    print(
        f"\n{args.preset}, {args.prompts} prompts x {args.group_size}, max_new_tokens {args.max_new_tokens}, "
        f"{args.minibatches} mini-batches, mu {args.num_iterations}, loss {args.algo}, {args.threads} threads, "
        f"{args.device}, bf16 autocast: atrctl {pairs[0]['atrctl']['bf16']}, TRL {pairs[0]['trl']['bf16']}, "
        f"atrctl's old logprobs {args.old_logprobs}; {len(pairs)} pairs of steps ({args.rounds} rounds of fresh "
        f"processes), each side's step back to back with the other's, after {args.warmup} unmeasured steps per side "
        f"and round (median [min, max] over pairs)"
    )
    print(f"| {'':7} | {'steps/s':>20} | {'tokens/s':>26} |")
    print(f"|{'-' * 9}|{'-' * 22}|{'-' * 28}|")
    for side, name in (("atrctl", "atrctl"), ("trl", "TRL")):
        print(f"| {name:7} | {spread(per_s[side, 'steps']):>20} | {spread(per_s[side, 'tokens'], 0):>26} |")
    print(f"| {'ratio':7} | {spread(ratio['steps']):>20} | {spread(ratio['tokens']):>26} |")
    if args.compile:
        seconds = ", ".join(f"{warmup:.1f}" for warmup in warmups)
        print(f"\natrctl compiled its update and decoding (TRL eager); {args.warmup} unmeasured steps: {seconds} s")
    if flops:
        work = flops["trl"] / flops["atrctl"]
        speed = [r / work for r in ratio["steps"]]
        achieved = {side: spread([flops[side] * s / 1e9 for s in per_s[side, "steps"]]) for side in SIDES}
        print(
            f"\nmatrix-product work per step (FlopCounterMode, eager, 2 steps): atrctl {flops['atrctl'] / 1e9:.2f}, "
            f"TRL {flops['trl'] / 1e9:.2f} GFLOP, TRL/atrctl {work:.2f}x; achieved GFLOP/s per pair: "
            f"atrctl {achieved['atrctl']}, TRL {achieved['trl']}; "
            f"the ratio = work {work:.2f}x * speed per FLOP {spread(speed)}x"
        )
    print("\nstep breakdown, mean ms per step (share); TRL's from its own profiling blocks, its update = the rest")
    ours, theirs = (breakdown([pair[side] for pair in pairs]) for side in SIDES)
    print(f"  {'phase':9} {'atrctl':>16} {'TRL':>16}")
    for phase, seconds in ours.items():
        mine = f"{seconds * 1e3:8.1f} ({seconds / ours['step']:5.1%})"
        other = (
            "(in update)" if phase == "other" else f"{theirs[phase] * 1e3:8.1f} ({theirs[phase] / theirs['step']:5.1%})"
        )
        print(f"  {phase:9} {mine} {other:>16}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="tiny, small, medium or qwen2.5-0.5b-shape")
    parser.add_argument("--algo", default="atr", choices=["atr", "grpo"])
    parser.add_argument("--max-kl3", type=float, default=0.1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    parser.add_argument("--pairs", type=int, default=7, help="measured pairs of steps per round, one step per side")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="fresh processes for both sides this many times, --pairs each, all pairs pooled: a process can run "
        "in a slow or a fast mode for its whole life (seen on these VMs), which one pair of processes cannot sample",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--autocast",
        default="auto",
        choices=["auto", "bfloat16", "off"],
        help="atrctl's model.autocast; TRL gets bf16=True exactly where it resolves to bf16, so both compute alike",
    )
    parser.add_argument(
        "--old-logprobs",
        default="auto",
        choices=["auto", "sampler", "recompute"],
        help="atrctl's algo.old_logprobs (auto: the sampler's on a CPU, recomputed under bf16 on CUDA); TRL always "
        "recomputes them with several mini-batches",
    )
    parser.add_argument(
        "--skip-zero-advantage",
        action="store_true",
        help="let atrctl skip rows with advantage 0 (off: a fresh model earns no reward, so every row would be "
        "skipped and the comparison would be of no work against TRL's)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="atrctl's model.compile (its update passes, prefill and decoding steps, compiled in the unmeasured "
        "steps); TRL stays eager",
    )
    parser.add_argument("--worker", choices=["atrctl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-flops",
        action="store_true",
        help="skip the two extra (untimed) processes that count each side's matrix-product FLOPs per step",
    )
    parser.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    args = parse_with_smoke(
        parser,
        preset="tiny",
        prompts=2,
        group_size=2,
        max_new_tokens=4,
        minibatches=1,
        warmup=0,
        pairs=1,
        rounds=1,
        no_flops=True,
    )
    if min(args.pairs, args.rounds) < 1 or args.warmup < 0:
        parser.error("--pairs and --rounds must be at least 1 and --warmup at least 0")
    if args.worker:
        work = atrctl_worker if args.worker == "atrctl" else trl_worker
        if args.count_flops:
            print(RESULT + json.dumps({"flops": counted_flops(work, args)}), flush=True)
        else:
            work(args)
        return

    import importlib.util

    from common import save_model  # benchmarks/ is on sys.path when this file runs as a script

    if importlib.util.find_spec("trl") is None:
        print(
            'error: TRL is not installed; it is a benchmark-only extra: pip install torch==2.13.0 -e ".[bench]"',
            file=sys.stderr,
        )
        sys.exit(2)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model_dir = save_model(args.preset, scratch)
        pairs, warmups = [], []
        for round_ in range(args.rounds):
            round_pairs, warmup = run_round(args, model_dir, scratch / f"round-{round_}")
            pairs += round_pairs
            warmups.append(warmup)
            if args.rounds > 1:
                print(f"round {round_ + 1}: ratio {spread(ratios(round_pairs)['steps'])}", flush=True)
        flops = None
        if not args.no_flops:  # after the timed pairs, one short eager process per side
            flops = {side: count_flops(side, args, model_dir, scratch / f"flops-{side}") for side in SIDES}
        report(args, pairs, warmups, flops)


if __name__ == "__main__":
    main()
