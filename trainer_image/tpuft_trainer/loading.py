"""The model onto the mesh without a whole copy on any host.

``from_pretrained`` reads every weight into host memory before anything is sharded: at 70B that is
140 GB (bf16) on every host at once. Here instead:

1. the model is built with its parameters on the meta device (accelerate's ``init_empty_weights``
   with ``include_buffers=False``: buffers such as the rotary embeddings' ``inv_freq``, which no
   checkpoint holds, are computed by the constructor as usual, so they come out right);
2. each parameter is materialised empty on the XLA device and given its final sharding (FSDPv2's
   own rule, ``_prepare_spmd_partition_spec(shard_maximal=True)``, or the tensor-parallel split of
   ``mesh.tensor_parallel_spec``), which the FSDPv2 wrapper then keeps;
3. ``torch.distributed.checkpoint`` with ``HuggingFaceStorageReader`` and torch_xla's SPMD load planner
   reads from the safetensors files only the slices this host's devices hold, one tensor at a time.

Sources: a local directory (a volume), a ``gs://`` (any fsspec) directory copied to the local disk
cache by data.model_location (disk, not memory), or a hub id (its safetensors and JSON files fetched
into the Hugging Face cache, offline mode honoured). A model this cannot load exactly (no safetensors
files, or weight names transformers converts on load, as for some mixtures of experts) is loaded with
``from_pretrained`` instead, with a warning that says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuft_trainer import data
from tpuft_trainer import mesh as mesh_module
from tpuft_trainer.config import ModelSource

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class Loaded:
    model: Any
    sharded: bool  # False: loaded whole with from_pretrained (``why`` says why)
    why: str = ""
    tensor_parallel_weights: int = 0  # projections laid out over the tensor axis at load


def local_files(source: ModelSource, location: str) -> Path:
    """A local directory with the model's files (a hub id is fetched into the Hugging Face cache)."""
    path = Path(location)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                location, revision=source.revision, token=data.token(source), allow_patterns=HUB_PATTERNS
            )
        )
    except Exception as error:
        raise data.hub_errors(error, f"model {source.name}") from error


def load_model(source: ModelSource, location: str, *, weights: bool = True) -> Loaded:
    """The model of ``source``, sharded over the global mesh. ``weights=False`` leaves the parameters
    uninitialised (a full fine-tune resuming from a checkpoint overwrites every one of them)."""
    import torch
    import torch_xla.distributed.spmd as xs
    from transformers import AutoConfig

    directory = local_files(source, location)
    try:
        config = AutoConfig.from_pretrained(directory, token=data.token(source))
    except Exception as error:
        raise data.hub_errors(error, f"model {source.name}") from error
    config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    dtype = getattr(torch, source.dtype)
    model = _empty_model(config, dtype)
    names = _parameters_by_name(model)
    checkpoint_shapes = _safetensors_shapes(directory) if weights else None
    why = _why_not_sharded(names, checkpoint_shapes, weights)
    if why:
        log.warning("model %s: loading it whole on this host (from_pretrained): %s", source.name, why)
        return Loaded(data.load_model(source, location), sharded=False, why=why)
    mesh = xs.get_global_mesh()
    tensor_parallel = _materialise(model, mesh)
    if weights:
        _read_slices(model, directory)
    _attach_generation_config(model, directory)
    model.eval()  # as from_pretrained returns it; the Trainer switches to train mode
    return Loaded(model, sharded=True, tensor_parallel_weights=tensor_parallel)


def _empty_model(config: Any, dtype: Any) -> Any:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _parameters_by_name(model: Any) -> dict[str, Any]:
    """Each parameter once, under its first name (a tied LM head is the embedding)."""
    seen: set[int] = set()
    named = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:
            seen.add(id(param))
            named[name] = param
    return named


def _safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of the checkpoint's safetensors files (None: there are none)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not any(directory.glob("*.safetensors")):
        return None
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    return {name: tuple(getattr(md, "size", ())) for name, md in metadata.state_dict_metadata.items()}


def _why_not_sharded(
    params: dict[str, Any], checkpoint: dict[str, tuple[int, ...]] | None, weights: bool
) -> str:
    if not weights:
        return ""
    if checkpoint is None:
        return "the model directory has no .safetensors files (only safetensors can be read by slice)"
    missing = [name for name in params if name not in checkpoint]
    if missing:
        return (
            f"{len(missing)} of its {len(params)} weights are not in the safetensors files under the model's own "
            f"names (e.g. {missing[0]!r}): transformers renames or converts them while loading"
        )
    wrong = [name for name, p in params.items() if tuple(p.shape) != checkpoint[name]]
    if wrong:
        return f"{wrong[0]!r} has shape {checkpoint[wrong[0]]} in the files, {tuple(params[wrong[0]].shape)} in the model"
    return ""


def _materialise(model: Any, mesh: Any) -> int:
    """Every parameter empty on the XLA device in its final sharding; buffers copied over. Returns how
    many projections got the tensor-parallel layout."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    device = torch_xla.device()
    tensor_axis = dict(zip(mesh.axis_names or (), mesh.mesh_shape, strict=True)).get("tensor", 1)
    materialised: dict[int, Any] = {}  # tied parameters stay tied
    tensor_parallel = 0
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in materialised:
                setattr(module, name, materialised[id(param)])
                continue
            empty = torch.nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad
            )
            full_name = f"{module_name}.{name}" if module_name else name
            spec = mesh_module.tensor_parallel_spec(full_name, empty) if tensor_axis > 1 else None
            tensor_parallel += spec is not None
            xs.mark_sharding(empty, mesh, spec or _prepare_spmd_partition_spec(empty, shard_maximal=True))
            materialised[id(param)] = empty
            setattr(module, name, empty)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    torch_xla.sync()
    xm.wait_device_ops()  # else DCP's copies into the shards meet "an async operation is in flight"
    return tensor_parallel


def _read_slices(model: Any, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    from tpuft_trainer.checkpoint.manager import quiet

    state = {name: param.detach() for name, param in _parameters_by_name(model).items()}
    with quiet():
        dcp.load(
            state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)), planner=SPMDLoadPlanner()
        )


def _attach_generation_config(model: Any, directory: Path) -> None:
    if not (directory / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    except Exception as error:  # not worth failing a fine-tune for
        log.warning("could not read %s/generation_config.json: %s", directory, error)
