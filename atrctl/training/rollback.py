"""The last good state of a run: weights and optimiser state from before its latest update.

An update can leave finite weights whose policy can no longer be sampled (logits overflow:
non-finite probabilities), which only the next sampling reveals, or a mini-batch can turn out
non-finite after others of the same step were applied.  Either way the run goes back to this copy,
so a bad step changes nothing and a diverging run stops through `run.max_bad_steps` on weights
that sample.  The copy lives in host memory (one device→host copy per update, buffers reused), so
an accelerator holds no second model.
"""

from __future__ import annotations

import torch

from atrctl.training.sharding import local_part, optimizer_parameters


class Snapshot:
    """One copy of the trained parameters (the optimiser's: LoRA adapters alone where the base is frozen) and
    the optimiser's per-parameter state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.held = False  # whether the copy is one the run can go back to
        self._weights: list[torch.Tensor] = []
        self._states: list[dict[str, torch.Tensor] | None] = []  # None: the parameter had no state yet

    def take(self) -> None:
        """Copy the current weights and optimiser state (into the buffers of the last copy when they fit)."""
        params = optimizer_parameters(self.optimizer)
        if len(self._weights) != len(params):
            self._weights = [_host_buffer(p) for p in params]
        for buffer, param in zip(self._weights, params, strict=True):
            buffer.copy_(local_part(param.detach()), non_blocking=True)
        old = self._states if len(self._states) == len(params) else [None] * len(params)
        self._states = [_copy_state(self.optimizer.state.get(p), into) for p, into in zip(params, old, strict=True)]
        if self._weights and self._weights[0].is_pinned():
            torch.cuda.synchronize()  # the non-blocking copies have landed before the weights change
        self.held = True

    def restore(self) -> None:
        """Put the copy back: weights and optimiser state as they were when it was taken.  It is used up:
        the run holds no older state to go back to."""
        assert self.held, "restore() without a snapshot"
        with torch.no_grad():
            params = optimizer_parameters(self.optimizer)
            for param, buffer, saved in zip(params, self._weights, self._states, strict=True):
                local_part(param).copy_(buffer)
                if saved is None:  # an optimiser that had not stepped this parameter yet starts it afresh
                    self.optimizer.state.pop(param, None)
                else:
                    live = self.optimizer.state[param]  # AdamW keeps a parameter's state once it has one
                    for key, value in saved.items():
                        local_part(live[key]).copy_(value)
        self.held = False


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    tensor = local_part(tensor)
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return buffer.pin_memory() if tensor.is_cuda else buffer


def _copy_state(state: dict | None, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A host copy of one parameter's optimiser state (tensors only: AdamW's moments and step)."""
    if not state:
        return None
    copied = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimiser state {key!r} is not a tensor; rollback cannot copy it")
        reuse = into.get(key) if into else None
        if reuse is not None and reuse.shape == local_part(value).shape and reuse.dtype == value.dtype:
            copied[key] = reuse.copy_(local_part(value.detach()), non_blocking=True)
        else:
            copied[key] = _host_buffer(value).copy_(local_part(value.detach()))
    return copied
