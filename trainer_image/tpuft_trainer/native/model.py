"""The model on the mesh without a whole copy on any process: built on the meta device, FSDP2's
``fully_shard`` on every decoder layer and at the root, then each process reads only its shards'
slices of the safetensors files.

1. ``loading.py``'s empty model (parameters on meta; buffers such as the rotary ``inv_freq``, which no
   checkpoint holds, computed by the constructor), gradient checkpointing if configured;
2. with a ``tensor`` axis, tensor parallelism by transformers' own plan for the model (``tp_plan``:
   the config's ``base_model_tp_plan``, Megatron-style q/k/v and gate/up column-wise, o and down
   row-wise, plus a vocabulary-parallel embedding and an LM head whose logits are gathered) applied
   by transformers' ``apply_tensor_parallelism`` on the tensor sub-mesh: those weights become
   DTensors split over ``tensor`` and the modules' forwards exchange activations over it;
3. ``fully_shard`` per decoder layer (the classes ``fsdp_v2.resolve_layer_classes`` names, as the xla
   backend wraps) and on the root, over the fsdp (and replicate) dims: parameters become DTensors
   sharded on dim 0 over ``fsdp`` (2-D with ``tensor``: FSDP2 shards each process's tensor slice);
4. the parameters are materialised empty on the device (buffers kept), and
   ``torch.distributed.checkpoint`` with ``HuggingFaceStorageReader`` fills each process's shards from
   the files (reading slices, of 2-D placements too). A full fine-tune resuming from a checkpoint skips this: the
   checkpoint holds every weight.

With ``method: lora`` peft's adapter is added to the meta model before step 2 (lora.py: the same
LoraConfig as the xla backend), so FSDP2 shards each adapter with its decoder layer (a unit of
frozen base weights and trainable adapter weights: FSDP2 reduces gradients of the trainable ones
only). The base weights are read from the files under the base model's names; the adapter's first
weights are lora.py's, drawn whole from the seed on every process and cut into its shards here. A
resumed LoRA run reads the base weights from the source too: its checkpoints hold the adapter only.
A model whose weights are not under its own names in safetensors files is read whole with
``from_pretrained`` and then sharded (loading.py says why, in the log).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuft_trainer import data, export, fsdp_v2, loading, lora
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.errors import ConfigError
from tpuft_trainer.native.runtime import Runtime

log = logging.getLogger(__name__)

# The styles of transformers' tensor-parallel plans this backend has verified under FSDP2 (a Llama's
# plan: losses, gradients and the sliced load against an unsharded run, tests/trainer/test_native.py).
# A plan with any other (Qwen3's per-head norms' "replicated_with_grad_allreduce", MoE experts, packed
# projections) is refused rather than trained unverified.
VERIFIED_STYLES = frozenset({"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"})


@dataclass(frozen=True)
class Built:
    model: Any
    sharded_load: bool  # False: from_pretrained on every process (``why``)
    why: str
    layer_classes: list[str]
    wrapped_layers: int


def build(config: TrainerConfig, runtime: Runtime, *, weights: bool) -> Built:
    """The model of ``config`` sharded over ``runtime.mesh``; ``weights=False`` leaves the parameters
    uninitialised (a resumed full fine-tune loads every one from its checkpoint)."""
    import torch
    from transformers import AutoConfig

    source = config.model
    directory = loading.local_files(source, data.model_location(source))
    try:
        hf_config = AutoConfig.from_pretrained(directory, token=data.token(source))
    except Exception as error:
        raise data.hub_errors(error, f"model {source.name}") from error
    hf_config.use_cache = False
    dtype = getattr(torch, source.dtype)
    model = loading._empty_model(hf_config, dtype)
    shapes = loading._safetensors_shapes(directory) if weights else None
    why = loading._why_not_sharded(loading._parameters_by_name(model), shapes, weights)
    if why:
        log.warning("model %s: loading it whole on every process (from_pretrained): %s", source.name, why)
        model = data.load_model(source, str(directory))
    if config.fsdp.gradient_checkpointing:
        # Non-reentrant: the reentrant variant re-runs the forward outside autograd's view of FSDP2's
        # hooks (its all-gathers would not be re-issued for the recomputation).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapter: dict[str, Any] = {}
    if config.training.method == "lora":  # before sharding: FSDP2 shards the adapter with its layer
        model, adapter = lora.adapt(model, config.training.lora, config.training.seed)
    if runtime.tensor_mesh is not None:  # method full only (config.py): the plan names base layers
        parallelize(model, runtime.tensor_mesh)
    classes, wrapped = shard(model, runtime.shard_mesh, config.fsdp.layer_cls_to_wrap)
    if not why:
        _materialise(model, runtime.device)
        if weights:
            read_slices(model, directory, skip=adapter.keys())
        place(model, adapter)
    loading._attach_generation_config(model, directory)
    return Built(model, sharded_load=not why, why=why, layer_classes=classes, wrapped_layers=wrapped)


def tensor_plan(model: Any, tensor: int) -> dict[str, str]:
    """transformers' tensor-parallel plan for ``model``, one entry per module or parameter (the
    ``*`` of its rules replaced by layer numbers), after checking that it can split over ``tensor``."""
    name = f"{type(model).__name__} (model type {model.config.model_type!r})"
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"fsdp.mesh.tensor={tensor}: transformers has no tensor-parallel plan (base_model_tp_plan) "
            f"for {name}; set tensor: 1 or backend: xla"
        )
    unverified = sorted(set(plan.values()) - VERIFIED_STYLES)
    if unverified:
        raise ConfigError(
            f"fsdp.mesh.tensor={tensor}: transformers' tensor-parallel plan for {name} uses "
            f"{unverified}, which the native backend has not verified (it runs {sorted(VERIFIED_STYLES)}); "
            "set tensor: 1 or backend: xla"
        )
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tensor or kv_heads % tensor:
        # Column-wise q/k/v give each process whole heads only when the heads divide evenly.
        raise ConfigError(
            f"fsdp.mesh.tensor={tensor} must divide the model's attention heads: {name} has "
            f"num_attention_heads={heads} and num_key_value_heads={kv_heads}"
        )
    # (transformers' own expansion: what from_pretrained(tp_plan=...) applies; private in 5.24)
    return dict(model._expand_parallel_plan(plan))


def parallelize(model: Any, tensor_mesh: Any) -> dict[str, str]:
    """Tensor parallelism over ``tensor_mesh`` by transformers' plan for the model (on the meta
    device: the weights become DTensor placeholders, filled by the sliced load). Returns the plan."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = tensor_plan(model, tensor_mesh.size())
    apply_tensor_parallelism(model, tensor_mesh, plan)
    log.info("tensor parallelism over %d processes: %d modules and weights", tensor_mesh.size(), len(plan))
    return plan


def clip_grad_norm(parameters: Any, max_norm: float) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` for DTensor gradients on different meshes (with tensor
    parallelism the decoder projections' are on (fsdp, tensor), the norms' on (fsdp,), and torch's
    own stacks the per-parameter norms, which DTensor refuses across meshes). The 2-norm of every
    gradient, each mesh's part reduced to a whole value, then the same scaling. Returns the norm."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[Any]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    parts = []
    for grads in by_mesh.values():
        part = torch.nn.utils.get_total_norm(grads, 2.0)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if not parts:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(parts), 2.0)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        grad = param.grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coefficient.to(grad.device))
    return total


def reshard(model: Any) -> None:
    """Every FSDP2 unit of ``model`` back to its shards. A forward without a backward leaves the root's
    parameters (embeddings, final norm, LM head) gathered, as FSDP2 keeps the root's after a forward
    for the backward: on the frozen reference that holds them whole on every process for good, and on
    the policy after an evaluation a save right after it would find gathered parameters where the
    optimizer holds shards (``KeyError`` in checkpoint/state.py's names)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard(model: Any, mesh: Any, layer_cls_to_wrap: list[str] | None) -> tuple[list[str], int]:
    """``fully_shard`` on each decoder layer, then on the root (whatever the layers leave: embeddings,
    final norm, LM head). Returns the layer classes and how many modules were wrapped."""
    from torch.distributed.fsdp import fully_shard

    classes = fsdp_v2.resolve_layer_classes(model, layer_cls_to_wrap)
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return classes, len(layers)


def _materialise(model: Any, device: Any) -> None:
    """Empty parameters on the device; the buffers the constructor computed are kept (``to_empty``
    would leave them uninitialised too: the rotary ``inv_freq`` wrong, the logits silently off)."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = value.to(device)


def read_slices(model: Any, directory: Path, skip: Collection[str] = ()) -> None:
    """Each process's shards of every parameter but ``skip`` (a LoRA adapter) from the safetensors
    files (slices only), under the base model's names (a PeftModel's ``base_model.model.`` and
    ``.base_layer.`` dropped)."""
    import torch.distributed.checkpoint as dcp

    from tpuft_trainer.checkpoint.manager import quiet

    state = {
        export.base_name(name): param.detach()
        for name, param in loading._parameters_by_name(model).items()
        if name not in skip
    }
    with quiet():
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))


def place(model: Any, whole: Mapping[str, Any]) -> None:
    """Each process's shards of the whole tensors ``whole`` (by parameter name: the LoRA adapter's
    first weights, the same on every process) copied into the materialised parameters: the slices
    ``distribute_tensor`` would scatter, cut locally (every process holds the whole tensor)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            value = whole.get(name)
            if value is None:
                continue
            value = value.to(param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(value.to(param.device))
