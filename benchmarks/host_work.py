"""Host work around the model passes: two pieces of a step, each timed against the way it was done before.

Not a test.  Each pair times both ways in one process, alternating which goes first; the ratio is the old
way's time / the new one's within each pair (> 1: the new way is faster), median [min, max] over pairs.

- completions: the step's texts, `tokenizer.decode` row by row against `rollout.decode_completions` (one
  call into the Rust tokenizer), on the default recipe's 512 rows of the character tokenizer and of
  SmolLM2's 49k BPE (tests/data), with random lengths up to `--new-tokens`.
- rotary: a tiny micro-batch's rotary phases (16 prompts of 9 tokens, 128 completions), computed by the
  model's rotary module per pass against `decoder_pass.rotary`'s table lookup.

    python benchmarks/host_work.py
    python benchmarks/host_work.py --new-tokens 8 64 256 --pairs 9
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from atrctl import decoder_pass
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.rollout import Rollout, decode_completions, position_ids

TOKENIZER = Path(__file__).parent.parent / "tests" / "data" / "smollm2-tokenizer"


def per_call(function: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls


def paired(old: Callable[[], object], new: Callable[[], object], pairs: int, calls: int) -> tuple[float, float, list]:
    """(median old ms, median new ms, old/new ratio per pair)."""
    for function in (old, new):
        per_call(function, 3)  # warm
    olds, news = [], []
    for pair in range(pairs):
        order = [(old, olds), (new, news)] if pair % 2 == 0 else [(new, news), (old, olds)]
        for function, times in order:
            times.append(per_call(function, calls))
    ratios = [o / n for o, n in zip(olds, news, strict=True)]
    return statistics.median(olds) * 1e3, statistics.median(news) * 1e3, ratios


def smollm2_tokenizer(scratch: Path):
    from transformers import AutoTokenizer

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, scratch / name)
    (scratch / "tokenizer.json").write_bytes(gzip.decompress((TOKENIZER / "tokenizer.json.gz").read_bytes()))
    return AutoTokenizer.from_pretrained(scratch)


def completions(tokenizer, rows: int, width: int) -> Rollout:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tokenizer), (rows, width), generator=generator)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return Rollout(ids[:, :1], torch.ones(rows, 1, dtype=torch.long), ids, mask, torch.zeros(rows, width))


def row_by_row(tokenizer, rollout: Rollout) -> list[str]:
    lengths = rollout.completion_mask.sum(-1).tolist()
    rows = rollout.completion_ids.tolist()
    return [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths, strict=True)]


def report(name: str, old_ms: float, new_ms: float, ratios: list[float]) -> None:
    print(
        f"| {name} | {old_ms:.3f} | {new_ms:.3f} | "
        f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    print(f"{args.pairs} alternating pairs, {args.threads} threads; ratio = old time / new time per pair\n")
    print("| piece | old ms | new ms | ratio, median [min, max] |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tokenizers = {"character": build_char_tokenizer(), "SmolLM2 BPE": smollm2_tokenizer(Path(scratch))}
        for name, tokenizer in tokenizers.items():
            for width in args.new_tokens:
                rollout = completions(tokenizer, args.rows, width)
                assert row_by_row(tokenizer, rollout) == decode_completions(tokenizer, rollout)
                result = paired(
                    lambda t=tokenizer, r=rollout: row_by_row(t, r),
                    lambda t=tokenizer, r=rollout: decode_completions(t, r),
                    args.pairs,
                    calls=20,
                )
                report(f"decode {args.rows} completions, {name}, <= {width} tokens", *result)

    decoder = build_model("tiny", build_char_tokenizer()).get_decoder()
    mask = torch.ones(128, 9 + 7, dtype=torch.long)
    positions = position_ids(mask)
    flat = torch.cat([positions[::8, :9].flatten(), positions[:, 9:].flatten()])  # prompts once, then completions
    embeddings = decoder.embed_tokens.weight.detach()

    def per_pass():
        return decoder.rotary_emb(embeddings[:1], flat.reshape(1, -1))

    def looked_up():
        return decoder_pass.rotary(decoder, flat, below=mask.shape[1])

    want, got = per_pass(), looked_up()
    assert all(torch.equal(w[0], g) for w, g in zip(want, got, strict=True))
    report("rotary phases of a tiny micro-batch (1040 positions)", *paired(per_pass, looked_up, args.pairs, 200))


if __name__ == "__main__":
    main()
