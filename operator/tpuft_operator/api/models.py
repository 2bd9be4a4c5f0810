"""The TPUFineTune API (tpuft.dev/v1alpha1) as pydantic models: the one source of truth.

The CRD's OpenAPI schema (`api/crd.py`), the API reference (`docs/api.md`), the trainer configuration
(`render/`) and `tpuft plan` all come from these classes. Field names are snake_case in Python and
camelCase on the wire (aliases); descriptions are what `kubectl explain tpufinetune.spec...` prints,
so they are written for the person filling in the YAML.

Bounds (maxLength, maxItems) are not decoration: the apiserver estimates the cost of every CEL rule
from them and refuses a CRD whose rules could be too expensive.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints
from pydantic.alias_generators import to_camel

from tpuft_operator.api import cel
from tpuft_operator.api.resources import FINETUNE
from tpuft_operator.topology import FAMILIES

# From the one table of API coordinates (api/resources.py); TPUFineTune's Literal types spell them
# out, and a unit test holds them equal.
GROUP = FINETUNE.group
VERSION = FINETUNE.version
API_VERSION = FINETUNE.api_version
KIND = FINETUNE.kind
PLURAL = FINETUNE.plural
SINGULAR = "tpufinetune"
SHORT_NAMES = ("tpuft", "tft")

# Kubernetes name formats (RFC 1123), as the apiserver checks them for the objects they refer to.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# The Kubernetes resource.Quantity grammar (the same pattern Kubernetes' own CRDs carry).
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
MAX_SLICES = 256
# The pods' termination grace period when the spec sets none (the operator's default setting).
DEFAULT_GRACE_SECONDS = 60
# What a Spot reclaim gives ordinary pods on GKE whatever their grace period says: the VM gets 30 s of
# notice and the kubelet's graceful node shutdown gives the first 15 to non-system pods (GKE's Spot VMs
# page, https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms). Standard node pools on
# GKE 1.35.0-gke.1171000 or later can raise the total to 120 s through node system config.
SPOT_GRACE_SECONDS = 15
SPOT_GRACE_MAX_SECONDS = 120
# training.loggingSteps' default, from a measurement: docs/trainer.md, "Reading the loss".
DEFAULT_LOGGING_STEPS = 10
_HOST_SIZES: list[JsonValue] = [*sorted({c for f in FAMILIES.values() for c in f.machine_types})]

DnsLabel = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_LABEL)]
DnsSubdomain = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=256)]
PythonName = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")
]
ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
Quantity = Annotated[int | str, Field(json_schema_extra={"x-tpuft-quantity": True})]
# A label value, as the apiserver checks one on a nodeSelector (keys are checked by validation.py).
LabelValue = Annotated[
    str, StringConstraints(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
]


class _Spec(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected (as kubectl does)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, use_enum_values=True
    )


# --------------------------------------------------------------------------------------------- spec


class SecretKeyRef(_Spec):
    """A key of a Secret in the TPUFineTune's namespace."""

    name: DnsSubdomain = Field(description="Name of the Secret.")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=SECRET_KEY)] = Field(
        description="Key inside the Secret whose value is used."
    )


class ModelSpec(_Spec):
    """The model to fine-tune."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        description=(
            "The base model: a Hugging Face hub id (`google/gemma-2-2b`), a `gs://bucket/path` URI, "
            "or an absolute path on a mounted volume (`/models/llama`)."
        )
    )
    revision: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = Field(
        default=None, description="Hub revision (branch, tag or commit) to load. Default: the hub's default."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16",
        description="Data type of weights and activations. bfloat16 is native on TPUs and halves memory.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret holding a hub token, for gated or private models. It reaches the trainer only as an "
            "environment variable (secretKeyRef); it never appears in the rendered configuration."
        ),
    )


class DatasetSpec(_Spec):
    """The training data."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": cel.as_json(cel.dataset_rules())}
    )

    name: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        description=(
            "A Hugging Face hub dataset id, a `gs://` URI, or an absolute path (file or directory of "
            "JSON Lines, Parquet or text) on a mounted volume."
        )
    )
    split: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="train", description="Dataset split to train on."
    )
    format: Literal["text", "chat", "preference"] = Field(
        default="text",
        description=(
            "`text`: each record has one text field (textField). `chat`: each record has a list of "
            "{role, content} messages (messagesField), rendered with the model's chat template. "
            "`preference` (training.objective `dpo` only): each record has a prompt, a chosen and a "
            "rejected completion (promptField, chosenField, rejectedField), all strings or all lists of "
            "{role, content} messages (rendered with the chat template)."
        ),
    )
    text_field: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="text", description="Field holding the text, for format `text`."
    )
    messages_field: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="messages", description="Field holding the messages list, for format `chat`."
    )
    prompt_field: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="prompt", description="Field holding the prompt, for format `preference`."
    )
    chosen_field: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="chosen", description="Field holding the preferred completion, for format `preference`."
    )
    rejected_field: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        default="rejected", description="Field holding the rejected completion, for format `preference`."
    )
    packing: bool = Field(
        default=False,
        description=(
            "Pack whole documents (rows of text, or conversations) into each sequence of maxSeqLength "
            "instead of padding each one to it: on data shorter than the sequence, most of a padded step "
            "is padding. Documents never attend to each other and no loss crosses their boundaries "
            "(position ids restart per document). Supported for the Llama, Gemma, Mistral, Mixtral, Qwen "
            "and Phi-3 families; others are refused."
        ),
    )
    assistant_only_loss: bool | None = Field(
        default=None,
        description=(
            "Format `chat` only: compute the loss on the assistant's turns alone, not on the system's and "
            "user's. Default: true for chat. Uses the chat template's {% generation %} markers, or "
            "renders each turn's prefix and checks the template is prefix-stable (a template that is "
            "not fails the run with a data error; set false to train on every token)."
        ),
    )
    eval_split: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = Field(
        default=None,
        description=(
            "A split of the same dataset to evaluate on (e.g. `validation`). At most one of evalSplit "
            "and evalFraction."
        ),
    )
    eval_fraction: float | None = Field(
        default=None,
        gt=0,
        le=0.5,
        description=(
            "Hold out this fraction of the training rows for evaluation, chosen by training.seed (the "
            "same rows on every restart). At most one of evalSplit and evalFraction."
        ),
    )


class TpuSpec(_Spec):
    """The TPU slices to train on. Every slice has the same type and topology."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": cel.as_json(cel.tpu_rules())})

    type: Literal["v4", "v5e", "v5p", "v6e", "tpu7x"] = Field(
        description=(
            "TPU generation: v4, v5e, v5p, v6e (Trillium) or tpu7x (Ironwood). Sets the node selector "
            "cloud.google.com/gke-tpu-accelerator."
        )
    )
    topology: Annotated[str, StringConstraints(min_length=3, max_length=14, pattern=cel.TOPOLOGY_PATTERN)] = (
        Field(
            description=(
                "Chips of one slice and their arrangement: AxB for v5e and v6e (1x1, 2x2, 2x4, 4x4, ... 16x16), "
                "AxBxC for v4, v5p and tpu7x (2x2x1, 2x2x2, 2x2x4, 2x4x4, then multiples of 4 in ascending "
                "order such as 4x4x8). Chips per slice = the product. See docs/topology.md."
            )
        )
    )
    slices: int = Field(
        default=1,
        ge=1,
        le=MAX_SLICES,
        description=(
            "Number of identical slices (multislice over the data-center network). More than one needs "
            "multi-host slices."
        ),
    )
    chips_per_host: int | None = Field(
        default=None,
        # The machine sizes of every family, from the catalog; which ones a type offers is a CEL rule.
        json_schema_extra={"enum": _HOST_SIZES},
        description=(
            "Chips per TPU VM (the google.com/tpu request of each pod). Default: 4, or all chips when the "
            "slice has fewer. Set 8 to run a v5e/v6e 2x4 slice on one 8-chip VM instead of two 4-chip "
            "VMs; 1 and 8 exist only as single-host slices of exactly that many chips."
        ),
    )
    spot: bool = Field(
        default=False,
        description=(
            "Run on Spot VMs (node selector cloud.google.com/gke-spot=true). A reclaim gives the pods about "
            f"{SPOT_GRACE_SECONDS} s after SIGTERM whatever terminationGracePeriodSeconds says (GKE: 30 s of "
            f"notice, {SPOT_GRACE_SECONDS} of them for ordinary pods): a stop's save that takes longer is cut "
            "off, and the steps since the last complete checkpoint are trained again (status.goodput."
            "redoneSteps). tpuft plan and condition CheckpointSlow compare the save with it; keep "
            "training.saveSteps small enough to bound that loss. Reclaims restart the run."
        ),
    )
    spot_grace_period_seconds: int | None = Field(
        default=None,
        ge=1,
        le=SPOT_GRACE_MAX_SECONDS,
        description=(
            f"With spot: the seconds a reclaim really gives the pods on this node pool. Default {SPOT_GRACE_SECONDS}. "
            f"Set more only for a Standard node pool whose node system config raises the shutdown grace "
            f"(GKE 1.35.0-gke.1171000 or later, at most {SPOT_GRACE_MAX_SECONDS} s in all)."
        ),
    )
    reservation: DnsLabel | None = Field(
        default=None,
        description=(
            "Name of a specific reservation (same project) whose nodes the pods must run on: node selector "
            "cloud.google.com/reservation-name, how GKE's node auto-provisioning and Autopilot consume a "
            "reservation. Leave it unset for a node pool you created with --reservation-affinity=specific: "
            "the pool consumes the reservation and the accelerator and topology select it, as xpk does "
            '(docs/install-gke.md, "Reservations").'
        ),
    )
    placement_policy: DnsLabel | None = Field(
        default=None,
        description=(
            "Ironwood (tpu7x) multi-host only: name of the workload policy the node pool was created with "
            "(node selector cloud.google.com/placement-policy-name)."
        ),
    )


class MeshSpec(_Spec):
    """Device mesh axis sizes within one slice. fsdp x tensor x data = chips per slice; slices add the
    DCN (data-center network) data axis on top."""

    fsdp: int | None = Field(
        default=None,
        ge=1,
        le=9216,
        description="Chips that shard parameters (FSDP). Default: every chip left.",
    )
    tensor: int = Field(default=1, ge=1, le=9216, description="Tensor-parallel axis size.")
    data: int = Field(default=1, ge=1, le=9216, description="Data-parallel axis size within a slice.")


class FsdpSpec(_Spec):
    """PyTorch/XLA FSDPv2 (SPMD) settings."""

    layer_cls_to_wrap: list[PythonName] | None = Field(
        default=None,
        max_length=16,
        description=(
            "Transformer layer classes to wrap (e.g. `LlamaDecoderLayer`, or a dotted import path). "
            "Default: the model's own decoder layer class (`_no_split_modules`)."
        ),
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description="Recompute activations in the backward pass: far less memory for ~30% more compute.",
    )
    mesh: MeshSpec | None = Field(
        default=None, description="Mesh axis sizes. Default: all chips of a slice on the fsdp axis."
    )
    compilation_cache_path: (
        Annotated[str, StringConstraints(min_length=2, max_length=1024, pattern=r"^/")] | None
    ) = Field(
        default=None,
        description=(
            "XLA's persistent compilation cache: a directory inside one of spec.volumeMounts that "
            "every host sees (a ReadWriteMany volume, Filestore, GCS FUSE). The first host writes, the "
            "others read; a restarted run loads its compiled graphs instead of compiling again (a TPU "
            "gain: on CPU, torch_xla 2.9 writes entries it cannot read)."
        ),
    )


class LoraSpec(_Spec):
    """LoRA adapter settings (method `lora`)."""

    r: int = Field(default=16, ge=1, le=1024, description="Rank of the adapter matrices.")
    alpha: int = Field(default=32, ge=1, le=4096, description="Scaling numerator (scale = alpha / r).")
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[ModuleName] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Module names to adapt (e.g. q_proj, v_proj), or `all-linear`. Default: the PEFT default for "
            "the model's architecture."
        ),
    )


class DpoSpec(_Spec):
    """Direct preference optimisation settings (objective `dpo`)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description=(
            "How strongly the policy is held to the reference model: the DPO temperature. Smaller moves "
            "further from the reference; trl's default, 0.1, is the common choice."
        ),
    )
    loss_type: Literal["sigmoid", "hinge", "ipo"] = Field(
        default="sigmoid",
        description=(
            "`sigmoid`: the DPO loss. `hinge`: the SLiC hinge loss on the margin. `ipo`: IPO's squared "
            "loss (length-normalised). trl's other losses are not offered: they sort or index the batch "
            "by data-dependent shapes under XLA, or need more settings."
        ),
    )


class TrainingSpec(_Spec):
    """Hyperparameters. Set exactly one of maxSteps or epochs."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": cel.as_json(cel.training_rules())}
    )

    method: Literal["full", "lora"] = Field(
        default="full", description="`full`: train every parameter. `lora`: train low-rank adapters only."
    )
    objective: Literal["sft", "dpo"] = Field(
        default="sft",
        description=(
            "`sft`: learn to produce the rows (formats `text` and `chat`). `dpo`: direct preference "
            "optimisation, prefer the chosen completion over the rejected one relative to a frozen "
            "reference (format `preference`). With method `full` the reference is a second copy of the "
            "model, sharded like it; with `lora` it is the base model with the adapter disabled."
        ),
    )
    dpo: DpoSpec | None = Field(default=None, description="DPO settings; only with objective `dpo`.")
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000, description="Optimizer steps to run.")
    epochs: float | None = Field(
        default=None, gt=0, le=1000, description="Passes over the dataset (may be fractional)."
    )
    learning_rate: float = Field(default=2e-5, gt=0, le=1, description="Peak learning rate.")
    per_device_batch_size: int = Field(
        default=8,
        ge=1,
        le=4096,
        description=(
            "Sequences per chip per step (global batch = this x chips); with objective `dpo`, preference "
            "pairs (two sequences each)."
        ),
    )
    max_seq_length: int = Field(
        default=1024, ge=8, le=1_048_576, description="Tokens per sequence (padded or packed to this length)."
    )
    optimizer: Literal["adafactor", "adamw"] = Field(
        default="adafactor",
        description="`adafactor` (factored second moments, little memory) or `adamw` (two states per parameter).",
    )
    save_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Checkpoint every N steps (to output.uri). Default: at the end only.",
    )
    lora: LoraSpec | None = Field(default=None, description="LoRA settings; only with method `lora`.")
    eval_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description=(
            "Evaluate every N steps (needs dataset.evalSplit or evalFraction). With evaluation rows the "
            "run always evaluates at the end too."
        ),
    )
    logging_steps: int = Field(
        default=DEFAULT_LOGGING_STEPS,
        ge=1,
        le=10_000_000,
        description=(
            "Read the training loss every N steps: status.progress.loss, the logs and TensorBoard get the "
            "mean of the N steps at each Nth step and at the last. Each read waits for the chips to finish "
            "(a host-device sync; the default keeps its cost to a tenth, docs/trainer.md); 1 gives every "
            "step's loss. status.progress's step, throughput and ETA advance at every step either way."
        ),
    )
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field(
        default="linear",
        description=(
            "Learning-rate schedule after warmup: `linear` decay to 0, `cosine` decay to 0, or `constant` "
            "at learningRate."
        ),
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="Steps of linear warmup from 0 to learningRate. At most one of warmupSteps and warmupRatio.",
    )
    warmup_ratio: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Warmup as a fraction of the run's steps (rounded up). At most one of warmupSteps and warmupRatio.",
    )
    weight_decay: float = Field(
        default=0.0, ge=0, le=1, description="Decoupled weight decay of the optimizer (AdamW-style)."
    )
    max_grad_norm: float = Field(
        default=1.0,
        ge=0,
        le=1_000_000,
        description="Clip the global gradient norm to this before each update; 0 turns clipping off.",
    )
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        le=4096,
        description=(
            "Micro-batches per optimizer step: each step trains on this x perDeviceBatchSize x chips "
            "sequences, for a larger batch than fits in memory at once."
        ),
    )


class OutputSpec(_Spec):
    """Where checkpoints and the final model go."""

    uri: Annotated[str, StringConstraints(min_length=2, max_length=1024)] = Field(
        description="A `gs://bucket/prefix` URI or an absolute path on a mounted volume."
    )


class Toleration(_Spec):
    """A Kubernetes toleration, added to the trainer pods."""

    key: Annotated[str, StringConstraints(max_length=317)] | None = Field(
        default=None, description="Taint key; empty with operator Exists matches every taint."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Annotated[str, StringConstraints(max_length=63)] | None = Field(
        default=None, description="Taint value (operator Equal)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class KeyRef(_Spec):
    """A key of a Secret or ConfigMap."""

    name: DnsSubdomain = Field(description="Name of the Secret or ConfigMap.")
    key: Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=SECRET_KEY)] = Field(
        description="The key."
    )
    optional: bool | None = Field(default=None, description="Start even if the key does not exist.")


class FieldRef(_Spec):
    """A field of the pod (downward API)."""

    field_path: Annotated[str, StringConstraints(min_length=1, max_length=256)] = Field(
        description="Path of the field, e.g. `metadata.name` or `status.hostIP`."
    )
    api_version: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="API version of fieldPath (default v1)."
    )


class EnvVarSource(_Spec):
    """Where an environment variable's value comes from (one of the fields)."""

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldRef | None = Field(default=None, description="A field of the pod.")


class EnvVar(_Spec):
    """An environment variable for the trainer container."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ENV_NAME)] = Field(
        description="Variable name."
    )
    value: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="Literal value."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="Value from a Secret, ConfigMap or pod field."
    )


class VolumeMount(_Spec):
    """Mounts one of spec.volumes into the trainer container."""

    name: DnsLabel = Field(description="Name of a volume in spec.volumes.")
    mount_path: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^/")] = Field(
        description="Absolute path in the container."
    )
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    sub_path: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Path inside the volume to mount instead of its root."
    )


class Resources(_Spec):
    """Extra resources for the trainer container (CPU, memory, ephemeral storage). google.com/tpu is
    set from the topology and must not appear here."""

    requests: dict[str, Quantity] | None = Field(
        default=None, max_length=16, description="Resource requests, e.g. {memory: 200Gi}."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, max_length=16, description="Resource limits, e.g. {memory: 400Gi}."
    )


class NetworkSpec(_Spec):
    """The trainer pods' networking."""

    host_network: bool = Field(
        default=False,
        description=(
            "Run the trainer pods in their TPU VM's network namespace (pod hostNetwork, dnsPolicy "
            "ClusterFirstWithHostNet), as xpk and Google's Ironwood multislice sample do: traffic between "
            "hosts and slices (DCN) uses the VM's interface instead of the pod network, and each pod has its "
            "node's IP. The trainer's stop channel (TCP 29500) is declared as a host port. Host networking "
            "is refused by the baseline and restricted Pod Security Standards and needs the admin's "
            'consent (chart value policy.allowHostNetwork); see docs/install-gke.md, "Host networking".'
        ),
    )


# The prepare Job's defaults (render/prepare_job.py). Memory: `tpuft prepare` holds ~20 bytes a token
# (token ids, loss masks, the packed rows as arrays) besides the tokenizer, so a Tulu-3-size set
# (~0.7 B tokens) needs ~14 GB; 16Gi fits it, and sets ten times smaller fit with room to spare.
# CPU: the tokenizer is the floor (docs/data.md), and it scales with the worker processes, one a core.
DEFAULT_PREPARE_CPU = "4"
DEFAULT_PREPARE_MEMORY = "16Gi"
DEFAULT_PREPARE_DEADLINE_SECONDS = 6 * 3600
MAX_PREPARE_DEADLINE_SECONDS = 7 * 24 * 3600


class PrepareSpec(_Spec):
    """Data preparation: a CPU Job (`<run>-prepare`) that reads, tokenises and packs the dataset once and
    checks the run's inputs, before the run's JobSet (and any TPU) is requested."""

    enabled: bool = Field(
        default=True,
        description=(
            "Prepare the data in a CPU Job before the TPU pods start. false: no Job; every TPU host "
            "prepares the data itself when it starts (on the TPU's time, and again after each restart "
            "unless a prepared set is found in spec.output.uri)."
        ),
    )
    resources: Resources | None = Field(
        default=None,
        description=(
            f"Resources of the prepare pod. Default: requests cpu {DEFAULT_PREPARE_CPU}, memory "
            f"{DEFAULT_PREPARE_MEMORY}, and a memory limit equal to the memory request (about 20 bytes a "
            "token: 16Gi holds a ~0.7 B-token set). The CPU request (rounded up) is the number of "
            "tokenising processes."
        ),
    )
    node_selector: dict[str, LabelValue] | None = Field(
        default=None,
        max_length=16,
        description="Node labels the prepare pod must run on (a CPU node pool). Default: any node it tolerates.",
    )
    tolerations: list[Toleration] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Tolerations of the prepare pod (spec.tolerations are the TPU pods' and do not apply): for a "
            "dedicated CPU pool's taint. The admin policy's rules on tolerations apply."
        ),
    )
    deadline_seconds: int | None = Field(
        default=None,
        ge=60,
        le=MAX_PREPARE_DEADLINE_SECONDS,
        description=(
            f"Longest the preparation may take in all, retries included (the Job's activeDeadlineSeconds); "
            f"past it the run fails. Default {DEFAULT_PREPARE_DEADLINE_SECONDS} ({DEFAULT_PREPARE_DEADLINE_SECONDS // 3600} h)."
        ),
    )


class TPUFineTuneSpec(_Spec):
    """What to fine-tune, on which TPUs, and how."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": cel.as_json(cel.spec_rules())})

    model: ModelSpec = Field(description="The base model.")
    dataset: DatasetSpec = Field(description="The training data.")
    tpu: TpuSpec = Field(description="TPU type, topology and number of slices.")
    backend: Literal["xla", "native"] = Field(
        default="xla",
        description=(
            "The trainer's tensor runtime. `xla`: PyTorch/XLA SPMD (torch_xla 2.9.0, one process per "
            "host), on v4, v5e, v5p and v6e; refused on tpu7x. `native`: torch-native FSDP2, DTensor and "
            "torch.distributed.checkpoint on TorchTPU (torch-tpu, Beta), one process per chip, in the "
            "operator's native trainer image (several slices: HSDP, sharded within a slice, replicated "
            "across slices over DCN); objectives sft and dpo, methods full and lora, a tensor axis by "
            "transformers' own plan for the model (method full, objective sft). Both read the same "
            'prepared data and write checkpoints of the same layout. See docs/operator.md, "Backends".'
        ),
    )
    fsdp: FsdpSpec = Field(
        default_factory=lambda: FsdpSpec(),
        description="FSDPv2 settings: layers to wrap, gradient checkpointing, mesh.",
        # The apiserver fills in {} so the defaults inside (gradientCheckpointing) always show.
        json_schema_extra={"default": {}},
    )
    training: TrainingSpec = Field(description="Method and hyperparameters.")
    output: OutputSpec = Field(description="Where the checkpoints and the final model are written.")
    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = Field(
        default=None,
        description=(
            "Trainer image. Default: the operator's configured trainer image for spec.backend (xla, or "
            "the native image for `native`)."
        ),
    )
    suspend: bool = Field(
        default=False,
        description=(
            "Suspend the run: pods are deleted, the JobSet stays; setting it back to false resumes from "
            "the latest checkpoint. The only field that may change after creation."
        ),
    )
    termination_grace_period_seconds: int | None = Field(
        default=None,
        ge=10,
        le=3600,
        description=(
            "Seconds the trainer pods get after SIGTERM (suspend, preemption, a node drain or "
            "maintenance) before SIGKILL: every host saves the step it reached in that time, so it "
            "must hold one training step and one checkpoint save. Default: the operator's setting "
            "(60 s). A save that took more than half of it in all (the wait for the device, the copy to "
            "host memory and the write: a stop's save is synchronous) shows condition CheckpointSlow. On "
            f"Spot (spec.tpu.spot) a reclaim gives about {SPOT_GRACE_SECONDS} s whatever this says, and saves "
            "are measured against that: there, raising this helps the other stops, not a reclaim."
        ),
    )
    maintenance: Literal["checkpoint", "ignore"] = Field(
        default="checkpoint",
        description=(
            "What to do when GKE announces maintenance of a node the run's pods run on (label "
            "cloud.google.com/scheduled-maintenance-time): `checkpoint` asks the trainer to save a "
            "checkpoint now and shows condition MaintenanceScheduled; `ignore` only shows the "
            "condition. Either way the pods save again on the SIGTERM the maintenance brings, and "
            "the run restarts and resumes when the VMs are back, not counted against maxRestarts."
        ),
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=1000,
        description=(
            "Restarts of the whole run after an infrastructure failure (crash, lost node, a SIGTERM "
            "before any new step), each resuming from the latest checkpoint. A stop after which every "
            "host saved the step it reached (preemption, a drain, maintenance with the grace period "
            "honoured) restarts without counting: no work was lost. A user error (bad config, missing "
            "data, out of memory) fails at once."
        ),
    )
    queue_name: DnsLabel | None = Field(
        default=None,
        description=(
            "Kueue LocalQueue to submit to. The run is created suspended and starts when Kueue admits it "
            "(all its slices at once: one Workload); condition Queued says why it waits. Its priority: "
            "Kueue's WorkloadPriorityClass in the label kueue.x-k8s.io/priority-class of this TPUFineTune, "
            "else priorityClassName's."
        ),
    )
    priority_class_name: DnsSubdomain | None = Field(
        default=None,
        description=(
            "PriorityClass of the trainer pods (the scheduler's pod priority; Kueue's priority of a queued "
            "run unless the TPUFineTune has the label kueue.x-k8s.io/priority-class)."
        ),
    )
    service_account_name: DnsSubdomain | None = Field(
        default=None,
        description=(
            "Kubernetes ServiceAccount of the trainer pods: bind it to a Google service account (Workload "
            "Identity) to read gs:// data and write the output."
        ),
    )
    resources: Resources | None = Field(default=None, description="Extra CPU/memory requests and limits.")
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Extra tolerations for the trainer pods."
    )
    volumes: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=16,
        description=(
            "Extra pod volumes (core/v1 Volume), e.g. a GCS FUSE CSI volume or a PersistentVolumeClaim. "
            "Mount them with volumeMounts."
        ),
        json_schema_extra={"x-tpuft-volume-items": True},
    )
    volume_mounts: list[VolumeMount] | None = Field(
        default=None, max_length=16, description="Mounts of spec.volumes into the trainer container."
    )
    env: list[EnvVar] | None = Field(
        default=None, max_length=64, description="Extra environment variables for the trainer container."
    )
    pod_annotations: dict[str, Annotated[str, StringConstraints(max_length=4096)]] | None = Field(
        default=None,
        max_length=32,
        description='Extra annotations on the trainer pods (e.g. gke-gcsfuse/volumes: "true" for GCS FUSE).',
    )
    network: NetworkSpec | None = Field(
        default=None,
        description="The trainer pods' networking: host networking for multislice (DCN) traffic.",
    )
    prepare: PrepareSpec = Field(
        default_factory=lambda: PrepareSpec(),
        description=(
            "Data preparation before the TPUs: a CPU Job tokenises and packs the dataset once and checks "
            "the model, tokenizer and output (phase Preparing, condition DataPrepared, status.data)."
        ),
        # The apiserver fills in {} so `enabled: true` shows.
        json_schema_extra={"default": {}},
    )


# ------------------------------------------------------------------------------------------- status


class Phase(StrEnum):
    """status.phase: the operator's one list of phases (status.py derives them, metrics.py counts
    them). A str enum: a member is equal to, hashes like and serializes as its value."""

    PREPARING = "Preparing"
    PENDING = "Pending"
    QUEUED = "Queued"
    SUSPENDED = "Suspended"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


# Phases a run never leaves (while no active JobSet contradicts them: status.is_final).
TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class Condition(_Spec):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: Annotated[str, StringConstraints(min_length=1, max_length=316)] = Field(
        description="Condition type, e.g. Ready, Running, Succeeded, Failed, Suspended, Admitted."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed from."
    )
    last_transition_time: datetime = Field(description="When the status last changed.")
    reason: Annotated[
        str,
        StringConstraints(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"),
    ] = Field(description="CamelCase reason for the last transition.")
    message: Annotated[str, StringConstraints(max_length=32768)] = Field(
        description="Human-readable details."
    )


MAX_SKIPPED_CHECKPOINTS = 8  # the trainer's bound too (tpuft_trainer/attempt.py MAX_SKIPPED)


class SkippedCheckpoint(_Spec):
    """A checkpoint found at the start of an attempt that it did not resume from."""

    step: int = Field(ge=0, description="Its step.")
    reason: Annotated[str, StringConstraints(max_length=256)] = Field(
        description=(
            "Why it was skipped: incomplete (no completion marker), a shard missing or truncated, e.g. "
            "`checkpoint-8: shard __0_0.distcp is missing`."
        )
    )


class AttemptProgress(_Spec):
    """The current attempt of the run (one start of its pods), as its trainer saw it."""

    start_time: datetime | None = Field(default=None, description="When the trainer process started.")
    first_step_time: datetime | None = Field(
        default=None, description="When its first training step was done (start-up ends)."
    )
    resumed_from_step: int | None = Field(
        default=None, ge=0, description="The checkpoint step it resumed from (0: the beginning)."
    )
    checkpoint_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Time the saves cost training (their blockedSeconds): each periodic save's copy of the "
            "shards to host memory (its write runs in the background), a stop's save (synchronous) in "
            "full but for the wait for the device to finish its dispatched steps (it computes them meanwhile)."
        ),
    )
    checkpoint_write_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Time the saves took to write after the copy, in all: mostly in the background, "
            "overlapping training (not counted as lost time)."
        ),
    )
    skipped_checkpoints: list[SkippedCheckpoint] | None = Field(
        default=None,
        max_length=MAX_SKIPPED_CHECKPOINTS,
        description=(
            "Checkpoints found at the start but not resumed from (incomplete, or a shard missing or "
            f"truncated), newest first, at most {MAX_SKIPPED_CHECKPOINTS}; condition CheckpointSkipped "
            "names them."
        ),
    )


class CheckpointProgress(_Spec):
    """The latest checkpoint the trainer saved."""

    step: int | None = Field(default=None, ge=0, description="Its step.")
    seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "From the step boundary to the checkpoint complete on storage: deviceWaitSeconds, the "
            "staging and the write. What a stop's save (synchronous) would take; compared with the grace "
            "period (condition CheckpointSlow)."
        ),
    )
    device_wait_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "The wait for the device to finish the steps the training loop had dispatched before the "
            "save (the loop runs ahead of the device, up to about a step): the device computes them "
            "meanwhile, so it is not lost to training, but a stop's save waits for it too."
        ),
    )
    staging_seconds: float | None = Field(
        default=None, ge=0, description="The copy of the shards to host memory, alone."
    )
    blocked_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "What the save cost training: the staging copy (and the end of the previous save's write, "
            "if it was still writing); a stop's save (synchronous): also its write. All but the device wait."
        ),
    )
    write_seconds: float | None = Field(
        default=None,
        ge=0,
        description="How long its write took after the copy (in the background for a periodic save).",
    )
    reason: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="periodic, SIGTERM, or checkpoint request <n> (maintenance)."
    )
    grace_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "The seconds the shortest stop gives the pods after SIGTERM, which the save is measured "
            "against: spec.terminationGracePeriodSeconds (else the operator's default), or on Spot what "
            f"a reclaim gives, spec.tpu.spotGracePeriodSeconds (default {SPOT_GRACE_SECONDS}: GKE gives "
            "ordinary pods ~15 s of the VM's 30 s notice, whatever the pods' terminationGracePeriodSeconds "
            "says)."
        ),
    )
    time: datetime | None = Field(default=None, description="When the save completed.")


class Progress(_Spec):
    """Training progress as reported by the trainer's rank 0."""

    step: int | None = Field(default=None, ge=0, description="Optimizer steps completed.")
    total_steps: int | None = Field(default=None, ge=0, description="Steps the run will take in total.")
    loss: float | None = Field(
        default=None,
        description=(
            "Latest training loss read: the mean over the training.loggingSteps steps up to the last "
            "logging step."
        ),
    )
    tokens_per_second: float | None = Field(default=None, ge=0, description="Training throughput, all chips.")
    eval_loss: float | None = Field(default=None, description="Latest evaluation loss (held-out rows).")
    reward_accuracy: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description=(
            "Objective dpo: share of the pairs whose chosen completion is rewarded more, "
            "over the same steps as loss."
        ),
    )
    reward_margin: float | None = Field(
        default=None,
        description=(
            "Objective dpo: mean reward margin (chosen - rejected, beta x log-ratios), "
            "over the same steps as loss."
        ),
    )
    eta_seconds: int | None = Field(default=None, ge=0, description="Estimated seconds to completion.")
    update_time: datetime | None = Field(default=None, description="When the trainer last reported.")
    summary: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="Short form for `kubectl get`, e.g. `120/1000 (12%)`."
    )
    attempt: AttemptProgress | None = Field(default=None, description="The current attempt, in time.")
    last_checkpoint: CheckpointProgress | None = Field(
        default=None, description="The latest checkpoint saved by the current attempt."
    )


class LostTime(_Spec):
    """Where the time that was not productive training went, in seconds."""

    waiting_seconds: float = Field(
        default=0.0, ge=0, description="Creation to the first start: capacity, admission, scheduling."
    )
    startup_seconds: float = Field(
        default=0.0, ge=0, description="Pod start to first step, every attempt: image, model load, compile."
    )
    checkpoint_seconds: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Time training waited for saves: a periodic save's copy to host memory (its write runs "
            "in the background), a stop's save in full but for the device finishing its dispatched "
            "steps, and the final save of a success."
        ),
    )
    redone_seconds: float = Field(
        default=0.0, ge=0, description="Steps done again after a restart (past the checkpoint resumed from)."
    )
    restart_gap_seconds: float = Field(
        default=0.0,
        ge=0,
        description="Between one attempt's end and the next one's start: restart, rescheduling, suspension.",
    )


class GoodputAttempt(_Spec):
    """One start of the run's pods, as the operator recorded it (what goodput is computed from)."""

    start_time: datetime = Field(description="When its trainer process started (the attempt's identity).")
    pod_start_time: datetime | None = Field(
        default=None,
        description="When its pod started, before the image was pulled (start-up counts from here).",
    )
    first_step_time: datetime | None = Field(default=None, description="First training step done.")
    end_time: datetime = Field(description="The attempt's last report (its end, once another started).")
    resumed_from_step: int = Field(default=0, ge=0, description="Checkpoint step it resumed from.")
    last_step: int = Field(default=0, ge=0, description="The last step it reported.")
    checkpoint_seconds: float = Field(
        default=0.0, ge=0, description="Time training waited for its saves (counted as lost)."
    )
    checkpoint_write_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Time its saves took to write, mostly in the background (informational, not lost).",
    )


class Goodput(_Spec):
    """Productive training time against wall time since creation (computed by the operator from
    what it observes and what the trainer reports; see docs/operator.md, "What a stop costs")."""

    ratio: float | None = Field(
        default=None, ge=0, le=1, description="productiveSeconds / wallSeconds (the Goodput column)."
    )
    wall_seconds: float = Field(default=0.0, ge=0, description="Creation to asOf.")
    productive_seconds: float = Field(default=0.0, ge=0, description="Training steps that were kept.")
    lost: LostTime = Field(default_factory=lambda: LostTime(), description="The rest of the wall time.")
    redone_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "Steps trained again after restarts: those past the checkpoint each restart resumed from. What "
            "stops cost whose save did not complete (a Spot reclaim's ~15 s, a host lost without notice); "
            "0 while every stop saved the step it reached."
        ),
    )
    as_of: datetime | None = Field(default=None, description="The time these figures are for.")
    attempts: list[GoodputAttempt] | None = Field(
        default=None, max_length=32, description="The attempts so far (the newest 32)."
    )


class DataPlan(_Spec):
    """The plan's memory verdict recomputed with the model's real dimensions, which the prepare Job
    read from its config.json and weight files' headers (docs/plan.md)."""

    params: int = Field(
        ge=0, description="The model's parameters (counted from its weight files' headers when listed)."
    )
    hbm_estimate_gib: float = Field(
        ge=0, alias="hbmEstimateGiB", description="Estimated HBM per chip (GiB): weights, state, activations."
    )
    hbm_usable_gib: float = Field(
        ge=0,
        alias="hbmUsableGiB",
        description="HBM per chip the estimate is compared with (GiB, 10% kept back).",
    )
    hbm_fits: bool = Field(
        description="The HBM estimate fits; when not, condition MemoryFits says what to change (never refused)."
    )
    host_peak_gib: float = Field(
        ge=0,
        alias="hostPeakGiB",
        description="Estimated peak host RAM per host (GiB): runtime + load/save/export.",
    )
    host_ram_gib: int = Field(
        ge=0, alias="hostRamGiB", description="RAM of one host of the slice's machine type (GiB)."
    )
    host_fits: bool = Field(
        description="A host holds the run; when not, the run failed before its JobSet (spec.tpu.topology)."
    )


class DataStatus(_Spec):
    """The prepared dataset's figures, as the prepare Job reported them (docs/operator.md, "Preparing")."""

    settings_hash: Annotated[str, StringConstraints(max_length=64)] = Field(
        description=(
            "Hash of the settings that decide the prepared content (model, dataset, maxSeqLength, seed, "
            "objective) these figures belong to: another hash prepares again."
        )
    )
    fingerprint: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        default=None, description="The prepared set's directory under <output.uri>/prepared/."
    )
    reused: bool | None = Field(
        default=None, description="A complete prepared set was found: nothing was tokenised again."
    )
    documents: int | None = Field(default=None, ge=0, description="Training documents read.")
    dropped_documents: int | None = Field(
        default=None, ge=0, description="Documents with no token to learn within maxSeqLength (left out)."
    )
    rows: int | None = Field(
        default=None, ge=0, description="Training rows of maxSeqLength (packed or padded)."
    )
    positions: int | None = Field(default=None, ge=0, description="rows x maxSeqLength.")
    loss_token_share: float | None = Field(
        default=None, ge=0, le=1, description="Share of the positions that count in the loss."
    )
    eval_rows: int | None = Field(default=None, ge=0, description="Evaluation rows (0: no evaluation set).")
    steps_per_epoch: int | None = Field(
        default=None,
        ge=0,
        description="Optimizer steps in one pass over the rows: rows / status.globalBatch.",
    )
    epochs_covered: float | None = Field(
        default=None,
        ge=0,
        description="Passes over the rows that training.maxSteps makes (maxSteps / stepsPerEpoch).",
    )
    prepared_seconds: float | None = Field(
        default=None, ge=0, description="Wall time of the preparation (0 when reused)."
    )
    plan: DataPlan | None = Field(
        default=None,
        description=(
            "The plan's HBM and host-RAM verdict recomputed with the model's real dimensions (condition "
            "MemoryFits)."
        ),
    )


class TPUFineTuneStatus(_Spec):
    """Observed state, written by the operator."""

    phase: Phase | None = Field(
        default=None, description="Preparing, Pending, Queued, Suspended, Running, Succeeded or Failed."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        max_length=16,
        description="Standard conditions.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this status was computed from."
    )
    job_set_name: Annotated[str, StringConstraints(max_length=63)] | None = Field(
        default=None, description="Name of the JobSet running this fine-tune."
    )
    chips: int | None = Field(default=None, ge=0, description="TPU chips in use (all slices).")
    hosts: int | None = Field(default=None, ge=0, description="TPU VMs (pods) in use (all slices).")
    global_batch: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Sequences per optimizer step: perDeviceBatchSize x the chips the batch is split over (all but "
            "the mesh's tensor axis) x gradientAccumulationSteps."
        ),
    )
    restarts: int | None = Field(default=None, ge=0, description="Restarts of the whole run so far.")
    restarts_counted: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Restarts of the current JobSet that count against spec.maxRestarts (its "
            "restartsCountTowardsMax): a restart after a checkpointed stop does not. A JobSet recreated "
            "after someone deleted it starts again from 0."
        ),
    )
    start_time: datetime | None = Field(default=None, description="When training first started.")
    completion_time: datetime | None = Field(default=None, description="When the run succeeded or failed.")
    progress: Progress | None = Field(default=None, description="Training progress.")
    goodput: Goodput | None = Field(default=None, description="Productive time and where the rest went.")
    data: DataStatus | None = Field(
        default=None, description="The prepared dataset's figures (spec.prepare), once prepared."
    )
    message: Annotated[str, StringConstraints(max_length=32768)] | None = Field(
        default=None, description="Human-readable summary of the current state."
    )


class ObjectMeta(BaseModel):
    """The subset of metav1.ObjectMeta the renderer reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=253)
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class TPUFineTune(_Spec):
    """A TPUFineTune resource as stored by the apiserver."""

    api_version: Literal["tpuft.dev/v1alpha1"] = Field(
        default="tpuft.dev/v1alpha1", description="tpuft.dev/v1alpha1"
    )
    kind: Literal["TPUFineTune"] = Field(default="TPUFineTune", description="TPUFineTune")
    metadata: ObjectMeta
    spec: TPUFineTuneSpec
    status: TPUFineTuneStatus | None = None
