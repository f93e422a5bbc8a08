#!/usr/bin/env bash
# Prepared GPU checks, each at most 5 minutes (the timeouts below); run from anywhere, everything goes to stdout.
#   benchmarks/gpu_check.sh [scaling]   step time, tokens/s, MFU and peak GPU memory of the default recipe on the
#                                       tiny, medium and Qwen2.5-0.5B-shaped models (bf16 autocast, 64 prompts x 8,
#                                       256 new tokens, EOS suppressed), then the CUDA tests (one GPU; model.compile
#                                       among them: compiled update and decoding equal to eager on the GPU)
#   benchmarks/gpu_check.sh shard       a few FSDP2-sharded steps of the Qwen2.5-0.5B shape over every GPU of the
#                                       machine (two or more), then LoRA on one GPU: tokens/s, MFU, peak memory per rank
#   benchmarks/gpu_check.sh vllm        on a machine with vLLM's CUDA build: the vllm backend's tests (its logprobs
#                                       against the training pass, weight sync, seeds, EOS, LoRA), then rollout
#                                       tokens/s of vllm against hf on the Qwen2.5-0.5B shape (bf16 and float32)
#
# The machine needs a CUDA torch.  Anything else atrctl needs that is missing there travels as wheels in
# .whl/ (benchmarks/gpu_wheels.sh downloads them where pip has a registry: at least transformers 5.24 for
# the `cache=` argument, and what that pulls in); they are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
case "${1:-scaling}" in
scaling)
    timeout 230 python3 benchmarks/scaling.py --no-cpu --gpu --steps 2
    timeout 60 python3 -m pytest -q -m gpu tests || true
    ;;
shard)
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" -ge 2 ]; then
        timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/shard_check.py
    else
        echo "one GPU: FSDP needs two or more (nccl puts one process on each); sharded steps skipped"
    fi
    timeout 100 python3 benchmarks/shard_check.py --lora
    ;;
vllm)
    python3 -c "import vllm" || { echo "no vLLM here: pip install vllm==0.32.0 (it pins torch 2.13.0)" >&2; exit 2; }
    timeout 200 python3 -m pytest -q -m vllm tests || true
    timeout 200 python3 benchmarks/backends.py --models qwen2.5-0.5b-shape --prompts 64 --tokens 256 --steps 0
    ;;
*)
    echo "usage: benchmarks/gpu_check.sh [scaling|shard|vllm]" >&2
    exit 2
    ;;
esac
