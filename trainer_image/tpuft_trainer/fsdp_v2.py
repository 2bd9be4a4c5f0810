"""FSDPv2 (PyTorch/XLA SPMD) for a stock transformers ``Trainer`` or trl ``SFTTrainer``.

The optimum-tpu API, and its tutorials' calls, as written::

    use_fsdp_v2()
    fsdp_training_args = get_fsdp_training_args(model)   # {"fsdp": ..., "fsdp_config": {...}}, as optimum
    Trainer(model=model, args=TrainingArguments(output_dir=..., optim="adafactor",
            dataloader_drop_last=True, **fsdp_training_args), train_dataset=ds).train()

``use_fsdp_v2`` turns SPMD on and applies the workarounds in ``compat`` (each for a named upstream
breakage). What XLA still needs of the arguments (drop_last, an optimizer that runs on XLA, the
Trainer's own checkpointing off) is filled in by ``compat``'s ``xla_training_defaults`` for every key
the caller leaves out, so ``TrainingArguments(**get_fsdp_training_args(model))`` alone works too; a
chosen value that cannot work (a fused optimizer) is a ``ConfigError`` naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tpuft_trainer import compat
from tpuft_trainer.errors import ConfigError, TrainerError

# model_type -> the decoder block to shard and checkpoint as a unit. Anything not listed falls back to
# the model's own ``_no_split_modules`` (what transformers uses when no class is given).
LAYER_CLASSES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaDecoderLayer",),
    "gemma": ("GemmaDecoderLayer",),
    "gemma2": ("Gemma2DecoderLayer",),
    "gemma3": ("Gemma3DecoderLayer",),
    "gemma3_text": ("Gemma3DecoderLayer",),
    "mistral": ("MistralDecoderLayer",),
    "mixtral": ("MixtralDecoderLayer",),
    "qwen2": ("Qwen2DecoderLayer",),
    "qwen2_moe": ("Qwen2MoeDecoderLayer",),
    "qwen3": ("Qwen3DecoderLayer",),
    "qwen3_moe": ("Qwen3MoeDecoderLayer",),
    "phi3": ("Phi3DecoderLayer",),
    "phi": ("PhiDecoderLayer",),
}


def use_fsdp_v2() -> None:
    """Turn on SPMD for this process and apply the compat workarounds. Idempotent. Must run before any
    XLA tensor exists: SPMD changes what an XLA device is, and torch_xla would otherwise silently
    replicate the existing tensors onto every device."""
    import torch_xla
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        if torch_xla._XLAC._xla_get_spmd_config_is_locked():
            raise TrainerError(
                "use_fsdp_v2() must be called before any tensor is placed on an XLA device "
                "(call it first thing, before loading the model onto the device)"
            )
        xr.use_spmd()
    compat.apply()


def unwrap_peft(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (or ``model`` itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def module_class_names(model: Any) -> set[str]:
    return {type(module).__name__ for module in model.modules()}


def _repeated_block_names(model: Any) -> list[str]:
    """Class names of the blocks inside ModuleLists: the candidates a user most likely meant."""
    import torch

    names = {
        type(child).__name__
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        for child in module
    }
    return sorted(names)


def resolve_layer_classes(model: Any, layer_cls_to_wrap: Iterable[str] | str | None = None) -> list[str]:
    """The decoder-block class names to wrap: ``layer_cls_to_wrap`` if given (each must exist in the
    model), else the known class for the model type, else the model's ``_no_split_modules``."""
    base = unwrap_peft(model)
    present = module_class_names(model)
    if isinstance(layer_cls_to_wrap, str):
        layer_cls_to_wrap = [layer_cls_to_wrap]
    if layer_cls_to_wrap is not None:
        wanted = list(layer_cls_to_wrap)
        missing = [name for name in wanted if name not in present]
        if not wanted or missing:
            raise ConfigError(
                f"layer class(es) {missing or wanted} not found in {type(base).__name__}; its repeated "
                f"blocks are {_repeated_block_names(model)} (all classes: {sorted(present)})"
            )
        return wanted
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    known = [name for name in LAYER_CLASSES.get(str(model_type), ()) if name in present]
    if known:
        return known
    fallback = [name for name in (getattr(base, "_no_split_modules", None) or []) if name in present]
    if fallback:
        return fallback
    raise ConfigError(
        f"no decoder layer class known for model type {model_type!r} ({type(base).__name__}) and it declares "
        f"no _no_split_modules; pass layer_cls_to_wrap, one of its repeated blocks: {_repeated_block_names(model)}"
    )


def get_fsdp_config(*cls_to_wrap: str | Iterable[str], gradient_checkpointing: bool = True) -> dict[str, Any]:
    """The ``fsdp_config`` of FSDPv2 for the given decoder-block class names (optimum-tpu's
    ``get_fsdp_config(*cls_to_wrap)``, which its errors tell users to call for unknown models). Names are
    not checked against a model here; ``get_fsdp_training_args`` checks them."""
    names: list[str] = []
    for item in cls_to_wrap:
        names += [item] if isinstance(item, str) else list(item)
    if not names:
        raise ConfigError(
            "get_fsdp_config() needs at least one decoder layer class name, e.g. 'LlamaDecoderLayer'"
        )
    return {
        "transformer_layer_cls_to_wrap": names,
        "xla": True,
        "xla_fsdp_v2": True,
        "xla_fsdp_grad_ckpt": gradient_checkpointing,
    }


def get_fsdp_training_args(
    model: Any,
    layer_cls_to_wrap: Iterable[str] | str | None = None,
    *,
    gradient_checkpointing: bool = True,
) -> dict[str, Any]:
    """``fsdp`` and ``fsdp_config`` for ``TrainingArguments`` / ``SFTConfig`` that train ``model`` with
    FSDPv2: the two keys optimum-tpu returns, so its tutorials' ``TrainingArguments(...,
    dataloader_drop_last=True, optim=..., **args)`` works as written.

    ``gradient_checkpointing`` is done by FSDPv2 per decoder block (``xla_fsdp_grad_ckpt``). The other
    settings XLA needs come from ``compat.XLA_TRAINING_DEFAULTS`` when the caller does not pass them.
    ``fsdp`` is ``True`` where optimum writes ``"full_shard"``: the same for transformers 5.24, without
    its deprecation warning.
    """
    compat.apply()  # harmless if use_fsdp_v2() already did; covers users who set SPMD up themselves
    return {
        "fsdp": True,
        "fsdp_config": get_fsdp_config(
            resolve_layer_classes(model, layer_cls_to_wrap), gradient_checkpointing=gradient_checkpointing
        ),
    }


def use_mesh(mesh: Any) -> None:
    """Make ``mesh`` the global mesh now and after every Trainer is built (the Trainer installs its
    own 1-D mesh in ``__init__``; compat's ``mesh_wins`` puts this one back)."""
    from tpuft_trainer import mesh as mesh_module

    compat.set_mesh(mesh)
    mesh_module.install(mesh)
