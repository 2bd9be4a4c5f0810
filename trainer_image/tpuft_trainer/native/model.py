"""The model on the mesh without a whole copy on any process: built on the meta device, FSDP2's
``fully_shard`` on every decoder layer and at the root, then each process reads only its shards'
slices of the safetensors files.

1. ``loading.py``'s empty model (parameters on meta; buffers such as the rotary ``inv_freq``, which no
   checkpoint holds, computed by the constructor), gradient checkpointing if configured;
2. ``fully_shard`` per decoder layer (the classes ``fsdp_v2.resolve_layer_classes`` names, as the xla
   backend wraps) and on the root: parameters become DTensors sharded on dim 0 over ``fsdp``;
3. the parameters are materialised empty on the device (buffers kept), and
   ``torch.distributed.checkpoint`` with ``HuggingFaceStorageReader`` fills each process's shards from
   the files (reading slices). A full fine-tune resuming from a checkpoint skips this: the
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
from tpuft_trainer.native.runtime import Runtime

log = logging.getLogger(__name__)


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
    classes, wrapped = shard(model, runtime.mesh, config.fsdp.layer_cls_to_wrap)
    if not why:
        _materialise(model, runtime.device)
        if weights:
            read_slices(model, directory, skip=adapter.keys())
        place(model, adapter)
    loading._attach_generation_config(model, directory)
    return Built(model, sharded_load=not why, why=why, layer_classes=classes, wrapped_layers=wrapped)


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
