"""`atrctl import-gguf`: a GGUF file (llama.cpp's format, what many packages ship) as an ordinary Hugging Face
model directory, for machines without hub access.

transformers reads GGUF (with the `gguf` package) and dequantises the weights to float32, but then refuses
to save a model "quantized with gguf"; the quantizer is dropped, the model saved in a staging directory,
reloaded from there and checked to give the very same logits as the loaded one on a fixed prompt before the
directory is renamed into place.  The staging directory goes on any exit, SIGTERM included; one that a
SIGKILL left behind is removed by the next import to the same --out.  A quantised file stays quantised in
spirit: the float32 weights are the dequantised 4- or 8-bit values, not the original model's.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from atrctl.errors import UserError, first_line
from atrctl.files.destinations import check_destination, writing

CHECK_PROMPT = "What is 12 + 30? Answer:"


def import_gguf(file: Path, out: Path, overwrite: bool = False) -> dict:
    """Convert `file` into the model directory `out`; returns what was checked (parameters, max |Δlogit|)."""
    file, out = Path(file).expanduser(), Path(out).expanduser()
    if not file.is_file() or file.suffix.lower() != ".gguf":
        raise UserError(f"{file} is not a .gguf file: give the path of one")
    check_destination(out, "--out", replace=overwrite)  # before the half minute of loading
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
    remove_stale_staging(out)
    with _sigterm_unwinds(), _staging(out) as staging:
        with writing(out):
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
    return {
        "directory": str(out),
        "architecture": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary": len(tokenizer),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "max_logit_difference": difference,
    }


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.import-"


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A hidden staging directory beside `out`, locked (flock) while this import lives so that another one can
    tell it from a stale one; removed on any exit unless renamed into place."""
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(out), dir=out.parent))
    handle = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left once renamed to `out`
        os.close(handle)


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging directories beside `out` that no running import holds (a SIGKILL left them, some
    hundreds of MB each); returns them."""
    removed = []
    for stale in sorted(Path(p) for p in glob.glob(glob.escape(str(out.parent / _staging_prefix(out))) + "*")):
        try:
            handle = os.open(stale, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another import is writing it
            continue
        else:
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
        finally:
            os.close(handle)
    return removed


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (`kill`, a job scheduler) unwinds like Ctrl-C for the block, so that cleanup runs either way."""
    if threading.current_thread() is not threading.main_thread():  # Python allows handlers there only
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
