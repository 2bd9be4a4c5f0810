"""Preference tuning (DPO): trl's DPOTrainer on the same FSDPv2 mesh, checkpoints and callbacks as SFT.

- Rows: a prompt, a chosen and a rejected completion (``dataset.promptField`` ... ``rejectedField``),
  each a string or a list of chat messages. They are tokenised once, as trl's DPOTrainer would
  (chat lists with the chat template, EOS appended to plain strings), by ``tpuft prepare`` or the
  first start (data/preference.py), and DPOTrainer takes them as they are (compat.dpo_pretokenised):
  no host tokenises them at start or after a restart.
- Fixed shapes: every batch is ``2 x global batch`` rows (the chosen then the rejected completions) of
  exactly ``max_seq_length`` positions: prompt + completion is cut to it (``keep_start``) and padded
  to a multiple of it, so XLA compiles the same graphs at every step.
- The reference: with LoRA the base model with the adapters disabled (trl does it; no second copy);
  with full fine-tuning a frozen copy, wrapped by the same FSDPv2 function as the policy, so it is
  sharded the same way (``tpuft plan`` counts it). Why not trl's precomputed reference log-probs:
  they are computed in DPOTrainer's ``__init__``, before the Trainer shards the policy, so every
  device would hold the whole model and run the whole dataset's reference forwards unsharded; and a
  restarted run recomputes them (in-memory rows have no cache file).
- Metrics: trl logs the DPO loss as ``loss`` and ``rewards/accuracies``, ``rewards/margins`` beside it;
  the run record and ``status.progress`` carry them.
"""

from __future__ import annotations

import logging
from typing import Any

from tpuft_trainer.config import TrainerConfig

log = logging.getLogger(__name__)

# trl's logged metrics -> the run record's and status.progress's names.
REWARD_ACCURACY = "rewards/accuracies"
REWARD_MARGIN = "rewards/margins"


def arguments(config: TrainerConfig) -> dict[str, Any]:
    """DPOConfig's own settings (besides the TrainingArguments the SFT path uses too)."""
    settings = config.training.dpo_settings
    length = config.training.max_seq_length
    return dict(
        beta=settings.beta,
        loss_type=[settings.loss_type],
        # One shape for every batch: prompt + completion cut to max_length, then padded to a multiple
        # of it (trl pads to the longest row of the batch otherwise: a new graph for each length).
        max_length=length,
        pad_to_multiple_of=length,
        truncation_mode="keep_start",
        # The reference's log-probs at every step (see the module docstring for why not precomputed).
        precompute_ref_log_probs=False,
        # trl defaults to bf16 autocast; the model's dtype (model.dtype) decides, as for SFT.
        bf16=False,
        # The Trainer keeps only the model's input columns otherwise; trl picks its own.
        remove_unused_columns=False,
    )


def load_reference(config: TrainerConfig, location: str) -> Any | None:
    """The frozen reference for full fine-tuning (None with LoRA: the adapters are disabled instead)."""
    if config.training.method == "lora":
        return None

    from tpuft_trainer import loading

    reference = loading.load_model(config.model, location).model
    reference.requires_grad_(False)
    return reference.eval()


def shard_reference(trainer: Any) -> None:
    """Wrap the reference with the Trainer's own FSDPv2 function (the policy's is wrapped in ``train``)
    and split its projections over the ``tensor`` axis as the policy's are (mesh.shard_tensor_parallel,
    which train.py applies to the policy when training begins): the same layer classes, the same
    parameter sharding over the same mesh, so the frozen copy costs P / (fsdp x tensor) per chip too."""
    if getattr(trainer, "ref_model", None) is None:
        return
    import torch_xla.distributed.spmd as xs
    import transformers.trainer

    from tpuft_trainer.mesh import shard_tensor_parallel

    trainer.ref_model = transformers.trainer.wrap_model_xla_fsdp(trainer.ref_model, trainer.args, True)
    shard_tensor_parallel(trainer.ref_model, xs.get_global_mesh())
    trainer.ref_model.eval()


def reference_sharding(trainer: Any) -> dict[str, str]:
    """The sharding spec of every parameter of the frozen reference (empty with LoRA: there is none)."""
    reference = getattr(trainer, "ref_model", None)
    if reference is None:
        return {}
    import torch_xla

    return {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in reference.named_parameters()}


def build_trainer(
    config: TrainerConfig,
    model: Any,
    reference: Any | None,
    lora: Any | None,
    tokenizer: Any,
    dataset: Any,
    eval_dataset: Any,
    training_arguments: dict[str, Any],
    callbacks: list[Any],
) -> Any:
    from trl import DPOConfig, DPOTrainer

    from tpuft_trainer.checkpoint.hf_trainer import with_sharded_checkpoints

    args = DPOConfig(**training_arguments, **arguments(config))
    # The pairs are prepared (data/preference.py): DPOTrainer takes them without tokenising again
    # (compat.dpo_pretokenised, applied with the other patches by fsdp_v2.use_fsdp_v2).
    trainer = with_sharded_checkpoints(DPOTrainer)(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=lora,
    )
    shard_reference(trainer)
    return trainer
