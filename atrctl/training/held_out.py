"""The held-out check a run makes every eval.every steps: greedy accuracy and sampled pass@1 on fixed problems."""

from __future__ import annotations

import torch

from atrctl.rollout.scoring import mean_reward, sampled_scores
from atrctl.training.setup import Run

SHOWN_PROBLEMS = 8  # held-out problems whose greedy and first sampled completions go to samples/step-<N>.jsonl


def held_out_metrics(run: Run, shown: list[dict] | None = None) -> dict[str, float]:
    """Held-out greedy accuracy and sampled pass@1, on the same problems and sample seed every time; the
    greedy and first sampled completions of the first SHOWN_PROBLEMS are appended to `shown` when given."""
    from atrctl.rollout.evaluate import completion_row
    from atrctl.rollout.prompts import prompt_text

    cfg = run.recipe.eval
    greedy_texts: list[list[str]] = []
    sampled_texts: list[list[str]] = []
    greedy = sampled_scores(
        run.sampler,
        run.tokenizer,
        run.task,
        run.held_out,
        run.held_out_ids,
        samples=1,
        max_new_tokens=run.recipe.rollout.max_new_tokens,
        greedy=True,
        batch_size=run.eval_batch,
        texts=greedy_texts,
    )
    generator = torch.Generator(run.device).manual_seed(cfg.seed)
    sampled = sampled_scores(
        run.sampler,
        run.tokenizer,
        run.task,
        run.held_out,
        run.held_out_ids,
        samples=cfg.samples,
        max_new_tokens=run.recipe.rollout.max_new_tokens,
        temperature=cfg.temperature,
        generator=generator,
        batch_size=run.eval_batch,
        texts=sampled_texts,
    )
    if shown is not None:
        for i, problem in enumerate(run.held_out[:SHOWN_PROBLEMS]):
            prompt = prompt_text(run.tokenizer, problem.prompt, run.style)
            shown.append(completion_row(problem, prompt, "greedy", greedy_texts[i][0], greedy[i][0]))
            shown.append(completion_row(problem, prompt, 0, sampled_texts[i][0], sampled[i][0]))
    return {"eval/greedy": mean_reward(greedy), "eval/pass@1": mean_reward(sampled)}
