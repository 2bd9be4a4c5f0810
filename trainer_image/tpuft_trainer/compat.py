"""Every workaround for a known upstream breakage, in one place.

Each entry names the error it fixes and the versions it was seen with (torch 2.9.0, torch_xla 2.9.0,
transformers 5.24.0, trl 1.16.0). tests/trainer/test_compat.py removes each patch in turn and checks that
the original error comes back (so a patch that became unnecessary is noticed and deleted) and that the
patched run works (so removing a needed patch fails a test).

Patches replace attributes of transformers' modules (never copies of its code); ``apply`` is idempotent
and ``remove`` restores the originals.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Breakage 2. torch >= 2.8 makes the Trainer's default optimizer fused AdamW, which raises
# "RuntimeError: `fused=True` requires all the params to be floating point Tensors of supported devices"
# for XLA tensors. The ``xla_training_defaults`` patch makes adafactor the default under FSDPv2 (what
# optimum-tpu's examples use); "adamw_torch" also runs on XLA.
XLA_DEFAULT_OPTIMIZER = "adafactor"
XLA_SAFE_OPTIMIZERS: tuple[str, ...] = ("adafactor", "adamw_torch")

# Breakage 5. trl's SFTConfig defaults gradient_checkpointing=True, and the Trainer's checkpointing fails
# under XLA with "AttributeError: module 'torch' has no attribute 'xla'". FSDPv2 checkpoints each
# decoder block itself (xla_fsdp_grad_ckpt), so the Trainer's own checkpointing defaults to off.
TRAINER_GRADIENT_CHECKPOINTING = False

# What XLA needs of TrainingArguments/SFTConfig under FSDPv2, filled in by ``xla_training_defaults`` for
# every key the caller did not pass (optimum-tpu's get_fsdp_training_args returns only fsdp and
# fsdp_config, and its tutorials pass dataloader_drop_last and optim themselves: a dict carrying them too
# made Python raise "got multiple values for keyword argument").
XLA_TRAINING_DEFAULTS: dict[str, Any] = {
    # Every batch must have the same shape (one compiled graph) and split evenly over the mesh.
    "dataloader_drop_last": True,
    "optim": XLA_DEFAULT_OPTIMIZER,
    # The new name: setting it keeps transformers from warning about the deprecated
    # `gradient_checkpointing`, and it overrides SFTConfig's default of True.
    "activation_checkpointing": TRAINER_GRADIENT_CHECKPOINTING,
}

# Breakage 6 (transformers 5.2 + bf16 + sdpa: dtype mismatch) is fixed in the pinned 5.24; nothing here.

# The mesh that must be in force while training (set by fsdp_v2.use_mesh); None keeps the Trainer's.
_state: dict[str, Any] = {"mesh": None, "disabled": set()}


def _strip_wrapper_prefixes(key: str) -> str:
    # SpmdFullyShardedDataParallel keeps the wrapped module as ``_orig_module``, at the root and around
    # every auto-wrapped decoder block.
    return re.sub(r"(^|\.)_orig_module\.", r"\1", key)


def _is_spmd_fsdp(model: Any) -> bool:
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return isinstance(model, SpmdFullyShardedDataParallel)


# Replicated bytes (per device) one gathering graph may hold: every device holds the whole group at
# once, next to its shards of the model and optimizer.
GATHER_GROUP_BYTES = 1 << 30


def is_sharded(tensor: Any) -> bool:
    """Whether an XLA tensor is split over devices (not replicated, not unannotated)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor) not in ("", "{replicated}")


def cpu_copies(tensors: list[Any]) -> list[Any]:
    """CPU copies of XLA tensors; every process must call it (gathering shards is a collective).

    Breakage 8 (torch_xla 2.9): fetching a *sharded* tensor to the host compiles a replication graph
    for that tensor every time (PjRt ReplicateShardedData, uncached): a checkpoint of a model with P
    sharded parameters compiled ~3 P graphs (weights, two optimizer moments) at every save, which on
    a TPU is minutes of each save. Here the sharded tensors are re-annotated as replicated in groups
    of up to GATHER_GROUP_BYTES, one graph per group: the same graphs at every save, so compiled once
    and cached; the replicated results then copy to the host without compiling anything."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    ready = list(tensors)
    if mesh is None:  # no SPMD mesh: nothing is sharded
        return list(torch_xla._XLAC._xla_get_cpu_tensors(ready))
    sharded = [i for i, t in enumerate(tensors) if is_sharded(t)]
    groups: list[list[int]] = [[]]
    size = 0
    for i in sharded:
        nbytes = tensors[i].numel() * tensors[i].element_size()
        if groups[-1] and size + nbytes > GATHER_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    for group in groups:
        if not group:
            continue
        for i in group:
            replica = tensors[i].detach() * 1  # a new value, free of the parameter's own sharding
            xs.mark_sharding(replica, mesh, (None,) * replica.dim())
            ready[i] = replica
        torch_xla.sync()
    return list(torch_xla._XLAC._xla_get_cpu_tensors(ready))


def gather_state_dict(model: Any) -> dict[str, Any]:
    """The full (unsharded) state dict on CPU with the original parameter names. Every process must
    call it: fetching a sharded tensor replicates it over the mesh first (a collective)."""
    import torch
    import torch_xla

    torch_xla.sync()
    items = list(model.state_dict().items())
    on_device = [i for i, (_, value) in enumerate(items) if isinstance(value, torch.Tensor)]
    copies = dict(zip(on_device, cpu_copies([items[i][1].detach() for i in on_device]), strict=True))
    return {_strip_wrapper_prefixes(key): copies.get(i, value) for i, (key, value) in enumerate(items)}


def gather_trainable_state(model: Any) -> dict[str, Any]:
    """CPU copies of the trainable parameters only, with the original names (for LoRA: the adapter,
    a few MB, rather than the whole base model). Every process must call it (a collective)."""
    import torch_xla

    torch_xla.sync()
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    copies = cpu_copies([param.detach() for _, param in named])
    return {_strip_wrapper_prefixes(name): copy for (name, _), copy in zip(named, copies, strict=True)}


def _is_peft(module: Any) -> bool:
    from peft import PeftModel

    return isinstance(module, PeftModel)


def save_peft_adapter(peft_model: Any, state: dict[str, Any], output_dir: str) -> None:
    """Writes only the adapter (and its config), with the names an unwrapped PeftModel loads.

    peft (0.21) picks the adapter's entries by the names of its LoRA modules, and under FSDPv2 those
    carry the '_orig_module.' of the decoder blocks wrapped inside the PeftModel: given the plain names
    of `gather_state_dict` it matched nothing and wrote an empty adapter (and the merged model was the
    base model). So peft gets the names as it sees them, and the file is rewritten with plain names."""
    from safetensors.torch import load_file, save_file

    as_peft_sees_them = {
        key: state[_strip_wrapper_prefixes(key)]
        for key in peft_model.state_dict()
        if _strip_wrapper_prefixes(key) in state
    }
    peft_model.save_pretrained(output_dir, state_dict=as_peft_sees_them, safe_serialization=True)
    path = os.path.join(output_dir, "adapter_model.safetensors")
    adapter = load_file(path)
    if not adapter:
        raise RuntimeError(f"peft wrote an empty adapter to {path}: no LoRA weights matched")
    save_file({_strip_wrapper_prefixes(k): v for k, v in adapter.items()}, path, metadata={"format": "pt"})


def _batch_spec(mesh: Any, ndim: int) -> tuple[Any, ...]:
    from tpuft_trainer.mesh import BATCH_AXES

    axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    first: Any = axes[0] if len(axes) == 1 else axes
    return (first,) + (None,) * (ndim - 1)


def shard_model_output(output: Any, mesh: Any) -> None:
    """Shards the batch dimension of a model's (or decoder block's) output over the mesh's data axes.
    Accepts any output type: a tensor, a tuple, a ModelOutput with logits, or trl's outputs that have no
    logits (then the first tensor with a batch dimension, or nothing: the hint is only for the compiler)."""
    import torch
    import torch_xla.distributed.spmd as xs

    tensor = None
    if isinstance(output, torch.Tensor):
        tensor = output
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        tensor = output[0]
    elif getattr(output, "logits", None) is not None:
        tensor = output.logits
    elif hasattr(output, "values"):
        tensor = next((v for v in output.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if tensor is None or tensor.dim() == 0:
        return
    xs.mark_sharding(tensor, mesh, _batch_spec(mesh, tensor.dim()))


@dataclass
class Patch:
    name: str
    fixes: str  # the error (or silent failure) seen without it
    target: Callable[[], Any]  # the object whose attribute is replaced (imported lazily)
    attribute: str
    replacement: Callable[[Callable[..., Any]], Callable[..., Any]]
    _original: Any = field(default=None, repr=False)

    @property
    def applied(self) -> bool:
        return self._original is not None

    def apply(self) -> None:
        if self.applied:
            return
        owner = self.target()
        self._original = getattr(owner, self.attribute)
        setattr(owner, self.attribute, self.replacement(self._original))

    def remove(self) -> None:
        if not self.applied:
            return
        setattr(self.target(), self.attribute, self._original)
        self._original = None


def _trainer_class() -> Any:
    from transformers import Trainer

    return Trainer


def _xla_model_module() -> Any:
    import torch_xla.core.xla_model

    return torch_xla.core.xla_model


# ---- 8. gathers compiled once --------------------------------------------------------------------
def _grouped_host_copies(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_convert_to_cpu(data: Any, convert: bool = True) -> Any:
        # xm.save (the Trainer's optimizer and scheduler states) copies through this; see cpu_copies.
        import torch
        import torch_xla
        from torch_xla.core.xla_model import ToXlaTensorArena, is_xla_tensor

        def convert_fn(tensors: list[Any]) -> list[Any]:
            torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
            return cpu_copies(tensors) if convert else tensors

        def select_fn(value: Any) -> bool:
            return type(value) is torch.Tensor and bool(is_xla_tensor(value))

        return ToXlaTensorArena(convert_fn, select_fn).transform(data)

    return _maybe_convert_to_cpu


def _trainer_module() -> Any:
    import transformers.trainer

    return transformers.trainer


# ---- 1. optimizer before scheduler --------------------------------------------------------------
def _create_optimizer_first(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_scheduler(self: Any, num_training_steps: int, optimizer: Any = None) -> Any:
        # transformers delays creating the optimizer for FSDP-XLA until the model is wrapped, then never
        # creates it because the wrapped model is not `self.model`. Parameters keep their identity when
        # FSDPv2 shards them in place, so an optimizer over self.model's parameters is the right one.
        if optimizer is None and self.optimizer is None:
            self.create_optimizer()
        return original(self, num_training_steps, optimizer)

    return create_scheduler


# ---- 3. reloadable checkpoints ------------------------------------------------------------------
def _save_reloadable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_tpu_checkpoint(
        model: Any,
        args: Any,
        accelerator: Any,
        processing_class: Any,
        is_fsdp_xla_v1_enabled: bool,
        output_dir: str | None = None,
    ) -> None:
        if not _is_spmd_fsdp(model):
            return original(model, args, accelerator, processing_class, is_fsdp_xla_v1_enabled, output_dir)
        import torch

        output_dir = output_dir if output_dir is not None else args.output_dir
        peft = _is_peft(model.module)
        # On every process: gathering is a collective. A LoRA model's adapter is all peft writes.
        state = gather_trainable_state(model) if peft else gather_state_dict(model)
        if args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(args, os.path.join(output_dir, "training_args.bin"))
            if peft:
                save_peft_adapter(model.module, state, output_dir)
            else:
                model.module.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
            if processing_class is not None:
                processing_class.save_pretrained(output_dir)
        return None

    return save_tpu_checkpoint


# ---- 4. shard any model output -----------------------------------------------------------------
def _robust_shard_output(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrap_model_xla_fsdp(model: Any, args: Any, is_fsdp_xla_v2_enabled: bool) -> Any:
        wrapped = original(model, args, is_fsdp_xla_v2_enabled)
        if is_fsdp_xla_v2_enabled:
            for module in wrapped.modules():
                if _is_spmd_fsdp(module):
                    module._shard_output = shard_model_output
        return wrapped

    return wrap_model_xla_fsdp


# ---- 5. batch over every data axis ---------------------------------------------------------------
def _batch_over_data_axes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def tpu_spmd_dataloader(dataloader: Any) -> Any:
        import torch_xla.distributed.spmd as xs

        dataloader = original(dataloader)
        mesh = xs.get_global_mesh()
        kwargs = getattr(dataloader, "_parallel_loader_kwargs", None)
        if mesh is not None and kwargs is not None:
            kwargs["input_sharding"] = xs.ShardingSpec(mesh, _batch_spec(mesh, 2))
        return dataloader

    return tpu_spmd_dataloader


# ---- 6. XLA's training defaults, overridable -----------------------------------------------------
def _uses_fsdp_v2(kwargs: dict[str, Any]) -> bool:
    fsdp_config = kwargs.get("fsdp_config")
    return isinstance(fsdp_config, dict) and bool(fsdp_config.get("xla_fsdp_v2"))


def check_xla_training_arguments(explicit: dict[str, Any]) -> None:
    """Refuses values a caller chose that cannot run under FSDPv2, naming the argument and the fix."""
    from tpuft_trainer.errors import ConfigError

    optim = explicit.get("optim", "")
    optim = str(getattr(optim, "value", optim))  # a string or transformers' OptimizerNames
    if "fused" in optim:
        raise ConfigError(
            f"optim={optim!r} cannot run under xla_fsdp_v2: fused optimizers reject XLA tensors "
            f"(RuntimeError: `fused=True` requires ... supported devices); use one of {XLA_SAFE_OPTIMIZERS}"
        )
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if explicit.get(name):
            raise ConfigError(
                f"{name}=True cannot run under xla_fsdp_v2 (AttributeError: module 'torch' has no attribute "
                "'xla'); FSDPv2 checkpoints each decoder block itself: set fsdp_config['xla_fsdp_grad_ckpt'] "
                "(get_fsdp_training_args(model, gradient_checkpointing=True) does)"
            )


def _fill_xla_defaults(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _uses_fsdp_v2(kwargs):
            import dataclasses

            # A dataclass default cannot tell an explicit value from an untouched one; the call can.
            positional = [f.name for f in dataclasses.fields(type(self)) if f.init][: len(args)]
            explicit = {**dict(zip(positional, args, strict=False)), **kwargs}
            check_xla_training_arguments(explicit)
            kwargs = {**{k: v for k, v in XLA_TRAINING_DEFAULTS.items() if k not in explicit}, **kwargs}
            if "gradient_checkpointing" in explicit and "activation_checkpointing" not in explicit:
                kwargs.pop("activation_checkpointing")  # the deprecated alias stands for the new name
        original(self, *args, **kwargs)

    return __init__


def _training_arguments_class() -> Any:
    from transformers import TrainingArguments

    return TrainingArguments


def _sft_config_class() -> Any:
    # SFTConfig is a dataclass of its own: its generated __init__ does not call TrainingArguments'.
    from trl import SFTConfig

    return SFTConfig


def _dpo_config_class() -> Any:
    # DPOConfig too: trl's base config defaults gradient_checkpointing=True.
    from trl import DPOConfig

    return DPOConfig


# ---- 7. packed rows without a host sync --------------------------------------------------------
def _masking_module() -> Any:
    import transformers.masking_utils

    return transformers.masking_utils


def _packed_indices_on_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        # transformers tests on the host whether the rows are packed at all ("(mask[:, -1] == 0).all()")
        # unless it is tracing; an XLA tensor is not "tracing" to it, so every forward waited for the
        # device. The check only saves a mask when nothing is packed: on XLA the mask is always returned
        # (transformers' tracing path), which is also right for unpacked rows.
        if getattr(position_ids, "device", None) is None or position_ids.device.type != "xla":
            return original(position_ids)
        module = _masking_module()
        host_check = module.is_tracing
        module.is_tracing = lambda tensor=None: True
        try:
            return original(position_ids)
        finally:
            module.is_tracing = host_check

    return find_packed_sequence_indices


# ---- 10. DPO's metrics without data-dependent shapes -------------------------------------------
def _dpo_trainer_module() -> Any:
    import trl.trainer.dpo_trainer

    return trl.trainer.dpo_trainer


def _dpo_trainer_class() -> Any:
    from trl import DPOTrainer

    return DPOTrainer


def _masked_sum_tensor_class() -> Any:
    import torch

    class MaskIndexedAsZeros(torch.Tensor):
        """``x[mask]`` (a boolean mask of x's shape) gives x with zeros outside the mask, in x's shape:
        the same sum, the only thing trl takes of it, without a shape that depends on the data."""

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if (
                func is torch.Tensor.__getitem__
                and len(args) == 2
                and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool
                and args[1].shape == args[0].shape
            ):
                return args[0].as_subclass(torch.Tensor).masked_fill(~args[1], 0)
            return super().__torch_function__(func, types, args, kwargs or {})

    return MaskIndexedAsZeros


def _fixed_shape_dpo_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
        # trl 1.16 DPOTrainer logs the chosen and rejected completions' mean logits as
        # ``mean_logits[mask].sum()``: boolean indexing, whose shape is the batch's count of completion
        # tokens, so XLA compiled new graphs at nearly every step. The fused head already zeroes every
        # position outside the mask, so the sum without indexing is the same number.
        original(model, *args, **kwargs)
        fused = model.forward
        zeros_outside = _masked_sum_tensor_class()

        @functools.wraps(fused)
        def forward(self: Any, *f_args: Any, **f_kwargs: Any) -> Any:
            output = fused(*f_args, **f_kwargs)
            mean_logits = getattr(output, "mean_logits", None) if f_kwargs.get("fused_lm_head") else None
            if mean_logits is not None and mean_logits.device.type == "xla":
                output.mean_logits = mean_logits.as_subclass(zeros_outside)
            return output

        # A bound method, as trl's: SpmdFullyShardedDataParallel refuses a module whose forward is not.
        model.forward = types.MethodType(forward, model)

    return add_fused_lm_head


# ---- 11. DPO's LoRA reference under FSDPv2 ---------------------------------------------------------
def _peft_inside_fsdp_v2(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def is_peft_model(model: Any) -> bool:
        # Under FSDP-XLA the Trainer replaces self.model with the SpmdFullyShardedDataParallel wrapper,
        # which accelerate's is_peft_model does not look into: trl then takes the reference from
        # self.ref_model, None with LoRA ("TypeError: 'NoneType' object is not callable"). The wrapper
        # forwards attribute lookups (disable_adapter, peft_config) to the PeftModel inside.
        inner = getattr(model, "_orig_module", None) if _is_spmd_fsdp_safe(model) else None
        return bool(original(inner if inner is not None else model))

    return is_peft_model


def _is_spmd_fsdp_safe(model: Any) -> bool:
    try:
        return _is_spmd_fsdp(model)
    except ImportError:
        return False


# ---- 12. DPO on pairs prepared before (data/preference.py) ----------------------------------------
# The trl releases whose DPOTrainer tokenisation data/preference.py reproduces, exactly (its columns,
# the completion's start at the common prefix, EOS on plain text, the keep_start filter); part of a
# prepared set's fingerprint. Another trl may tokenise otherwise: prepared pairs are refused with it.
PREPARED_PAIRS_TRL: tuple[str, ...] = ("1.16",)
PREPARED_PAIRS_TOKENISATION = "trl 1.16 DPOTrainer._prepare_dataset"


def check_prepared_pairs_trl() -> None:
    """Refuses a trl whose DPOTrainer tokenisation tpuft's prepared pairs were not checked against.
    Read from the package's metadata: importing trl starts torch_xla, which ``tpuft prepare`` (on CPU,
    forking its workers) does without."""
    from importlib.metadata import version

    from tpuft_trainer.errors import ConfigError

    installed = version("trl")
    release = ".".join(installed.split(".")[:2])
    if release not in PREPARED_PAIRS_TRL:
        raise ConfigError(
            f"this trainer image has trl {installed}; tpuft prepares preference pairs as trl "
            f"{', '.join(PREPARED_PAIRS_TRL)} tokenises them (data/preference.py, compat.py) and has not been "
            "checked against this one: use the trainer image of this tpuft release"
        )


def _takes_prepared_pairs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _prepare_dataset(self: Any, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        # trl 1.16 tokenises every dataset it is given (only vision sets skip it), with no documented way
        # to hand it pairs tokenised already: given trl's own columns it would look for a prompt to
        # extract ("KeyError: 'chosen'"). Pairs prepared by data.prepare are those columns, made as
        # this method makes them (and dropped as its keep_start filter drops them): taken as they are.
        from tpuft_trainer.data.preference import ID_COLUMNS
        from tpuft_trainer.errors import ConfigError

        if sorted(getattr(dataset, "column_names", None) or ()) != sorted(ID_COLUMNS):
            return original(self, dataset, processing_class, args, dataset_name)
        check_prepared_pairs_trl()
        if args.max_length is None or args.truncation_mode != "keep_start":
            raise ConfigError(
                "prepared preference pairs drop those whose prompt fills max_length, as trl does with "
                f"truncation_mode keep_start; DPOConfig has max_length={args.max_length}, "
                f"truncation_mode={args.truncation_mode!r}"
            )
        log.info("%s: %d preference pairs prepared before, not tokenised again", dataset_name, len(dataset))
        return dataset

    return _prepare_dataset


# ---- 8. our mesh wins over the Trainer's ---------------------------------------------------------
def _reinstall_mesh(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        mesh = _state["mesh"]
        if mesh is not None and getattr(self, "is_fsdp_xla_v2_enabled", False):
            import torch_xla.distributed.spmd as xs

            xs.set_global_mesh(mesh)

    return __init__


PATCHES: list[Patch] = [
    Patch(
        "gathers_compiled_once",
        "every checkpoint save compiles one replication graph per sharded tensor again (torch_xla 2.9 "
        "ReplicateShardedData is uncached): ~3 graphs per parameter at every save",
        _xla_model_module,
        "_maybe_convert_to_cpu",
        _grouped_host_copies,
    ),
    Patch(
        "optimizer_before_scheduler",
        "AttributeError: 'NoneType' object has no attribute 'param_groups' (Trainer.create_scheduler, "
        "transformers >= 5.3 with FSDP-XLA: the delayed optimizer is never created)",
        _trainer_class,
        "create_scheduler",
        _create_optimizer_first,
    ),
    Patch(
        "reloadable_checkpoint",
        "Trainer.save_model under FSDPv2 writes only pytorch_model.bin with '_orig_module.' keys and no "
        "config.json: from_pretrained silently builds a default config, resume_from_checkpoint loads no weights",
        _trainer_module,
        "save_tpu_checkpoint",
        _save_reloadable,
    ),
    Patch(
        "shard_any_output",
        "ValueError: Something went wrong, the output of the model shouldn't be `None` (trl >= 1.15 "
        "SFTTrainer outputs are not CausalLMOutputWithPast)",
        _trainer_module,
        "wrap_model_xla_fsdp",
        _robust_shard_output,
    ),
    Patch(
        "batch_over_data_axes",
        "transformers shards the batch over the 'fsdp' axis only: with data or dcn axes every replica "
        "would compute the same examples",
        _trainer_module,
        "tpu_spmd_dataloader",
        _batch_over_data_axes,
    ),
    Patch(
        "xla_training_defaults",
        "TrainingArguments(**get_fsdp_training_args(model)) trains with fused AdamW (RuntimeError: `fused=True` "
        "requires ... supported devices); SFTConfig turns on the Trainer's checkpointing (AttributeError: module "
        "'torch' has no attribute 'xla'); batches of another shape recompile",
        _training_arguments_class,
        "__init__",
        _fill_xla_defaults,
    ),
    Patch(
        "xla_training_defaults",
        "the same, for trl's SFTConfig (a dataclass with its own __init__)",
        _sft_config_class,
        "__init__",
        _fill_xla_defaults,
    ),
    Patch(
        "xla_training_defaults",
        "the same, for trl's DPOConfig (gradient_checkpointing=True by default: AttributeError: module 'torch' "
        "has no attribute 'xla')",
        _dpo_config_class,
        "__init__",
        _fill_xla_defaults,
    ),
    Patch(
        "packed_mask_on_device",
        "every forward of packed rows (position ids, no attention mask) copies a tensor to the host to "
        "decide whether they are packed (masking_utils.find_packed_sequence_indices): a device sync per step",
        _masking_module,
        "find_packed_sequence_indices",
        _packed_indices_on_device,
    ),
    Patch(
        "dpo_metrics_fixed_shape",
        "trl's DPOTrainer indexes the mean logits by the completion mask to log them: a shape that depends on "
        "each batch's completion lengths, so XLA compiles new graphs at almost every step",
        _dpo_trainer_module,
        "add_fused_lm_head",
        _fixed_shape_dpo_metrics,
    ),
    Patch(
        "dpo_lora_reference",
        "TypeError: 'NoneType' object is not callable (trl's DPOTrainer with LoRA under FSDPv2 does not see the "
        "PeftModel inside the wrapper and calls the absent ref_model)",
        _dpo_trainer_module,
        "is_peft_model",
        _peft_inside_fsdp_v2,
    ),
    Patch(
        "dpo_pretokenised",
        "KeyError: 'chosen' (trl's DPOTrainer tokenises every dataset it is given: pairs tokenised already, in "
        "its own columns, are taken for raw ones and tokenised again)",
        _dpo_trainer_class,
        "_prepare_dataset",
        _takes_prepared_pairs,
    ),
    Patch(
        "mesh_wins",
        "Trainer.__init__ installs its own 1-D (devices, 1) mesh and silently replaces the configured one",
        _trainer_class,
        "__init__",
        _reinstall_mesh,
    ),
]


def apply() -> None:
    """Apply every patch that is not disabled. Idempotent (fsdp_v2 calls it more than once)."""
    for patch in PATCHES:
        if patch.name not in _state["disabled"]:
            patch.apply()


def disable(*names: str) -> None:
    """Remove the named patches and keep them off until ``enable`` (tests show each one is needed)."""
    unknown = set(names) - {patch.name for patch in PATCHES}
    if unknown:
        raise ValueError(f"unknown compat patches {sorted(unknown)}")
    _state["disabled"] |= set(names)
    for patch in PATCHES:
        if patch.name in names:
            patch.remove()


def enable() -> None:
    _state["disabled"] = set()
    apply()


def set_mesh(mesh: Any) -> None:
    _state["mesh"] = mesh


def applied() -> list[str]:
    return [patch.name for patch in PATCHES if patch.applied]


# ---- the native backend (torch 2.15, transformers 5.24: not a patch, called by native/optimizer.py) ----
ADAFACTOR_DTENSOR_ERROR = "aten.add_.Tensor got mixed torch.Tensor and DTensor"


def adafactor_dtensor_state(optimizer: Any) -> int:
    """Creates transformers' Adafactor state for FSDP2's DTensor parameters before the first step.

    Adafactor makes its factored second moments with ``torch.zeros(shape).to(grad)``: a plain tensor of
    the parameter's *global* shape, which its next line adds a DTensor to ("RuntimeError:
    aten.add_.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor";
    transformers 5.24, torch 2.15). Made here as DTensors with the layout DTensor gives the row and
    column means of a parameter (a mean over a sharded dim comes out partial: reduced to replicated),
    with the step count and RMS Adafactor starts from; Adafactor then finds its state and uses it as it
    is. Returns how many parameters got state."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    def whole(stat: Any) -> Any:
        placements = [Replicate() if p.is_partial() else p for p in stat.placements]
        return stat.redistribute(stat.device_mesh, placements)

    primed = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, DTensor) and param.dim() >= 2 and not optimizer.state[param]:
                zeros = torch.zeros_like(param, dtype=torch.float32)
                optimizer.state[param].update(
                    step=0,
                    exp_avg_sq_row=whole(zeros.mean(dim=-1)),
                    exp_avg_sq_col=whole(zeros.mean(dim=-2)),
                    RMS=0,
                )
                if group.get("beta1") is not None:  # the first moment, when one is kept
                    optimizer.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                primed += 1
    return primed


# ---- DCP indexes of a newer torch (the native backend's 2.15) read by the xla venv's torch 2.9 ----
# Not a patch of torch: called by checkpoint/layout.py (shard_extents) and checkpoint/manager.py (the
# storage reader's read_metadata), the two places a checkpoint's .metadata is unpickled.
DCP_INDEX_ERROR = "too many values to unpack (expected 5)"
# Fields a newer torch appends to TensorProperties' pickled state that this code knows to be safe to
# drop: torch 2.15's ``strides`` (None or a tuple of ints; its own reader accepts a state without it).
# A loader only copies each saved chunk into the tensor it already has, in that tensor's layout.
_DROPPABLE_TENSOR_PROPERTIES = ("strides",)


def read_dcp_index(stream: Any) -> Any:
    """The ``torch.distributed.checkpoint`` Metadata pickled in ``stream``, also when a newer torch
    wrote it.

    torch 2.15's ``TensorProperties.__getstate__`` returns 6 values (``dtype, layout, requires_grad,
    memory_format, pin_memory`` and the new trailing ``strides``, default None); torch 2.9's
    ``__setstate__`` unpacks exactly 5, so ``pickle.load`` of any index torch 2.15 wrote fails with
    "ValueError: too many values to unpack (expected 5)" (metadata.py of both versions; every other
    class in the index pickles the same way in both). This unpickler hands TensorProperties a state cut
    to the fields this torch knows, only when what is cut is the known trailing ``strides`` value;
    anything else still fails as before (and checkpoint/layout.py then refuses or skips the
    checkpoint). With a torch that knows every field it changes nothing."""
    import pickle

    tolerant = _tolerant_tensor_properties()

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = super().find_class(module, name)
            return tolerant if found is tolerant.__mro__[1] else found

    return _Unpickler(stream).load()


@functools.cache
def _tolerant_tensor_properties() -> type:
    import dataclasses

    from torch.distributed.checkpoint.metadata import TensorProperties

    known = len(dataclasses.fields(TensorProperties))  # memory_format is pickled as an encoding: 1:1

    class _NewerTensorProperties(TensorProperties):
        def __setstate__(self, state: tuple[Any, ...]) -> None:
            extra = state[known:]
            if extra and not (
                len(extra) <= len(_DROPPABLE_TENSOR_PROPERTIES) and all(_is_strides(v) for v in extra)
            ):
                raise ValueError(
                    f"a checkpoint index field this torch does not know: TensorProperties state {state!r}"
                )
            super().__setstate__(state[:known])
            # The object is torch's own class, as if this torch had read it itself.
            self.__class__ = TensorProperties  # type: ignore[assignment]

    return _NewerTensorProperties


def _is_strides(value: Any) -> bool:
    return value is None or (isinstance(value, tuple) and all(isinstance(v, int) for v in value))
