"""The trainer's configuration contract: what the operator renders and `tpuft train --config` reads.

This module is imported by the operator too, so it must stay light: pydantic and the standard
library only (a test imports it with torch blocked).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpuft_trainer import block_yaml
from tpuft_trainer.errors import ConfigError

CONFIG_VERSION: Final = "tpuft.dev/trainer-config/v1"


_SURROGATE = re.compile("[\ud800-\udfff]")


class UnicodeSafeLoader(yaml.SafeLoader):
    """safe_load that reads JSON's escapes of a character beyond the first 65536 as that character.

    JSON (a YAML subset, and what `json.dumps` writes) spells U+1F600 as the pair "\\ud83d\\ude00";
    PyYAML reads the pair as two lone surrogates, a string no encoder takes: LibYAML's emitter then
    raised UnicodeEncodeError on the trainer config (found by tests/unit/test_fuzz_trainer_config.py),
    and the characters were wrong anyway. Here a pair becomes its character, and a surrogate without
    its pair is a YAML error at its line and column."""

    def construct_scalar(self, node: yaml.ScalarNode | yaml.MappingNode) -> str:
        value = str(super().construct_scalar(node))
        if _SURROGATE.search(value) is None:
            return value
        try:
            return value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                "an escaped surrogate (\\ud800-\\udfff) without its pair is not a character",
                node.start_mark,
            ) from None


class _NoAliasLoader(UnicodeSafeLoader):
    """safe_load without anchors and aliases: the operator never writes them, and a "billion laughs"
    document of nested aliases is tiny to load but makes any error message that prints it explode."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed", mark)
        return super().compose_node(parent, index)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Strict):
    name: str = Field(description="Hub model id, gs:// URI, or local directory")
    revision: str | None = None
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # Name of the environment variable that holds the hub token (set by the JobSet from a Secret
    # through secretKeyRef); the token itself never appears in this file.
    token_env: str | None = None


class DatasetSource(_Strict):
    name: str = Field(description="Hub dataset id, gs:// URI, or local file/directory")
    split: str = "train"
    # text/chat: rows to imitate (SFT); preference: a prompt and a chosen and a rejected completion
    # (DPO), each a string or a list of chat messages (rendered with the chat template).
    format: Literal["text", "chat", "preference"] = "text"
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # Whole documents concatenated into rows of max_seq_length, isolated by position ids (packing.py).
    packing: bool = False
    # Loss on the assistant's turns only (chat.py). None: true for format chat; text has no turns.
    assistant_only_loss: bool | None = None
    # Evaluation rows: another split of the same source, or a fraction held out by training.seed.
    eval_split: str | None = None
    eval_fraction: float | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="after")
    def _consistent(self) -> DatasetSource:
        if self.eval_split is not None and self.eval_fraction is not None:
            raise ValueError("set at most one of eval_split and eval_fraction")
        if self.assistant_only_loss and self.format != "chat":
            raise ValueError("assistant_only_loss needs format chat (text rows have no assistant turns)")
        if self.packing and self.format == "preference":
            raise ValueError("packing needs format text or chat (preference pairs are scored as whole rows)")
        return self

    @property
    def trains_on_assistant_only(self) -> bool:
        return self.format == "chat" and self.assistant_only_loss is not False


class MeshConfig(_Strict):
    """Device mesh axis sizes. Within a slice (ICI): fsdp x tensor x data = chips per slice.
    Across slices (DCN): ``dcn_data`` = number of slices (pure data parallelism over DCN)."""

    fsdp: int | None = Field(default=None, ge=1, description="Default: every chip of a slice")
    tensor: int = Field(default=1, ge=1)
    data: int = Field(default=1, ge=1)
    dcn_data: int = Field(default=1, ge=1)


class FsdpConfig(_Strict):
    layer_cls_to_wrap: list[str] | None = None
    gradient_checkpointing: bool = True
    mesh: MeshConfig = MeshConfig()
    # XLA's persistent compilation cache: a directory every host sees (rank 0 writes, the others read).
    compilation_cache_path: str | None = None


class LoraConfig(_Strict):
    r: int = Field(default=16, ge=1)
    alpha: int = Field(default=32, ge=1)
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None
    # Also save base + adapter merged into one standard model next to the adapter.
    save_merged: bool = False


# trl's DPO losses that are elementwise in the pair's log-ratios: one fixed-shape graph under XLA. Not
# offered: "sft" (boolean indexing, a data-dependent shape), "aot" (sorts across the batch, so the
# loss of a pair depends on how the batch is sharded), and those that need more settings.
DPO_LOSS_TYPES: Final = ("sigmoid", "hinge", "ipo")


class DpoConfig(_Strict):
    """Direct preference optimisation (trl's DPOTrainer): how far the policy may move from the
    reference (beta) and the loss on the pair's log-ratio margin."""

    beta: float = Field(default=0.1, gt=0, le=10)
    loss_type: Literal["sigmoid", "hinge", "ipo"] = "sigmoid"


class TrainingConfig(_Strict):
    method: Literal["full", "lora"] = "full"
    # sft: imitate the rows; dpo: prefer the chosen completion over the rejected one (format preference).
    objective: Literal["sft", "dpo"] = "sft"
    dpo: DpoConfig | None = None
    max_steps: int | None = Field(default=None, ge=1)
    epochs: float | None = Field(default=None, gt=0)
    learning_rate: float = Field(default=2e-5, gt=0)
    per_device_batch_size: int = Field(default=8, ge=1)
    max_seq_length: int = Field(default=1024, ge=8)
    optimizer: Literal["adafactor", "adamw"] = "adafactor"
    save_steps: int | None = Field(default=None, ge=1)
    # Checkpoints kept at the output (oldest deleted first); None keeps them all.
    keep_checkpoints: int | None = Field(default=None, ge=1)
    # Read the loss to the host (a sync) every N steps and at the last (progress.py); progress goes out at
    # every step regardless. The API's default is 10 (docs/trainer.md, "Reading the loss"), which the
    # operator always writes; 1 here keeps a loss per step for configs written by hand (and the tests).
    logging_steps: int = Field(default=1, ge=1)
    seed: int = 42
    lora: LoraConfig | None = None
    # Evaluate every N steps (and always at the end when the dataset has evaluation rows).
    eval_steps: int | None = Field(default=None, ge=1)
    # Learning-rate schedule: warmup (steps, or a fraction of the run), then the scheduler's shape.
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    warmup_steps: int | None = Field(default=None, ge=0)
    warmup_ratio: float | None = Field(default=None, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    # Clip the global gradient norm to this (0: no clipping). transformers' default.
    max_grad_norm: float = Field(default=1.0, ge=0)
    # Micro-batches per optimizer step: the step's batch is this x the global batch.
    gradient_accumulation_steps: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _one_length(self) -> TrainingConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("one of max_steps or epochs is required")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("set at most one of warmup_steps and warmup_ratio")
        if self.dpo is not None and self.objective != "dpo":
            raise ValueError("training.dpo is set but training.objective is not dpo")
        return self

    @property
    def dpo_settings(self) -> DpoConfig:
        return self.dpo or DpoConfig()


class OutputConfig(_Strict):
    uri: str = Field(description="gs:// URI or a path on a mounted volume")


class WorldConfig(_Strict):
    """The shape of the job, so every host knows its place without GKE-only variables."""

    slices: int = Field(default=1, ge=1)
    hosts_per_slice: int = Field(default=1, ge=1)
    chips_per_host: int = Field(default=1, ge=1)
    # Peak dense bf16 FLOP/s of one chip (the operator's topology catalog), for the MFU estimate.
    peak_flops_per_chip: float | None = Field(default=None, gt=0)


class StopConfig(_Strict):
    """How a run stops without losing work (stop.py): the time the shortest stop gives the pods after
    SIGTERM, whether the run is on Spot VMs, the file in which the operator asks for a checkpoint now,
    and the port the hosts agree over."""

    # The shortest stop's grace: the pods' terminationGracePeriodSeconds, or on Spot what a reclaim
    # gives (GKE: ~15 s of the VM's 30 s notice, whatever the pods' grace period says).
    grace_seconds: float = Field(default=60.0, gt=0)
    # On Spot a longer terminationGracePeriodSeconds gives a reclaim nothing: what to advise when a
    # save is slow differs (stop.slow_save_advice).
    spot: bool = False
    # A relative path is relative to the config file's directory: both come from the same volume.
    request_file: str | None = None
    # The first host listens here (TPUFT_COORDINATOR_ADDRESS) for the other hosts' stop channel.
    coordination_port: int = Field(default=29500, ge=1, le=65535)


class ProgressConfig(_Strict):
    """Where rank 0 reports progress. ``None`` fields mean: do not report (never an error)."""

    namespace: str | None = None
    name: str | None = None
    min_interval_seconds: float = Field(default=10.0, ge=0)
    # The TPUFineTune's API coordinates, so the trainer patches exactly what the operator serves.
    group: str = "tpuft.dev"
    version: str = "v1alpha1"
    plural: str = "tpufinetunes"


# The tensor runtimes a run may train on: PyTorch/XLA SPMD (one process per host, torch_xla 2.9), or
# torch-native FSDP2/DTensor (one process per chip: TorchTPU on a slice, gloo on CPU in the tests).
# Both read the same prepared datasets and write checkpoints of the same layout and keys.
BACKENDS: Final = ("xla", "native")


class TrainerConfig(_Strict):
    version: Literal["tpuft.dev/trainer-config/v1"] = CONFIG_VERSION
    backend: Literal["xla", "native"] = "xla"
    model: ModelSource
    dataset: DatasetSource
    fsdp: FsdpConfig = FsdpConfig()
    training: TrainingConfig
    output: OutputConfig
    world: WorldConfig = WorldConfig()
    progress: ProgressConfig = ProgressConfig()
    stop: StopConfig = StopConfig()

    @model_validator(mode="after")
    def _objective_matches_format(self) -> TrainerConfig:
        preference = self.dataset.format == "preference"
        if self.training.objective == "dpo" and not preference:
            raise ValueError(
                "training.objective dpo needs dataset.format preference (prompt, chosen, rejected)"
            )
        if preference and self.training.objective != "dpo":
            raise ValueError("dataset.format preference needs training.objective dpo")
        if (
            self.backend == "native"
            and self.fsdp.mesh.tensor > 1
            and (self.training.method == "lora" or self.training.objective == "dpo")
        ):
            raise ValueError(
                "fsdp.mesh.tensor > 1 on backend native trains method full with objective sft only: "
                "transformers' tensor-parallel plan names the base model's linear layers (peft's LoRA "
                "layers wrap them), and trl's fused LM head for DPO reads the LM head's weight whole"
            )
        return self

    def data_settings(self) -> dict[str, object]:
        """Every setting that decides the prepared dataset's content (data/prepared.py), and nothing
        else: a change of any of them prepares the data again, a change of anything else (steps,
        learning rate, the TPU shape) reuses it. The trainer's fingerprint adds what only it can read
        (the tokenizer's files, the dataset's files); the operator keys its prepare Job on these."""
        return {
            "model": {"name": self.model.name, "revision": self.model.revision},
            "dataset": self.dataset.model_dump(mode="json"),
            "maxSeqLength": self.training.max_seq_length,
            "seed": self.training.seed,
            "objective": self.training.objective,
        }

    def to_yaml(self) -> str:
        # PyYAML's text, written faster (the operator renders one per run): see block_yaml.
        return block_yaml.dump(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def from_yaml(cls, text: str) -> TrainerConfig:
        """Raises pydantic's ValidationError (valid YAML, wrong content) or ConfigError (not YAML)."""
        try:
            data = yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader
        except Exception as error:
            # Not only YAMLError: RecursionError (nesting deeper than the stack), ValueError (an integer
            # too long to convert), IndexError/AttributeError (PyYAML on `!!float ''`, `!!timestamp ''`).
            raise ConfigError(f"not a valid YAML document: {str(error)[:500]}") from None
        return cls.model_validate(data)

    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        config = cls.from_yaml(Path(path).read_text())
        request = config.stop.request_file
        if request is not None and not Path(request).is_absolute():
            located = str(Path(path).parent / request)
            config = config.model_copy(
                update={"stop": config.stop.model_copy(update={"request_file": located})}
            )
        return config
