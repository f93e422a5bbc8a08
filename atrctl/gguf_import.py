"""`atrctl import-gguf`: a GGUF file (llama.cpp's format, what many packages ship) as an ordinary Hugging Face
model directory, for machines without hub access.

transformers reads GGUF (with the `gguf` package) and dequantises the weights to float32, but then refuses
to save a model "quantized with gguf"; the quantizer is dropped, the model saved in a staging directory,
reloaded from there and checked to give the very same logits as the loaded one on a fixed prompt before the
directory is renamed into place.  A quantised file stays quantised in spirit: the float32 weights are the
dequantised 4- or 8-bit values, not the original model's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from atrctl.errors import UserError, first_line

CHECK_PROMPT = "What is 12 + 30? Answer:"


def import_gguf(file: Path, out: Path, overwrite: bool = False) -> dict:
    """Convert `file` into the model directory `out`; returns what was checked (parameters, max |Δlogit|)."""
    file, out = Path(file).expanduser(), Path(out).expanduser()
    if not file.is_file() or file.suffix.lower() != ".gguf":
        raise UserError(f"{file} is not a .gguf file: give the path of one")
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists: pass --overwrite to replace it, or choose another --out")
    if out.exists() and not (out / "config.json").is_file():  # --overwrite replaces a model, nothing else
        raise UserError(f"{out} exists and is not a model directory (no config.json): choose another --out")
    try:
        import accelerate  # noqa: F401 - transformers needs both to read GGUF
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(
            "reading GGUF needs the gguf and accelerate packages: pip install torch==2.13.0 'atrctl[gguf]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=torch.float32, use_kernels=False
        )
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as error:  # an architecture transformers cannot read from GGUF, a damaged file, ...
        raise UserError(f"transformers cannot load {file} ({first_line(error)})") from None
    model.hf_quantizer = None  # what makes save_pretrained refuse; the weights are already plain float32
    model.config.__dict__.pop("quantization_config", None)
    model.eval()
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32, use_kernels=False).eval()
        with torch.no_grad():
            difference = (model(ids).logits - reloaded(ids).logits).abs().max().item()
        if difference != 0.0:
            raise UserError(f"the saved model's logits differ from the loaded one's by {difference:g}; not written")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {
        "directory": str(out),
        "architecture": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary": len(tokenizer),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "max_logit_difference": difference,
    }
