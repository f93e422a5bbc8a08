"""The training-side figures docs/findings.md quotes for this study, from the runs' metrics.jsonl: per arm,
the mean [lowest, highest] over its seeds of each seed's figure.  Entropy is averaged over the steps a seed
logged it in (a step whose every group was all right or all wrong trains nothing and logs none).

    python results/published/smollm2-offpolicy/training_figures.py [study folder]
"""

import collections
import json
import sys
from pathlib import Path

import numpy as np

study = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
seeds = collections.defaultdict(list)
for run in sorted(study.glob("runs/*-s[0-9]*")):
    seeds[run.name.rsplit("-s", 1)[0]].append([json.loads(line) for line in (run / "metrics.jsonl").open()])


def mean(records, key, first=1, last=10**9):
    return np.mean([r[key] for r in records if key in r and first <= r["step"] <= last])


FIGURES = {
    "entropy, steps 1-5": lambda rs: mean(rs, "entropy", 1, 5),
    "entropy, steps 16-20": lambda rs: mean(rs, "entropy", 16, 20),
    "outside own region": lambda rs: mean(rs, "clip/region"),
    "clip/low + clip/high": lambda rs: mean(rs, "clip/low") + mean(rs, "clip/high"),
    "largest ratio": lambda rs: max(r["ratio/max"] for r in rs if "ratio/max" in r),
    "smallest ratio": lambda rs: min(r["ratio/min"] for r in rs if "ratio/min" in r),
    "largest kl3": lambda rs: max(r["kl3/max"] for r in rs if "kl3/max" in r),
}
print("| arm | seeds | " + " | ".join(FIGURES) + " |")
print("|---" * (len(FIGURES) + 2) + "|")
for arm, runs in seeds.items():
    cells = []
    for figure in FIGURES.values():
        values = np.array([figure(records) for records in runs])
        cells.append(f"{values.mean():.3g} [{values.min():.3g}, {values.max():.3g}]")
    print(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
