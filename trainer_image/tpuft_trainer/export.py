"""The fine-tuned model as a standard Hugging Face directory, without the whole model on any host.

A full fine-tune's weights are fetched from the devices part by part (``Backend.full_tensors``: on XLA
one gather per part of up to ``GATHER_BYTES``, compiled once per shape of part) and each group of up
to ``FILE_BYTES`` is written as one safetensors file, ``model-0000k-of-0000n.safetensors`` (``model.safetensors`` when there is one), with the index
``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and the tokenizer: the
layout ``from_pretrained`` reads. Every process takes part in each gather (a collective); file k is
written by process k mod processes, so hosts share the writing and each holds one group at a time.
Tied weights are written once, under the name the model expects when it reloads them.

A LoRA run exports its adapter (``adapter_model.safetensors`` + ``adapter_config.json``), gathering
only the adapter's weights; with ``lora.saveMerged`` the merged model is exported the same streaming
way, each adapted weight merged on the device (base + B·A·scale) right before its group is fetched.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpuft_trainer import host_memory
from tpuft_trainer.checkpoint import layout
from tpuft_trainer.checkpoint.backend import Backend
from tpuft_trainer.checkpoint.state import hf_name

log = logging.getLogger(__name__)

FILE_BYTES = 1 << 30  # per safetensors file: what a host holds at once
# Per gather: every device holds the whole gathered part for a moment (on TPU in HBM; on PJRT CPU,
# where the devices are host memory, once per device).
GATHER_BYTES = 1 << 28
INDEX = "model.safetensors.index.json"
MERGED = "merged"  # a LoRA run's merged model, under the output


@dataclass(frozen=True)
class Deferred:
    """A tensor computed on the device only when its group is fetched (a merged LoRA weight)."""

    like: Any  # a tensor of its shape and dtype
    compute: Callable[[], Any]


TensorSource = Any  # a tensor on the device, or a Deferred


@dataclass
class ExportRecord:
    """What the export did (``tpuft-metrics.json``: ``export``)."""

    files: list[str] = field(default_factory=list)
    written_here: list[str] = field(default_factory=list)  # the files this process wrote
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    largest_group_bytes: int = 0


def unwrap(model: Any) -> Any:
    """The transformers model inside FSDPv2's wrapper."""
    inner = getattr(model, "_orig_module", None)
    return inner if inner is not None else model


def model_tensors(model: Any) -> dict[str, TensorSource]:
    """The model's state dict by HF name, each tensor once (a tied weight under the name that is not
    one of the model's tied copies, e.g. the embedding rather than the LM head)."""
    inner = unwrap(model)
    tied_copies = set(_tied_names(inner))
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(hf_name(name))
        tensors[id(tensor)] = tensor
    ignored = set(getattr(inner, "_keys_to_ignore_on_save", None) or [])
    out: dict[str, TensorSource] = {}
    for key, names in by_tensor.items():
        kept = [n for n in names if n not in tied_copies] or names
        if kept[0] not in ignored:
            out[kept[0]] = tensors[key].detach()
    return out


def _tied_names(model: Any) -> list[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return list(tied.keys() if isinstance(tied, dict) else tied)


def merged_tensors(peft_model: Any) -> dict[str, TensorSource]:
    """A LoRA model's weights with the adapter merged in, under the base model's names: each adapted
    weight is computed on the device (base + peft's delta) only when its group is fetched."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter if hasattr(peft_model, "active_adapter") else "default"
    deltas: dict[str, Any] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            deltas[base_name(f"{name}.base_layer.weight")] = module
    out: dict[str, TensorSource] = {}
    for name, tensor in peft_model.state_dict(keep_vars=True).items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        base = base_name(name)
        layer = deltas.get(base)
        if layer is None:
            out.setdefault(base, tensor.detach())
        else:
            weight = tensor.detach()
            out[base] = Deferred(weight, _merge(weight, layer, adapter))
    return out


def _merge(weight: Any, layer: Any, adapter: str) -> Callable[[], Any]:
    return lambda: weight + layer.get_delta_weight(adapter).to(weight.dtype)


def base_name(name: str) -> str:
    name = hf_name(name)
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(".base_layer.", ".")


def export_adapter(
    peft_model: Any, tokenizer: Any, backend: Backend, output: Path, training_arguments: Any
) -> None:
    """A LoRA run's adapter as the xla backend's ``Trainer.save_model`` writes it (compat.py's
    reloadable checkpoint): ``adapter_model.safetensors`` + ``adapter_config.json`` (and peft's
    README.md), ``training_args.bin`` and the tokenizer, into the local output directory. Every
    process calls it (the adapter's shards are gathered, a few MB); process 0 writes."""
    import torch

    from tpuft_trainer import compat
    from tpuft_trainer.checkpoint.state import trainable_state

    adapter = trainable_state(peft_model)
    whole = dict(zip(adapter, backend.full_tensors(list(adapter.values())), strict=True))
    if backend.process_index == 0:
        output.mkdir(parents=True, exist_ok=True)
        torch.save(training_arguments, output / "training_args.bin")
        compat.save_peft_adapter(peft_model, whole, str(output))
        tokenizer.save_pretrained(output)


def export_merged(
    peft_model: Any, tokenizer: Any, store: layout.Store, backend: Backend, output: Path
) -> ExportRecord:
    """``lora.save_merged``: the merged model streamed under ``merged/`` (weights, config, tokenizer);
    every process calls it (the weights are gathered), process 0 writes the small files."""
    merged = export_weights(merged_tensors(peft_model), layout.Store(store.url(MERGED)), backend)
    if backend.process_index == 0:
        write_config(peft_model, output / MERGED)
        tokenizer.save_pretrained(output / MERGED)
    return merged


def groups_of(sizes: dict[str, int], limit: int = FILE_BYTES) -> list[list[str]]:
    """Consecutive names in groups of at most ``limit`` bytes (a larger tensor alone in its group)."""
    groups: list[list[str]] = [[]]
    total = 0
    for name, size in sizes.items():
        if groups[-1] and total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return [group for group in groups if group]


def file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def export_weights(
    tensors: dict[str, TensorSource],
    output: layout.Store,
    backend: Backend,
    *,
    group_bytes: int = FILE_BYTES,
    gather_bytes: int = GATHER_BYTES,
) -> ExportRecord:
    """Writes ``tensors`` as safetensors files (+ index) at ``output``; every process calls it."""
    from safetensors.torch import save_file

    started = time.monotonic()
    sizes = {name: _nbytes(value) for name, value in tensors.items()}
    groups = groups_of(sizes, group_bytes)
    names = file_names(len(groups))
    record = ExportRecord(files=names, tensors=len(tensors), bytes=sum(sizes.values()))
    weight_map: dict[str, str] = {}
    for index, (group, file_name) in enumerate(zip(groups, names, strict=True)):
        host = []
        for part in groups_of({name: sizes[name] for name in group}, min(gather_bytes, group_bytes)):
            # A collective: every process, every part. Merged LoRA weights are computed here.
            host += backend.full_tensors([_resolve(tensors[name]) for name in part])
        record.largest_group_bytes = max(record.largest_group_bytes, sum(sizes[n] for n in group))
        weight_map.update(dict.fromkeys(group, file_name))
        if index % backend.process_count == backend.process_index:
            _write(
                save_file, {n: t.contiguous() for n, t in zip(group, host, strict=True)}, output, file_name
            )
            record.written_here.append(file_name)
        del host
        host_memory.release()
    backend.barrier()  # every file on storage before the index that names them
    if backend.process_index == 0 and len(names) > 1:
        contents = {"metadata": {"total_size": record.bytes}, "weight_map": weight_map}
        output.write_text(json.dumps(contents, indent=2, sort_keys=True) + "\n", INDEX)
    record.seconds = round(time.monotonic() - started, 2)
    return record


def _resolve(value: TensorSource) -> Any:
    return value.compute() if isinstance(value, Deferred) else value


def _nbytes(value: TensorSource) -> int:
    tensor = value.like if isinstance(value, Deferred) else value
    return int(tensor.numel() * tensor.element_size())


def _write(save_file: Callable[..., None], tensors: dict[str, Any], output: layout.Store, name: str) -> None:
    if output.is_local:
        Path(output.local_path()).mkdir(parents=True, exist_ok=True)
        save_file(tensors, output.local_path(name), metadata={"format": "pt"})
        return
    with tempfile.TemporaryDirectory(prefix="tpuft-export-") as tmp:
        path = os.path.join(tmp, name)
        save_file(tensors, path, metadata={"format": "pt"})
        output.put_file(path, name)


def write_config(model: Any, directory: Path) -> None:
    """config.json (with the architecture and dtype, as save_pretrained writes them, and the KV cache
    back on for inference) and generation_config.json, into the local output directory."""
    import copy

    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # a merged LoRA model: the base model's config
        inner = inner.get_base_model()
    config = copy.deepcopy(inner.config)
    config.architectures = [type(inner).__name__]
    config.dtype = str(inner.dtype).split(".")[1]
    config.use_cache = True  # turned off for training only
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    generation = getattr(inner, "generation_config", None)
    if generation is not None and inner.can_generate():
        generation.save_pretrained(directory)
