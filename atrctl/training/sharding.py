"""FSDP2 sharding of the policy over torchrun's processes (`model.shard = "fsdp"`).

Data parallelism replicates weights, gradients and AdamW's two moments on every process: ~16 bytes per
parameter.  Sharded with PyTorch's own FSDP2 (`fully_shard`: one unit per decoder layer, then the root,
which holds the embedding, final norm and output projection), each process keeps 1/N of all of them
and gathers a layer's full weights only while it computes with that layer.

What changes around the model, and why:
- Every forward and backward pass is a collective (a layer's all-gather, its gradients'
  reduce-scatter), so every rank must run the same passes in the same order whatever its rows: the
  update pads a rank's short list of micro-batches with passes that contribute nothing
  (`train.update_step`), and the forward pass runs the root model once per micro-batch
  (`forward._completion_states`).
- Sampling does not: a rank samples its prompts, and rank 0 alone runs the held-out checks, so a
  rollout cannot wait for the other ranks at every token.  The sampler keeps a full, unsharded copy of
  the policy (`GatheredSampler`), refreshed by one all-gather per parameter after each update: the
  weights it samples are exactly the trained ones.  Under bf16 autocast its linear layers' weights are
  kept in bf16, the dtype autocast would cast them to anyway (the same rounding, so the same samples):
  ~2 bytes per parameter more per process instead of 4.  The final model is gathered from the float32
  shards, never taken from this copy.
- FSDP averages gradients over ranks by default, while atrctl's loss is already scaled by the global
  normaliser, so the ranks' gradients are to be summed (`train._optimiser_step`): every unit reduces
  with a plain SUM (divide factor 1, sum-only collectives, which gloo and NCCL both have), exact for any N.
- Checkpoints gather the full weights and optimiser state to rank 0, which writes the same files as an
  unsharded run; a resume scatters them again, at any N.
"""

from __future__ import annotations

import copy

import torch

from atrctl.errors import UserError
from atrctl.model.numerics import linears_autocast_casts
from atrctl.runtime import distributed


def check_can_shard(shard: str, world: int, lora: bool, compiled: bool = False) -> None:
    """Fail before any work: sharding needs several processes, and is not combined with LoRA or compiling."""
    if shard != "fsdp":
        return
    if world < 2:
        raise UserError(
            'model.shard = "fsdp" needs several processes to shard over: run with --nproc N (or under '
            'torchrun), or set model.shard = "none"'
        )
    if lora:
        raise UserError(
            'model.shard = "fsdp" with model.lora is not supported: LoRA keeps the base frozen, so shard '
            'nothing (model.shard = "none") or train every weight sharded (model.lora = {})'
        )
    if compiled:
        raise UserError(
            'model.shard = "fsdp" with model.compile = true is not supported: a sharded pass gathers its weights '
            "layer by layer, outside the compiled function; set model.compile = false"
        )


def shard_model(model: torch.nn.Module, bf16: bool) -> torch.nn.Module:
    """Shard `model` in place over the process group: each decoder layer, then the root; the shards move to
    the group's device (a model loaded on the host arrives there in shards).  `bf16`: gather the layers'
    weights in bf16 and reduce gradients in float32 (CUDA; autocast does the rest), the float32 master
    weights staying sharded; otherwise everything stays float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from atrctl.model.forward import head_is_linear

    head_is_linear(model)  # settled now: its probe runs the decoder alone, which a sharded root cannot
    # inputs are not cast: the residual stream stays float32 between layers, as in an unsharded run under autocast
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    policy = policy if bf16 else None
    options = {"mp_policy": policy} if policy else {}
    for unit in [*decoder_layers(model), model]:  # the root last: embedding, norm and head stay float32
        fully_shard(unit, **(options if unit is not model else {}))
        unit.set_gradient_divide_factor(1.0)  # sum the ranks' gradients, not their mean
        unit.set_force_sum_reduction_for_comms(True)  # ... with SUM itself: a factor of 1 otherwise needs PREMUL_SUM
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's repeated blocks (`model.model.layers` in transformers' decoder-only models)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(
            f'model.shard = "fsdp": {type(model).__name__} has no list of decoder layers to shard; use '
            'model.shard = "none"'
        )
    return list(layers)


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters an optimiser steps, in its order: what trains (LoRA: the adapters) as it is stored
    (sharded: the DTensors, which a module can swap for gathered tensors between passes)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a sharded tensor (the tensor itself when it is not one)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor on every rank (a collective); the tensor itself when it is not one."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class GatheredSampler:
    """A rollout backend sampling a full copy of a sharded policy, so that sampling runs without collectives.
    `load_weights(policy)` (every rank, after each update) copies the policy's gathered weights into it."""

    def __init__(self, backend, full_copy: torch.nn.Module):
        self.backend, self.full_copy = backend, full_copy

    @property
    def logprobs_reusable(self) -> bool:
        return self.backend.logprobs_reusable

    def generate(self, *args, **kwargs):
        return self.backend.generate(*args, **kwargs)

    def join_peers(self) -> None:
        self.backend.join_peers()

    def load_weights(self, policy: torch.nn.Module) -> None:
        with torch.no_grad():
            for (name, sharded), (own, kept) in zip(
                policy.named_parameters(), self.full_copy.named_parameters(), strict=True
            ):
                assert name == own, f"{name} != {own}"
                kept.copy_(full_tensor(sharded.detach()))
        self.backend.load_weights(self.full_copy)


def full_copy(model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """An unsharded copy of `model`, taken before it is sharded (on the host, see `train.build_run`): what
    `GatheredSampler` samples.  With `autocast_dtype` (the run's bf16 autocast) every linear layer's weight
    and bias are stored in it: autocast casts them so before each product, so the copy computes exactly
    what the float32 one would, in half its memory.  A weight tied to the input embedding stays float32
    (the embedding's lookup is not cast); so do norms and everything else autocast leaves alone.  The copy
    then runs under that autocast only (the rollout backend's passes do): outside it the dtypes clash."""
    duplicate = copy.deepcopy(model)
    duplicate.requires_grad_(False)
    if autocast_dtype is not None:
        for module in linears_autocast_casts(duplicate):
            module.to(autocast_dtype)
    return duplicate


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full float32 state dict of a sharded model on the CPU of rank 0, None on the others (a collective:
    every rank calls it).  Tied entries (a head tied to the embedding) stay one tensor, as save_pretrained
    expects of them."""
    main = distributed.is_main()
    weights, seen = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves: ties visible
        if id(tensor) not in seen:
            whole = full_tensor(tensor.detach())
            seen[id(tensor)] = whole.to("cpu").contiguous() if main else None
        if main:
            weights[name] = seen[id(tensor)]
    return weights if main else None


def full_contents(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(full weights on the CPU, optimiser state in `optimizer.state_dict()`'s layout with full tensors) on
    rank 0, None on the others: one all-gather per tensor, every rank in the same order."""
    main, weights = distributed.is_main(), gathered_weights(model)
    state = optimizer.state_dict()
    gathered = {}
    for index in sorted(state["state"]):
        entry = {}
        for key, value in state["state"][index].items():
            whole = full_tensor(value) if isinstance(value, torch.Tensor) else value
            if main:
                entry[key] = whole.to("cpu") if isinstance(whole, torch.Tensor) else whole
        gathered[index] = entry
    return (weights, {"state": gathered, "param_groups": state["param_groups"]}) if main else None


def load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put full weights (every rank holds them) into a sharded model: each rank keeps its part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load an optimiser state of full tensors (`full_contents`' layout) into the optimiser of a sharded
    model: each parameter's moments are cut as the parameter is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = optimizer_parameters(optimizer)
    state = {}
    for index, entry in saved["state"].items():
        param = params[index]
        state[index] = {
            key: distribute_tensor(value.to(local_part(param).device), param.device_mesh, param.placements)
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def memory_line(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampled: torch.nn.Module) -> str:
    """What this rank holds of the trained parameters, their gradients and AdamW's state, against the whole
    (what one process holds unsharded), and the sampler's full copy (`sampled`), measured from the tensors."""
    params = optimizer_parameters(optimizer)
    tensors = [*params, *(p.grad for p in params if p.grad is not None)]
    tensors += [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    here = sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)
    whole = sum(t.numel() * t.element_size() for t in tensors)  # a sharded tensor's numel is the whole one's
    return (
        f"model.shard = fsdp over {distributed.world_size()} processes: rank {distributed.rank()} holds "
        f"{here / 2**20:.1f} MiB of parameters, gradients and AdamW state, {here / whole:.2f} of the "
        f"{whole / 2**20:.1f} MiB each process would hold unsharded (+ {_bytes(sampled) / 2**20:.1f} MiB of "
        "full weights for sampling)"
    )


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
