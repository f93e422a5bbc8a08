"""Evaluating a model: n samples and a greedy completion per problem, scored by the task.

`evaluate_model` samples and scores, sharded over ranks under torchrun, and gives every world size the
same result; the figures themselves are `atrctl.core.passk`'s pure functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from atrctl.core.passk import EvalResult
from atrctl.core.seeds import derive_seed
from atrctl.rollout.prompts import PLAIN, PromptStyle
from atrctl.runtime import distributed
from atrctl.runtime.machine import check_fits

DEFAULT_KEEP = 4  # sampled completions per problem written to samples.jsonl (beside its greedy one)


# What holding one sample's outcome costs until the figures are computed: its reward and parsed answer as Python
# objects plus their list slots (~100 bytes measured with tracemalloc for short answers), rounded up for longer ones.
BYTES_PER_SAMPLE = 128


def check_samples_fit(problems: int, n: int, flag: str = "--n", problems_flag: str = "--problems") -> None:
    """Refuse, before a model is loaded or a file written, an evaluation whose problems × n outcomes could not
    be held in this machine's available memory (else it would run for hours and then be killed)."""
    check_fits(f"{problems} problems × {flag} {n} = {problems * n:,} samples", problems * n * BYTES_PER_SAMPLE,
               f"lower {flag} or {problems_flag}")  # fmt: skip


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
    engine_args: dict | None = None,
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
    on_progress(completions done, total) follows this process's share: each greedy block, then each chunk.
    """
    import torch

    from atrctl.model.memory import sized_batch
    from atrctl.model.numerics import numerics
    from atrctl.rollout.backend import rollout_backend
    from atrctl.rollout.prompts import check_lengths, encode_prompts, model_positions, prompt_text
    from atrctl.rollout.scoring import sampled_scores

    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    started = time.perf_counter()
    rank, world = distributed.shard()
    prompt_ids = encode_prompts(tokenizer, problems, style)
    check_lengths(prompt_ids, max_new_tokens, model_positions(model), "--max-new-tokens")
    batch_size = sized_batch(model, max((len(ids) for ids in prompt_ids), default=0) + max_new_tokens, batch_size)
    device = next(model.parameters()).device
    sampler = rollout_backend(backend, model, tokenizer, numerics(device, autocast=False), engine_args)  # its dtype

    def shown(i: int, label: str, texts: list[str], scores: list) -> list[dict]:
        """What samples.jsonl says of completions of problem i: enough to see why a score is what it is."""
        problem = problems[i]
        prompt = prompt_text(tokenizer, problem.prompt, style)
        return [completion_row(problem, prompt, label if label == "greedy" else j, text, score)
                for j, (text, score) in enumerate(zip(texts, scores, strict=True))]  # fmt: skip

    kept: dict[int, list[dict]] = {}
    greedy: dict[int, bool] = {}
    blocks = [range(f, min(f + batch_size, len(problems))) for f in range(0, len(problems), batch_size)]
    mine = sample_chunks(len(problems), n, batch_size)[rank::world]
    done, total = 0, sum(len(block) for block in blocks[rank::world]) + n * sum(len(chunk) for chunk in mine)

    def advance(completions: int) -> None:
        nonlocal done
        done += completions
        if on_progress is not None:
            on_progress(done, total)

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
        advance(len(block))

    sampled: dict[int, tuple] = {}  # problem -> (rewards, parsed, forms, (nats, tokens) per sample)
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
        advance(n * len(chunk))

    sampler.join_peers()  # ranks with fewer chunks take part in the others' engine calls
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
