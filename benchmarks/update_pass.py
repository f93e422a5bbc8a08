"""The update's forward and backward through transformers' model against atrctl's own pass.  Not a test.

`forward._completion_states` gives the decoder's states at every completion token, the graph kept for
the backward.  Two ways compute the same numbers (tested to 1e-6, gradients included): transformers'
`LlamaModel.forward` twice (each group's prompt once, then the completions on its KV cache), and
`decoder_pass.decoder_states`, atrctl's loop over the model's own layers with the prompts' and the
completions' positions as one matrix through every position-wise step.  Which one a Llama/Qwen2 policy
takes by default follows from this measurement.  One micro-batch of the default recipe's shape per
model: groups of G rows sharing a prompt, completions of random lengths; forward and backward of a
weighted sum of the states.  Pairs alternate which side runs first; the ratio is taken within each pair.

    python benchmarks/update_pass.py                                # tiny and medium, 10 pairs
    python benchmarks/update_pass.py --models smollm2-135m --rows 8 --prompt 32 --new-tokens 64
    python benchmarks/update_pass.py --compiled                     # a third side: the pass compiled
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fresh_models import REAL_VOCABULARY_SHAPES, real_vocabulary_shape  # benchmarks/ is on sys.path

from atrctl import decoder_pass
from atrctl.forward import _completion_outputs
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.rollout import Rollout


def build(name: str):
    if name in REAL_VOCABULARY_SHAPES:
        return real_vocabulary_shape(name).train()
    return build_model(name, build_char_tokenizer(), seed=0).train()


def micro_batch(vocab: int, rows: int, group: int, prompt: int, new_tokens: int, seed: int = 0) -> Rollout:
    """`rows` completions in groups of `group` sharing a prompt of `prompt` tokens; lengths 1..new_tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows // group, prompt), generator=g).repeat_interleave(group, 0)
    completions = torch.randint(3, vocab, (rows, new_tokens), generator=g)
    lengths = torch.randint(1, new_tokens + 1, (rows, 1), generator=g)
    lengths[0] = new_tokens  # the longest row sets the width, as a trimmed micro-batch's does
    mask = (torch.arange(new_tokens)[None] < lengths).long()
    return Rollout(prompts, torch.ones_like(prompts), completions * mask, mask, torch.zeros(rows, new_tokens))


def last_hidden_state(out):
    return out.last_hidden_state


def measure(name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of one forward + backward per side and pair."""
    model = build(name)
    rollout = micro_batch(model.config.vocab_size, args.rows, args.group, args.prompt, args.new_tokens)
    weights = torch.randn(args.rows, args.new_tokens, model.config.hidden_size) * rollout.completion_mask[..., None]
    sides = {
        "transformers": lambda: _completion_outputs(model.get_decoder(), rollout, last_hidden_state, False),
        "atrctl": lambda: decoder_pass.update_states(model, rollout),
    }
    if args.compiled:
        compiled = build(name)
        compiled.load_state_dict(model.state_dict())
        decoder_pass.compile_policy(compiled)
        sides["compiled"] = lambda: decoder_pass.update_states(compiled, rollout)

    def seconds(side: str) -> float:
        started = time.perf_counter()
        for _ in range(args.repeats):
            (sides[side]() * weights).sum().backward()
        return (time.perf_counter() - started) / args.repeats

    for side in sides:  # unmeasured: allocator warm-up, and the compilation
        seconds(side)
    times = {side: [] for side in sides}
    for pair in range(args.pairs):
        for side in list(sides) if pair % 2 == 0 else list(sides)[::-1]:
            times[side].append(seconds(side))
    return times


def report(name: str, times: dict[str, list[float]]) -> None:
    print(f"\n{name}: forward + backward of one micro-batch, ms, median [min, max]")
    for side, values in times.items():
        line = f"  {side:13} {statistics.median(values) * 1e3:9.2f} [{min(values) * 1e3:.2f}, {max(values) * 1e3:.2f}]"
        if side != "transformers":
            ratios = [t / base for t, base in zip(values, times["transformers"], strict=True)]
            line += f"   / transformers' {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], help="presets or real-vocabulary shapes")
    parser.add_argument("--rows", type=int, default=128, help="the default recipe's mini-batch: 64 × 8 / 4")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=9, help='"407+058=" and BOS: the default task\'s prompt')
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="passes timed per side and pair (their mean)")
    parser.add_argument("--compiled", action="store_true", help="also time decoder_states compiled")
    args = parser.parse_args()
    set_cpu_threads()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rows} rows in groups of "
          f"{args.group}, {args.prompt} prompt + 1..{args.new_tokens} new tokens, {args.pairs} pairs")  # fmt: skip
    for name in args.models:
        report(name, measure(name, args))


if __name__ == "__main__":
    main()
