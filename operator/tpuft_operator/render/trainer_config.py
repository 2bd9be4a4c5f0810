"""TPUFineTune spec -> the trainer's configuration (`tpuft_trainer.config.TrainerConfig`).

Everything the trainer needs to know is written here, resolved: the mesh has explicit sizes, the
world has the shape of the job, LoRA settings are present exactly when the method is LoRA. The hub
token is not: only the *name* of the environment variable that will hold it.
"""

from __future__ import annotations

from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.api.resources import FINETUNE
from tpuft_operator.plan import stop_grace_seconds
from tpuft_operator.render.settings import RenderSettings
from tpuft_operator.topology import SliceShape
from tpuft_trainer.config import (
    DatasetSource,
    DpoConfig,
    FsdpConfig,
    LoraConfig,
    MeshConfig,
    ModelSource,
    OutputConfig,
    ProgressConfig,
    StopConfig,
    TrainerConfig,
    TrainingConfig,
    WorldConfig,
)
from tpuft_trainer.pod_contract import REQUEST_FILE


def mesh_for(ft: TPUFineTune, shape: SliceShape) -> MeshConfig:
    """Explicit axis sizes: fsdp takes every chip of a slice that tensor and data leave; DCN = slices."""
    mesh = ft.spec.fsdp.mesh
    tensor = mesh.tensor if mesh else 1
    data = mesh.data if mesh else 1
    fsdp = mesh.fsdp if mesh and mesh.fsdp is not None else shape.chips_per_slice // (tensor * data)
    return MeshConfig(fsdp=fsdp, tensor=tensor, data=data, dcn_data=shape.slices)


def trainer_config(ft: TPUFineTune, shape: SliceShape, settings: RenderSettings) -> TrainerConfig:
    spec = ft.spec
    training = spec.training
    lora = None
    if training.method == "lora":
        given = training.lora
        lora = (
            LoraConfig(
                r=given.r, alpha=given.alpha, dropout=given.dropout, target_modules=given.target_modules
            )
            if given is not None
            else LoraConfig()
        )
    return TrainerConfig(
        backend=spec.backend,
        model=ModelSource(
            name=spec.model.name,
            revision=spec.model.revision,
            dtype=spec.model.dtype,
            token_env=settings.token_env if spec.model.token_secret_ref is not None else None,
        ),
        dataset=DatasetSource(
            name=spec.dataset.name,
            split=spec.dataset.split,
            format=spec.dataset.format,
            text_field=spec.dataset.text_field,
            messages_field=spec.dataset.messages_field,
            prompt_field=spec.dataset.prompt_field,
            chosen_field=spec.dataset.chosen_field,
            rejected_field=spec.dataset.rejected_field,
            packing=spec.dataset.packing,
            assistant_only_loss=spec.dataset.assistant_only_loss,
            eval_split=spec.dataset.eval_split,
            eval_fraction=spec.dataset.eval_fraction,
        ),
        fsdp=FsdpConfig(
            layer_cls_to_wrap=spec.fsdp.layer_cls_to_wrap,
            gradient_checkpointing=spec.fsdp.gradient_checkpointing,
            mesh=mesh_for(ft, shape),
            compilation_cache_path=spec.fsdp.compilation_cache_path,
        ),
        training=TrainingConfig(
            method=training.method,
            objective=training.objective,
            # Present exactly when the objective is dpo, resolved (the defaults written out).
            dpo=(
                DpoConfig(
                    beta=training.dpo.beta if training.dpo else DpoConfig().beta,
                    loss_type=training.dpo.loss_type if training.dpo else DpoConfig().loss_type,
                )
                if training.objective == "dpo"
                else None
            ),
            max_steps=training.max_steps,
            epochs=training.epochs,
            learning_rate=training.learning_rate,
            per_device_batch_size=training.per_device_batch_size,
            max_seq_length=training.max_seq_length,
            optimizer=training.optimizer,
            save_steps=training.save_steps,
            lora=lora,
            eval_steps=training.eval_steps,
            logging_steps=training.logging_steps,
            lr_scheduler=training.lr_scheduler,
            warmup_steps=training.warmup_steps,
            warmup_ratio=training.warmup_ratio,
            weight_decay=training.weight_decay,
            max_grad_norm=training.max_grad_norm,
            gradient_accumulation_steps=training.gradient_accumulation_steps,
        ),
        output=OutputConfig(uri=spec.output.uri),
        world=WorldConfig(
            slices=shape.slices,
            hosts_per_slice=shape.hosts_per_slice,
            chips_per_host=shape.chips_per_host,
            peak_flops_per_chip=shape.family.peak_bf16_tflops_per_chip * 1e12,
        ),
        progress=ProgressConfig(
            namespace=ft.metadata.namespace,
            name=ft.metadata.name,
            min_interval_seconds=settings.progress_min_interval_seconds,
            group=FINETUNE.group,
            version=FINETUNE.version,
            plural=FINETUNE.plural,
        ),
        # The request file is read whatever spec.maintenance says: with `ignore` the operator just
        # never writes a request.
        # The shortest grace a stop gives: a Spot reclaim's (~15 s) when the run is on Spot. What the
        # trainer reports with each save, and condition CheckpointSlow compares its saves with.
        stop=StopConfig(
            grace_seconds=stop_grace_seconds(ft.spec, settings.termination_grace_period_seconds),
            spot=ft.spec.tpu.spot,
            request_file=REQUEST_FILE,
        ),
    )
