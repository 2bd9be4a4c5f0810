"""`tpuft plan`: the TPU shape of a TPUFineTune and an estimate of memory per chip. Pure functions.

The estimate, per chip, for a decoder-only transformer trained with FSDPv2 (PyTorch/XLA SPMD):

- parameters: every weight, sharded over the fsdp x tensor axes (slices replicate them: DCN is the
  data axis), in the model dtype;
- gradients: one per *trainable* weight (all of them for `full`, the adapters for `lora`), sharded
  like the weights, in the model dtype;
- optimizer state, sharded like the weights: `adamw` keeps two values per trainable weight in the
  weight dtype (PyTorch creates them with `zeros_like`); `adafactor` (as configured by Hugging Face:
  no first moment, factored second moment) keeps one row and one column vector per matrix;
- activations for one chip's batch (perDeviceBatchSize x maxSeqLength tokens), per layer and token:
  the tensors a Llama-style layer saves for backward, 7h + 2·kv + 4·I values (h hidden size, kv the
  key/value width, I the MLP width; 2·I for a non-gated MLP). With gradient checkpointing only each
  layer's input (h values per token) is kept, and one layer at a time is recomputed;
- attention: a layer's scores and probabilities, heads x seq x seq values of each per sequence. The
  trainer runs transformers' SDPA/eager attention, which on XLA has no flash kernel and materialises
  them: at long sequences they outgrow everything else. One layer's with checkpointing, every layer's
  without;
- logits: vocab values per token in the model dtype plus the float32 copy the loss is computed in;
- gathered: what FSDPv2 makes whole on every chip for a moment. XLA all-gathers a wrapped decoder
  layer's weights before it runs (and in the backward pass holds its full, not yet reduce-scattered,
  gradients too), and the embedding / LM head, which no decoder layer wraps, the same way; the next
  layer's gather overlaps the LM head's, so one layer and the head are counted together.

Activations, attention and logits grow with the chip's tokens (perDeviceBatchSize x maxSeqLength);
the rest does not. When those are most of an estimate that does not fit, the advice is what shrinks
them (a shorter maxSeqLength, perDeviceBatchSize 1 with gradientAccumulationSteps, checkpointing):
LoRA, adafactor and a larger topology only shrink the weights' share.

With objective `dpo` every pair is two sequences (prompt + chosen, prompt + rejected), so the batch's
activations double; the reference model adds a frozen copy of the weights, sharded like them, for
method `full` (with `lora` the reference is the base with the adapter disabled: nothing more); its
forward runs without gradients, so it keeps no activations. trl's fused LM head computes the
log-probabilities in tiles of positions, never the whole logits: the logits line is one tile's.

Not counted (hence a 10% headroom): XLA's temporary buffers and fragmentation, the runtime itself,
tensor-parallel sharding of activations (which would only lower the estimate). The numbers are an
estimate to choose a shape with; the trainer exits with OUT_OF_MEMORY (78) if reality disagrees.

Host memory, per host (TPU VM), against the RAM of its machine type (topology.py's catalog). The
trainer saves sharded, asynchronous torch.distributed.checkpoint checkpoints: each host copies only
its own chips' shards of the weights and optimizer state to RAM (training waits for that copy) and
writes them in the background, one save in flight at a time; it loads the model by slice onto the
sharded devices and exports it in groups of at most 1 GiB. So a host holds at most:

- save: its share of a checkpoint (`checkpoint_bytes`: the saved weights, every weight for `full`
  and the adapters for `lora`, + the optimizer state of the trainable weights), i.e. the checkpoint
  / (fsdp x tensor) x the chips of the host that hold distinct shards (replicas across the data and
  DCN axes are written once, by the lowest rank holding them);
- load: the largest tensor of the model (the embedding or LM head, vocab x hidden; an MLP matrix if
  larger), whole: a conservative bound on what the sliced loader holds at once;
- export: one file group held on the host, EXPORT_GROUP_BYTES (gathered in parts of 256 MiB);

on top of RUNTIME_HOST_GIB, an allowance for the Python runtime, torch_xla and libtpu. The SFT
dataset is not process memory: the trainer reads a prepared set (the prepare Job's, or one it
prepares itself into the same files) memory-mapped, so its pages are the kernel's page cache,
reclaimed under pressure, and not the trainer's RAM. Preference pairs (DPO) are still tokenised in
the process by trl (docs/data.md), so a DPO run's dataset does sit in that allowance.
peak = runtime + max(load, save, export).

Backend native (spec.backend) runs one process per chip instead of one per host. The estimate then
assumes, without a measurement of a TPU host, that each process needs what the one xla process does:
the runtime allowance and the load bound count once per process (x chips per host); the save (each
process stages its own shards: the same bytes per host in all) and the export group (one at a time)
do not change. The per-chip HBM estimate is the same model (FSDP2 gathers a decoder layer's weights
before it runs, as FSDPv2 does).

`host_ram_refusal` is the same estimate as a refusal on spec.tpu.topology when the peak exceeds the
host's RAM: validation (api/validation.py) applies it to a spec whose model is in KNOWN_MODELS, and
the operator, for any model, once its prepare Job has read the model's dimensions (`memory_verdict`,
preparing.py), before any TPU is requested. HBM is never a reason to refuse: that estimate is too
rough to block a run; the operator says it (condition MemoryFits, a Warning Event) with what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tpuft_operator.api.models import DEFAULT_GRACE_SECONDS, SPOT_GRACE_SECONDS, TPUFineTune, TPUFineTuneSpec
from tpuft_operator.topology import SliceShape, resolve
from tpuft_operator.trainer_stack import trainer_stack_caveat
from tpuft_trainer.prepare_contract import ModelFigures

GIB = 1024**3
HEADROOM = 0.10  # fraction of HBM left for XLA workspace, fragmentation and the runtime
# Host RAM a trainer process needs besides the checkpoint, load and export buffers: the Python
# runtime, torch_xla and libtpu. An allowance, not a measurement of a TPU host; the trainer's side may
# refine it. It once counted the tokenised dataset too, which the in-process path held (issue 47: of
# a 15 M-token set, 4.9 GB at the peak of loading and 1.4 GB through training); a prepared set is now
# memory-mapped (page cache, not the process's RAM), so that share is gone for SFT. The figure is left as it was rather than lowered by a guess:
# no TPU host's runtime has been measured, and DPO pairs are still tokenised in the process.
RUNTIME_HOST_GIB = 12
EXPORT_GROUP_BYTES = GIB  # the final export streams the weights in gather groups of at most this
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama, Mistral, Qwen2 and Gemma
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs to know about a model. ``params`` alone is enough for the weights;
    the other fields (from a config.json) make the activation estimate exact rather than guessed."""

    params: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int
    gated_mlp: bool = True
    source: str = ""
    experts: int = 1  # mixture of experts: MLPs per layer, and how many each token runs through
    experts_per_token: int = 1
    tied_embeddings: bool = False

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies with: all but the embedding lookup and the experts it skips."""
        idle_experts = (self.experts - self.experts_per_token) * self.mlp_params_per_expert * self.num_layers
        lookup = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.params - idle_experts - lookup

    @property
    def mlp_params_per_expert(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    def flops_per_token(self, seq_len: int, *, full: bool = True) -> float:
        """Model FLOPs of one training token, as the trainer counts them (tpuft_trainer/throughput.py):
        6 per weight (4 for frozen weights, LoRA), + 12 x layers x hidden x sequence for attention."""
        per_weight = 6 if full else 4
        return float(
            per_weight * self.active_matmul_params + 12 * self.num_layers * self.hidden_size * seq_len
        )

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: what FSDPv2 gathers whole before the layer runs."""
        return decoder_layer_params(
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            gated_mlp=self.gated_mlp,
            experts=self.experts,
        )

    @property
    def lm_head_params(self) -> int:
        """The LM head (vocab x hidden; the embedding is the same shape, and the same tensor when tied)."""
        return self.vocab_size * self.hidden_size


def decoder_layer_params(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, *, gated_mlp: bool, experts: int
) -> int:
    """Weights of one Llama-style decoder layer: q, o, k, v; the MLP (every expert's, and the router of a
    mixture); two norms."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = (3 if gated_mlp else 2) * hidden * intermediate * experts + (hidden * experts if experts > 1 else 0)
    return attention + mlp + 2 * hidden


def dims(
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    vocab_size: int,
    head_dim: int | None = None,
    tied_embeddings: bool = False,
    gated_mlp: bool = True,
    experts: int = 1,
    experts_per_token: int = 1,
    source: str = "",
) -> ModelDims:
    """ModelDims with the parameter count computed from the architecture (Llama-style layers; a
    mixture of experts has ``experts`` MLPs per layer and a router)."""
    kv_heads = num_kv_heads or num_heads
    hd = head_dim or hidden_size // num_heads
    h, i = hidden_size, intermediate_size
    per_layer = decoder_layer_params(h, num_heads, kv_heads, hd, i, gated_mlp=gated_mlp, experts=experts)
    embeddings = vocab_size * h * (1 if tied_embeddings else 2)
    return ModelDims(
        params=num_layers * per_layer + embeddings + h,
        hidden_size=h,
        num_layers=num_layers,
        intermediate_size=i,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab_size,
        head_dim=hd,
        gated_mlp=gated_mlp,
        source=source,
        experts=experts,
        experts_per_token=experts_per_token,
        tied_embeddings=tied_embeddings,
    )


# The families the trainer supports (Llama 2/3, Gemma 1-3, Mistral, Mixtral, Qwen 2/2.5/3, Phi-3), by
# size: each row's numbers are those of the repository's config.json on the Hugging Face hub (the text
# model's, for Gemma 3's multimodal sizes), so `tpuft plan` works offline for them. Columns: hidden
# size, layers, MLP width, attention heads, key/value heads, vocabulary, head dim (None: hidden/heads),
# tied embeddings, experts (total, per token). Variants that share an architecture (instruct/it/base)
# are listed with it. Anything else: a local config.json, the HF cache, or --params-billions.
_FAMILY_TABLE: list[tuple[tuple[str, ...], tuple[int, int, int, int, int, int, int | None, bool, int, int]]] = [
    # Llama 2 and 3 (meta-llama)
    (("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"), (4096, 32, 11008, 32, 32, 32000, None, False, 1, 1)),
    (("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"), (5120, 40, 13824, 40, 40, 32000, None, False, 1, 1)),
    (("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"), (8192, 80, 28672, 64, 8, 32000, None, False, 1, 1)),
    (("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"), (4096, 32, 14336, 32, 8, 128256, None, False, 1, 1)),
    (("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"), (8192, 80, 28672, 64, 8, 128256, None, False, 1, 1)),
    (("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"), (4096, 32, 14336, 32, 8, 128256, None, False, 1, 1)),
    (("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct"), (8192, 80, 28672, 64, 8, 128256, None, False, 1, 1)),
    (("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct"), (16384, 126, 53248, 128, 8, 128256, None, False, 1, 1)),
    (("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"), (2048, 16, 8192, 32, 8, 128256, None, True, 1, 1)),
    (("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"), (3072, 28, 8192, 24, 8, 128256, None, True, 1, 1)),
    # Gemma 1, 2, 3 (google)
    (("google/gemma-2b", "google/gemma-2b-it"), (2048, 18, 16384, 8, 1, 256000, 256, True, 1, 1)),
    (("google/gemma-7b", "google/gemma-7b-it"), (3072, 28, 24576, 16, 16, 256000, 256, True, 1, 1)),
    (("google/gemma-2-2b", "google/gemma-2-2b-it"), (2304, 26, 9216, 8, 4, 256000, 256, True, 1, 1)),
    (("google/gemma-2-9b", "google/gemma-2-9b-it"), (3584, 42, 14336, 16, 8, 256000, 256, True, 1, 1)),
    (("google/gemma-2-27b", "google/gemma-2-27b-it"), (4608, 46, 36864, 32, 16, 256000, 128, True, 1, 1)),
    (("google/gemma-3-1b-pt", "google/gemma-3-1b-it"), (1152, 26, 6912, 4, 1, 262144, 256, True, 1, 1)),
    (("google/gemma-3-4b-pt", "google/gemma-3-4b-it"), (2560, 34, 10240, 8, 4, 262208, 256, True, 1, 1)),
    (("google/gemma-3-12b-pt", "google/gemma-3-12b-it"), (3840, 48, 15360, 16, 8, 262208, 256, True, 1, 1)),
    (("google/gemma-3-27b-pt", "google/gemma-3-27b-it"), (5376, 62, 21504, 32, 16, 262208, 128, True, 1, 1)),
    # Mistral and Mixtral (mistralai)
    (("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1", "mistralai/Mistral-7B-Instruct-v0.2"), (4096, 32, 14336, 32, 8, 32000, None, False, 1, 1)),
    (("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"), (4096, 32, 14336, 32, 8, 32768, None, False, 1, 1)),
    (("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"), (4096, 32, 14336, 32, 8, 32000, None, False, 8, 2)),
    (("mistralai/Mixtral-8x22B-v0.1",), (6144, 56, 16384, 48, 8, 32000, None, False, 8, 2)),
    (("mistralai/Mixtral-8x22B-Instruct-v0.1",), (6144, 56, 16384, 48, 8, 32768, None, False, 8, 2)),
    # Qwen 2, 2.5, 3 (Qwen)
    (("Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"), (896, 24, 4864, 14, 2, 151936, None, True, 1, 1)),
    (("Qwen/Qwen2-1.5B", "Qwen/Qwen2-1.5B-Instruct", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"), (1536, 28, 8960, 12, 2, 151936, None, True, 1, 1)),
    (("Qwen/Qwen2-7B", "Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"), (3584, 28, 18944, 28, 4, 152064, None, False, 1, 1)),
    (("Qwen/Qwen2-72B", "Qwen/Qwen2-72B-Instruct", "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct"), (8192, 80, 29568, 64, 8, 152064, None, False, 1, 1)),
    (("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"), (2048, 36, 11008, 16, 2, 151936, None, True, 1, 1)),
    (("Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B-Instruct"), (5120, 48, 13824, 40, 8, 152064, None, False, 1, 1)),
    (("Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct"), (5120, 64, 27648, 40, 8, 152064, None, False, 1, 1)),
    (("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B-Base"), (1024, 28, 3072, 16, 8, 151936, 128, True, 1, 1)),
    (("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B-Base"), (2048, 28, 6144, 16, 8, 151936, 128, True, 1, 1)),
    (("Qwen/Qwen3-4B", "Qwen/Qwen3-4B-Base"), (2560, 36, 9728, 32, 8, 151936, 128, True, 1, 1)),
    (("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"), (4096, 36, 12288, 32, 8, 151936, 128, False, 1, 1)),
    (("Qwen/Qwen3-14B", "Qwen/Qwen3-14B-Base"), (5120, 40, 17408, 40, 8, 151936, 128, False, 1, 1)),
    (("Qwen/Qwen3-32B",), (5120, 64, 25600, 64, 8, 151936, 128, False, 1, 1)),
    # Phi-3 (microsoft); Phi-3-small is another architecture (block-sparse attention) and not listed
    (("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-128k-instruct", "microsoft/Phi-3.5-mini-instruct"), (3072, 32, 8192, 32, 32, 32064, None, False, 1, 1)),
    (("microsoft/Phi-3-medium-4k-instruct", "microsoft/Phi-3-medium-128k-instruct"), (5120, 40, 17920, 40, 10, 32064, None, False, 1, 1)),
]  # fmt: skip


def _known_models() -> dict[str, ModelDims]:
    models = {}
    for ids, (h, layers, mlp, heads, kv, vocab, head_dim, tied, experts, per_token) in _FAMILY_TABLE:
        for model_id in ids:
            models[model_id] = dims(
                hidden_size=h,
                num_layers=layers,
                intermediate_size=mlp,
                num_heads=heads,
                num_kv_heads=kv,
                vocab_size=vocab,
                head_dim=head_dim,
                tied_embeddings=tied,
                experts=experts,
                experts_per_token=per_token,
                source=f"built-in table (config.json of huggingface.co/{ids[0]})",
            )
    return models


KNOWN_MODELS: dict[str, ModelDims] = _known_models()


def dims_from_config(config: dict[str, Any], source: str) -> ModelDims:
    """ModelDims from a Hugging Face config.json (Llama/Gemma/Qwen/Mistral keys, or GPT-2's), read as
    the prepare Job reads it (prepare_contract.ModelFigures)."""
    try:
        figures = ModelFigures.from_config(config)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return dims_from_figures(figures, source)


def dims_from_figures(figures: ModelFigures, source: str) -> ModelDims:
    """ModelDims from a model's figures: its architecture, and the parameter count of its weight files
    when they were counted (else computed from the architecture, Llama-style layers)."""
    computed = dims(
        hidden_size=figures.hidden_size,
        num_layers=figures.num_layers,
        intermediate_size=figures.intermediate_size,
        num_heads=figures.num_heads,
        num_kv_heads=figures.num_kv_heads,
        vocab_size=figures.vocab_size,
        head_dim=figures.head_dim,
        tied_embeddings=figures.tied_embeddings,
        gated_mlp=figures.gated_mlp,
        experts=figures.experts,
        experts_per_token=figures.experts_per_token,
        source=source,
    )
    return computed if figures.params is None else replace(computed, params=figures.params)


def dims_from_params(params: int, source: str) -> ModelDims:
    """A typical architecture for ``params`` weights, when no config is available.

    Decoder-only LLMs keep about 128 hidden units per layer (Llama 3 8B: 4096/32) and put ~12·h² weights
    in a layer, so params ≈ 12·h³/128; the rest follows Llama 3's ratios.
    """
    h = max(256, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    return replace(
        dims(
            hidden_size=h,
            num_layers=max(1, round(params / (12 * h * h))),
            intermediate_size=int(3.5 * h),
            num_heads=max(1, h // 128),
            num_kv_heads=max(1, h // 512),
            vocab_size=128256,
        ),
        params=params,
        source=source,
    )


@dataclass(frozen=True)
class MemoryLine:
    name: str
    bytes: float
    detail: str
    # Grows with the chip's tokens (perDeviceBatchSize x maxSeqLength): what a smaller batch or a shorter
    # sequence shrinks, and LoRA, adafactor or more chips do not.
    grows_with_tokens: bool = False


@dataclass(frozen=True)
class HostMemory:
    """Host RAM of one host (TPU VM) at its peak, and the checkpoint it is derived from (bytes)."""

    checkpoint_bytes: float  # written per checkpoint, all hosts together
    weights_bytes: float  # of which the saved weights (the rest: optimizer state)
    shard: int  # fsdp x tensor: the ways each tensor is split
    chips_holding: int  # the host's chips holding distinct shards: min(chips per host, shard)
    load_bytes: float  # the largest tensor of the model, in the model dtype
    largest_tensor: str  # what it is, for the reader
    export_bytes: float
    runtime_bytes: float
    ram_bytes: int  # the machine type's RAM
    machine_type: str
    processes: int = 1  # trainer processes on the host: 1 (xla), one per chip (native)

    @property
    def per_host_bytes(self) -> float:
        """The checkpoint bytes one host writes: its chips' distinct shards."""
        return self.checkpoint_bytes / self.shard * self.chips_holding

    @property
    def save_bytes(self) -> float:
        """What a host stages in RAM at each save (one save in flight: one staging copy)."""
        return self.per_host_bytes

    @property
    def phase(self) -> str:
        """Which of load, save and export needs the most: "save", "load" or "export"."""
        needs = {"save": self.save_bytes, "load": self.load_bytes, "export": self.export_bytes}
        return max(needs, key=lambda name: needs[name])

    @property
    def peak_bytes(self) -> float:
        return self.runtime_bytes + max(self.load_bytes, self.save_bytes, self.export_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.ram_bytes


@dataclass(frozen=True)
class Plan:
    name: str
    shape: SliceShape
    mesh: tuple[int, int, int, int]  # fsdp, tensor, data (ICI, within a slice), dcn (slices)
    model: ModelDims
    method: str
    trainable_params: int
    lines: list[MemoryLine]
    hbm_bytes: int
    host: HostMemory  # host RAM per host, against the machine type's
    notes: list[str] = field(default_factory=list)
    global_batch: int = 0  # sequences per optimizer step (accumulation included)
    batch_chips: int = 0  # the chips the batch is split over (every axis but tensor)
    flops_per_token: float = 0.0

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.global_batch * self.seq_len

    @property
    def step_seconds(self) -> float:
        """One optimizer step at ASSUMED_MFU of the slices' peak."""
        peak = self.shape.chips * self.shape.family.peak_bf16_tflops_per_chip * 1e12
        return self.flops_per_step / (peak * ASSUMED_MFU)

    seq_len: int = 0

    @property
    def total_bytes(self) -> float:
        return sum(line.bytes for line in self.lines)

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def token_bytes(self) -> float:
        """The lines that grow with the chip's tokens: activations, attention scores, logits."""
        return sum(line.bytes for line in self.lines if line.grows_with_tokens)

    @property
    def activations_dominate(self) -> bool:
        """Most of the estimate is the batch's activations: only fewer tokens per chip can fix it."""
        return self.token_bytes > self.total_bytes / 2

    def line_bytes(self, name: str) -> float:
        return sum(line.bytes for line in self.lines if line.name == name)


def lora_trainable(
    model: ModelDims, r: int, targets: tuple[str, ...] | list[str] | None
) -> tuple[int, list[str]]:
    """Adapter weights: r x (in + out) per adapted matrix per layer. Returns (count, notes)."""
    names = list(targets) if targets else list(LORA_DEFAULT_TARGETS)
    if "all-linear" in names:
        names = list(ALL_LINEAR)
    h, i = model.hidden_size, model.intermediate_size
    shapes = {
        "q_proj": (h, model.q_width),
        "k_proj": (h, model.kv_width),
        "v_proj": (h, model.kv_width),
        "o_proj": (model.q_width, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    notes = []
    total = 0
    for name in names:
        fan_in, fan_out = shapes.get(name, (h, h))
        if name not in shapes:
            notes.append(f"LoRA target {name!r} is not a Llama-style projection; counted as h x h")
        total += r * (fan_in + fan_out) * model.num_layers
    return total, notes


def mesh_axes(spec: TPUFineTuneSpec, shape: SliceShape) -> tuple[int, int, int, int]:
    """(fsdp, tensor, data, dcn): the mesh's axis sizes within a slice (ICI) and across slices."""
    mesh_spec = spec.fsdp.mesh
    tensor = mesh_spec.tensor if mesh_spec else 1
    data = mesh_spec.data if mesh_spec else 1
    fsdp = mesh_spec.fsdp if mesh_spec and mesh_spec.fsdp else shape.chips_per_slice // (tensor * data)
    return fsdp, tensor, data, shape.slices


def trainable_params(spec: TPUFineTuneSpec, model: ModelDims) -> tuple[int, list[str]]:
    """Weights the optimizer updates (every weight for `full`, the adapters for `lora`), and notes."""
    training = spec.training
    if training.method != "lora":
        return model.params, []
    lora = training.lora
    return lora_trainable(model, lora.r if lora else 16, lora.target_modules if lora else None)


def optimizer_state_bytes(optimizer: str, trainable: int, model: ModelDims, dtype_bytes: int) -> float:
    """The optimizer state of ``trainable`` weights, all of it: adamw keeps two values per weight in
    the weight dtype; adafactor a float32 row and column vector per matrix (~2 x trainable / hidden)."""
    if optimizer == "adamw":
        return 2 * trainable * dtype_bytes
    return 2 * trainable / model.hidden_size * 4


def checkpoint_bytes(spec: TPUFineTuneSpec, model: ModelDims, trainable: int) -> tuple[float, float]:
    """(all, weights): bytes written per checkpoint by all hosts together, and the weights' part.

    The saved weights are every weight for `full`, the adapter weights for `lora` (the frozen base
    is read again from the model), in the model dtype; the rest is the trainable weights' optimizer
    state. A DPO reference copy is frozen and not saved."""
    w = DTYPE_BYTES[spec.model.dtype]
    weights = (model.params if spec.training.method == "full" else trainable) * w
    return weights + optimizer_state_bytes(spec.training.optimizer, trainable, model, w), float(weights)


def largest_tensor(model: ModelDims) -> tuple[int, str]:
    """(values, description) of the model's largest tensor: the embedding or the LM head (vocab x
    hidden), or an MLP matrix (hidden x I) if a model's is larger."""
    embedding = model.vocab_size * model.hidden_size
    mlp = model.hidden_size * model.intermediate_size
    if mlp > embedding:
        return mlp, f"an MLP matrix, {model.hidden_size} hidden x {model.intermediate_size}"
    return embedding, f"the embedding, {model.vocab_size} vocab x {model.hidden_size} hidden"


def host_memory(spec: TPUFineTuneSpec, shape: SliceShape, model: ModelDims) -> HostMemory:
    """Host RAM per host at its peak (see the module docstring), for a spec whose mesh is valid."""
    fsdp, tensor, _, _ = mesh_axes(spec, shape)
    shard = fsdp * tensor
    trainable, _ = trainable_params(spec, model)
    total, weights = checkpoint_bytes(spec, model, trainable)
    values, what = largest_tensor(model)
    processes = processes_per_host(spec, shape)
    return HostMemory(
        checkpoint_bytes=total,
        weights_bytes=weights,
        shard=shard,
        chips_holding=min(shape.chips_per_host, shard),
        # Each process may hold the largest tensor whole while it loads (a bound, as for xla).
        load_bytes=float(values * DTYPE_BYTES[spec.model.dtype] * processes),
        largest_tensor=what,
        export_bytes=float(EXPORT_GROUP_BYTES),
        runtime_bytes=float(RUNTIME_HOST_GIB * GIB * processes),
        ram_bytes=shape.host_ram_gib * GIB,
        machine_type=shape.machine_type,
        processes=processes,
    )


def processes_per_host(spec: TPUFineTuneSpec, shape: SliceShape) -> int:
    """Trainer processes on one host: one (xla: SPMD drives every chip of the host), or one per chip
    (native: torch.distributed, as TorchTPU runs)."""
    return shape.chips_per_host if spec.backend == "native" else 1


BACKEND_DESCRIPTIONS = {
    "xla": "PyTorch/XLA SPMD (torch_xla 2.9.0), one process per host",
    "native": "torch-native FSDP2 on TorchTPU (torch-tpu 0.2.0, Beta), one process per chip",
}


def host_suggestions(spec: TPUFineTuneSpec) -> list[str]:
    """What lowers a host's peak RAM, as the spec's fields say it."""
    out = ["use a larger topology (more hosts share the state)"]
    if spec.training.method == "full":
        out.append("training.method: lora")
    if spec.training.optimizer == "adamw":
        out.append("training.optimizer: adafactor")
    if spec.model.dtype == "float32":
        out.append("model.dtype: bfloat16")
    return out


def _or_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def host_ram_refusal(spec: TPUFineTuneSpec, shape: SliceShape, model: ModelDims | None = None) -> str | None:
    """Why a host cannot hold the run, for a spec whose mesh is valid; None when it fits, or when no
    ``model`` is given and the spec's is not in KNOWN_MODELS (the operator cannot read a model's
    config.json: validation judges the catalog's models, and the prepare Job's figures the others,
    `memory_verdict`). Put on spec.tpu.topology."""
    model = model or KNOWN_MODELS.get(spec.model.name)
    if model is None:
        return None
    host = host_memory(spec, shape, model)
    if host.fits:
        return None
    runtime = f"{host.runtime_bytes / GIB:.0f} GiB runtime"
    need = {
        "save": f"to save a checkpoint (staging {host.save_bytes / GIB:.0f} GiB of its chips' shards + {runtime})",
        "load": f"to load the model (its largest tensor, {host.load_bytes / GIB:.0f} GiB, + {runtime})",
        "export": f"to export the model (a {host.export_bytes / GIB:.0f} GiB gather group + {runtime})",
    }[host.phase]
    training = spec.training
    method = "full fine-tune" if training.method == "full" else "LoRA fine-tune"
    return (
        f"{spec.model.name} {method} with {training.optimizer} in {spec.model.dtype} needs "
        f"~{host.peak_bytes / GIB:.0f} GiB of host RAM per host {need}; a {host.machine_type} host has "
        f"{host.ram_bytes // GIB} GiB: {_or_list(host_suggestions(spec))} (`tpuft plan -f` shows the estimate)"
    )


def hbm_warning(p: Plan, ft: TPUFineTune) -> str | None:
    """What to know when the per-chip estimate exceeds the usable HBM, and what to change; None when
    it fits. Never a reason to refuse a run (the module docstring says why)."""
    if p.fits:
        return None
    return (
        f"the estimate, {p.total_bytes / GIB:.2f} GiB per chip, exceeds {1 - HEADROOM:.0%} of HBM "
        f"({_gib(p.usable_bytes).strip()} of {p.shape.family.hbm_gib_per_chip} GiB); "
        "the run would likely fail with OUT_OF_MEMORY. "
        + (_activations_dominate_sentence(p, ft) if p.activations_dominate else "")
        + "Try: "
        + "; ".join(suggestions(p, ft))
        + "."
    )


@dataclass(frozen=True)
class MemoryVerdict:
    """The plan's verdict on a run for a model's dimensions: the operator's, recomputed with the real
    figures the prepare Job read (prepare_contract.ModelFigures) before any TPU is requested."""

    params: int
    hbm_estimate_bytes: float  # per chip
    hbm_usable_bytes: float  # per chip, HEADROOM kept
    hbm_gib_per_chip: int
    host_peak_bytes: float  # per host
    host_ram_bytes: int  # per host, of its machine type
    machine_type: str
    host_refusal: str | None  # why a host cannot hold the run: it fails on spec.tpu.topology
    hbm_warning: str | None  # the HBM estimate does not fit: said, with what to change; the run goes on

    @property
    def host_fits(self) -> bool:
        return self.host_refusal is None

    @property
    def hbm_fits(self) -> bool:
        return self.hbm_warning is None

    def summary(self) -> str:
        """The figures in a sentence, e.g. for a condition that says they fit."""
        return (
            f"{_count(self.params)} parameters: ~{self.hbm_estimate_bytes / GIB:.1f} GiB per chip of "
            f"{self.hbm_usable_bytes / GIB:.1f} GiB usable HBM; a host's peak ~{self.host_peak_bytes / GIB:.0f} GiB "
            f"of its {self.host_ram_bytes // GIB} GiB ({self.machine_type})"
        )


def memory_verdict(ft: TPUFineTune, model: ModelDims) -> MemoryVerdict:
    """The plan's HBM and host-RAM verdict for a validated TPUFineTune and a model's dimensions."""
    p = plan(ft, model)
    return MemoryVerdict(
        params=model.params,
        hbm_estimate_bytes=p.total_bytes,
        hbm_usable_bytes=p.usable_bytes,
        hbm_gib_per_chip=p.shape.family.hbm_gib_per_chip,
        host_peak_bytes=p.host.peak_bytes,
        host_ram_bytes=p.host.ram_bytes,
        machine_type=p.host.machine_type,
        host_refusal=host_ram_refusal(ft.spec, p.shape, model),
        hbm_warning=hbm_warning(p, ft),
    )


# An assumption, stated wherever it is used: what one TPU VM writes per second while it saves its
# share of a checkpoint (torch.distributed.checkpoint through fsspec to gs://). A run's own figure
# shows in status.progress.lastCheckpoint (writeSeconds), which condition CheckpointSlow compares with
# the grace period.
STOP_WRITE_BYTES_PER_SECOND = 400 * 1024**2
# The work a Spot reclaim may cost (the steps since the last periodic checkpoint) that the saveSteps
# plan recommends bounds.
SPOT_LOSS_BOUND_SECONDS = 600


def pods_grace_seconds(spec: TPUFineTuneSpec, default: int = DEFAULT_GRACE_SECONDS) -> int:
    """The pods' termination grace period: spec.terminationGracePeriodSeconds, else the operator's
    ``default``. The one reading of the field, for the JobSet's pods and for the trainer's stop alike:
    a value given is kept as given (a 0 too, were the API ever to allow it), only a missing one
    takes the default."""
    given = spec.termination_grace_period_seconds
    return given if given is not None else default


def stop_grace_seconds(spec: TPUFineTuneSpec, default: int = DEFAULT_GRACE_SECONDS) -> int:
    """The time the pods get after SIGTERM on the stop that gives least: terminationGracePeriodSeconds
    (else the operator's ``default``), or a Spot reclaim's when shorter (GKE gives ordinary pods ~15 s)."""
    grace = pods_grace_seconds(spec, default)
    if spec.tpu.spot:
        grace = min(grace, spec.tpu.spot_grace_period_seconds or SPOT_GRACE_SECONDS)
    return grace


@dataclass(frozen=True)
class StopSave:
    """A stop's save against the grace period: SIGTERM comes during a step, which ends, then every host
    writes its share of the checkpoint (synchronously) before SIGKILL."""

    per_host_bytes: float
    step_seconds: float
    grace_seconds: int
    spot: bool
    save_steps: int | None

    @property
    def write_seconds(self) -> float:
        return self.per_host_bytes / STOP_WRITE_BYTES_PER_SECOND

    @property
    def needed_seconds(self) -> float:
        return self.step_seconds + self.write_seconds

    @property
    def fits(self) -> bool:
        return self.needed_seconds <= self.grace_seconds

    @property
    def bounding_save_steps(self) -> int:
        """A saveSteps whose steps take about SPOT_LOSS_BOUND_SECONDS: what a cut-off stop then costs."""
        return max(1, int(SPOT_LOSS_BOUND_SECONDS // max(self.step_seconds, 1e-9)))

    def warning(self) -> str | None:
        """What a user should know when the save does not fit, with the numbers; None when it does."""
        if self.fits:
            return None
        stop = "a Spot reclaim" if self.spot else "a stop"
        given = (
            "GKE: ~15 s of a Spot VM's 30 s notice; spec.tpu.spotGracePeriodSeconds if a node system config "
            "gives more"
            if self.spot
            else "spec.terminationGracePeriodSeconds"
        )
        at_risk = (
            f"up to the {self.save_steps} steps since the last periodic checkpoint "
            f"(~{self.save_steps * self.step_seconds:.0f} s)"
            if self.save_steps
            else "every step so far: training.saveSteps is not set"
        )
        advice = (
            f"training.saveSteps: {self.bounding_save_steps} bounds that to ~{SPOT_LOSS_BOUND_SECONDS // 60} minutes"
            if not self.save_steps or self.save_steps > self.bounding_save_steps
            else "training.saveSteps already bounds it"
        )
        return (
            f"{stop} gives the pods {self.grace_seconds} s ({given}), but finishing a step (~{self.step_seconds:.1f} s) "
            f"and writing each host's {self.per_host_bytes / GIB:.1f} GiB of the checkpoint (~{self.write_seconds:.0f} s "
            f"at an assumed {STOP_WRITE_BYTES_PER_SECOND / 1024**2:.0f} MiB/s) takes ~{self.needed_seconds:.0f} s: the "
            f"save is cut off and {at_risk} are trained again; {advice}"
        )


def stop_save(p: Plan, spec: TPUFineTuneSpec) -> StopSave:
    return StopSave(
        per_host_bytes=p.host.per_host_bytes,
        step_seconds=p.step_seconds,
        grace_seconds=stop_grace_seconds(spec),
        spot=spec.tpu.spot,
        save_steps=spec.training.save_steps,
    )


def spot_stop_warning(ft: TPUFineTune) -> str | None:
    """For a Spot run whose model is in KNOWN_MODELS (the operator cannot read a config.json): why a
    reclaim's save would be cut off, with the numbers; None when it fits or cannot be told."""
    model = KNOWN_MODELS.get(ft.spec.model.name)
    if model is None or not ft.spec.tpu.spot:
        return None
    return stop_save(plan(ft, model), ft.spec).warning()


def plan(ft: TPUFineTune, model: ModelDims) -> Plan:
    """Shape and memory per chip for a validated TPUFineTune and a model's dimensions."""
    spec = ft.spec
    tpu, training = spec.tpu, spec.training
    shape = resolve(tpu.type, tpu.topology, slices=tpu.slices, chips_per_host=tpu.chips_per_host)
    fsdp, tensor, data, _ = mesh_axes(spec, shape)
    shard = fsdp * tensor
    w = DTYPE_BYTES[spec.model.dtype]
    trainable, notes = trainable_params(spec, model)

    lines = [
        MemoryLine(
            "parameters",
            model.params * w / shard,
            f"{_count(model.params)} x {w} B / {shard} (fsdp x tensor)",
        ),
        MemoryLine("gradients", trainable * w / shard, f"{_count(trainable)} trainable x {w} B / {shard}"),
    ]
    optimizer = optimizer_state_bytes(training.optimizer, trainable, model, w) / shard
    if training.optimizer == "adamw":
        lines.append(MemoryLine("optimizer", optimizer, f"adamw: 2 states x {w} B per trainable"))
    else:
        lines.append(MemoryLine("optimizer", optimizer, "adafactor: a row + a column vector per matrix"))

    dpo = training.objective == "dpo"
    if dpo and training.method == "full":
        lines.append(
            MemoryLine(
                "reference",
                model.params * w / shard,
                f"dpo: a frozen copy, {_count(model.params)} x {w} B / {shard}, sharded like the weights",
            )
        )
    elif dpo:
        notes.append("dpo with lora: the reference is the base model with the adapter disabled (no copy)")

    b, s = training.per_device_batch_size, training.max_seq_length
    rows = 2 * b if dpo else b  # a preference pair is two sequences
    tokens = rows * s
    mlp = (4 if model.gated_mlp else 2) * model.intermediate_size
    one_layer = tokens * (7 * model.hidden_size + 2 * model.kv_width + mlp) * w
    scores = attention_score_bytes(model, rows, s, w)
    if spec.fsdp.gradient_checkpointing:
        activations = model.num_layers * tokens * model.hidden_size * w + one_layer
        how = f"checkpointing: {model.num_layers} layer inputs + 1 layer recomputed"
        layers_scored = 1
    else:
        activations = model.num_layers * one_layer
        how = f"no checkpointing: all {model.num_layers} layers kept"
        layers_scored = model.num_layers
    per_chip = f"{b} pairs = {rows} x {s} tokens per chip" if dpo else f"{b} x {s} tokens per chip"
    lines.append(MemoryLine("activations", activations, f"{per_chip}; {how}", grows_with_tokens=True))
    lines.append(
        MemoryLine(
            "attention",
            layers_scored * scores,
            f"{rows} x {model.num_heads} heads x {s} x {s} scores + probabilities x {layers_scored} layer(s)"
            " (SDPA/eager attention on XLA, no flash kernel)",
            grows_with_tokens=True,
        )
    )
    if dpo:
        tile = min(tokens, DPO_LOGPROB_TILE)
        lines.append(
            MemoryLine(
                "logits",
                tile * model.vocab_size * (w + 4),
                f"{model.vocab_size} vocab x a tile of {tile} positions (trl's fused LM head), + float32",
                grows_with_tokens=True,
            )
        )
    else:
        lines.append(
            MemoryLine(
                "logits",
                tokens * model.vocab_size * (w + 4),
                f"{model.vocab_size} vocab, + float32 for the loss",
                grows_with_tokens=True,
            )
        )
    lines.append(gathered_line(model, training.method, trainable, tensor, w))

    batch_chips = shape.chips // tensor  # the batch splits over every axis but tensor
    flops = model.flops_per_token(s, full=training.method == "full")
    if dpo:  # the reference's forward: 2 per weight + a third of the attention term
        flops += 2 * model.active_matmul_params + 4 * model.num_layers * model.hidden_size * s
    return Plan(
        global_batch=rows * batch_chips * training.gradient_accumulation_steps,
        batch_chips=batch_chips,
        flops_per_token=flops,
        seq_len=s,
        name=f"{ft.metadata.namespace}/{ft.metadata.name}",
        shape=shape,
        mesh=(fsdp, tensor, data, shape.slices),
        model=model,
        method=training.method,
        trainable_params=trainable,
        lines=lines,
        hbm_bytes=shape.family.hbm_gib_per_chip * GIB,
        host=host_memory(spec, shape, model),
        notes=notes,
    )


# Positions per tile of trl's chunked log-prob LM head (trl 1.16 _CHUNKED_LOGPROB_CHUNK_SIZE).
DPO_LOGPROB_TILE = 32768


def attention_score_bytes(model: ModelDims, rows: int, seq_len: int, dtype_bytes: int) -> float:
    """One layer's attention scores and probabilities for ``rows`` sequences: heads x seq x seq of each.
    transformers' SDPA and eager attention materialise both on XLA (no flash kernel), so this grows
    with the square of maxSeqLength while every other activation grows linearly."""
    return rows * 2 * model.num_heads * seq_len * seq_len * dtype_bytes


def gathered_line(model: ModelDims, method: str, trainable: int, tensor: int, dtype_bytes: int) -> MemoryLine:
    """What FSDPv2 holds whole on every chip for a moment, beyond each chip's shard.

    XLA all-gathers a wrapped decoder layer's weights before the layer runs; in the backward pass the
    layer's gradients are whole too until they are reduce-scattered (with LoRA, only the adapters have
    gradients). The embedding / LM head belong to no decoder layer and are gathered the same way, and the
    LM head's gradient is whole before its reduce-scatter while the next layer's gather is already under
    way: one layer and the head are counted together. The tensor axis still splits a layer's
    projections; it does not split the LM head."""
    full = method == "full"
    layer_grads = model.layer_params if full else trainable // model.num_layers
    layer = (model.layer_params + layer_grads) * dtype_bytes / tensor
    head = model.lm_head_params * dtype_bytes * (2 if full else 1)
    what = "weights + gradients" if full else "weights + adapter gradients"
    head_what = "weights + gradient" if full else "weights, frozen"
    return MemoryLine(
        "gathered",
        layer + head,
        f"FSDPv2 all-gathers, whole on every chip: a decoder layer's {what} ({_gib(layer).strip()})"
        f" + the LM head/embedding, {model.vocab_size} x {model.hidden_size}, {head_what} ({_gib(head).strip()})",
    )


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def token_levers(p: Plan, ft: TPUFineTune) -> list[str]:
    """What shrinks the lines that grow with the chip's tokens (activations, attention, logits)."""
    training = ft.spec.training
    out = []
    if not ft.spec.fsdp.gradient_checkpointing:
        out.append("turn on fsdp.gradientCheckpointing")
    if training.per_device_batch_size > 1:
        steps = training.per_device_batch_size * training.gradient_accumulation_steps
        out.append(
            f"training.perDeviceBatchSize: 1 with training.gradientAccumulationSteps: {steps}"
            f" (the same global batch, {p.global_batch} sequences)"
        )
    if p.activations_dominate:
        out.append(
            "a shorter training.maxSeqLength (all of them shrink with it, the attention scores with its square)"
        )
    return out


def weight_levers(p: Plan, ft: TPUFineTune) -> list[str]:
    """What shrinks the lines that do not depend on the batch: weights, gradients, optimizer state."""
    out = []
    if p.method == "full":
        out.append("use training.method: lora")
    if ft.spec.training.optimizer == "adamw":
        out.append("use training.optimizer: adafactor")
    out.append("use a larger topology (weights shard over every chip of a slice)")
    return out


def suggestions(p: Plan, ft: TPUFineTune) -> list[str]:
    """What to change when it does not fit, largest lever first. When the batch's activations are most
    of the estimate, the weights' levers cannot fix it: they are offered only if the rest alone does
    not fit either."""
    if not p.activations_dominate:
        return token_levers(p, ft) + weight_levers(p, ft)
    rest = p.total_bytes - p.token_bytes
    return token_levers(p, ft) + (weight_levers(p, ft) if rest > p.usable_bytes else [])


def _activations_dominate_sentence(p: Plan, ft: TPUFineTune) -> str:
    training = ft.spec.training
    rows = training.per_device_batch_size * (2 if training.objective == "dpo" else 1)
    parts = ", ".join(f"{line.name} {line.bytes / GIB:.2f}" for line in p.lines if line.grows_with_tokens)
    rest = p.total_bytes - p.token_bytes
    return (
        f"Activations dominate: {p.token_bytes / GIB:.2f} of {p.total_bytes / GIB:.2f} GiB grow with the chip's "
        f"{rows} x {training.max_seq_length} tokens ({parts} GiB); a larger "
        f"topology, LoRA or adafactor shrink only the other {rest / GIB:.2f} GiB. "
    )


ASSUMED_MFU = 0.4  # a good FSDP fine-tune on TPU (MaxText's Llama 3.1 8B on v6e-8: ~45%)


def _step_rows(p: Plan, ft: TPUFineTune) -> list[str]:
    training = ft.spec.training
    fam = p.shape.family
    peak = p.shape.chips * fam.peak_bf16_tflops_per_chip * 1e12
    at_peak = p.flops_per_step / peak
    return [
        "",
        "One optimizer step (estimate)",
        f"  batch       {training.per_device_batch_size}"
        + (" pair(s) (2 sequences each)" if training.objective == "dpo" else "")
        + f" per chip x {p.batch_chips} chips"
        f" x {training.gradient_accumulation_steps} accumulated = {p.global_batch} sequences of {p.seq_len}"
        f" ({_count(p.global_batch * p.seq_len)} tokens)",
        f"  compute     {p.flops_per_token:.3g} model FLOPs per token (6N + 12 x layers x hidden x seq), "
        f"{p.flops_per_step:.3g} per step",
        f"  time        {at_peak:.3g} s at the chips' peak ({fam.peak_bf16_tflops_per_chip:g} TFLOP/s bf16 each); "
        f"~{at_peak / ASSUMED_MFU:.3g} s at {ASSUMED_MFU:.0%} MFU",
    ]


def _stop_rows(stop: StopSave) -> list[str]:
    source = "a Spot reclaim (GKE: ~15 s for ordinary pods)" if stop.spot else "terminationGracePeriodSeconds"
    rows = [
        "",
        "A stop's save (estimate)",
        f"  grace       {stop.grace_seconds} s after SIGTERM, from {source}",
        f"  needed      ~{stop.needed_seconds:.0f} s: the step under way (~{stop.step_seconds:.1f} s) + writing "
        f"{stop.per_host_bytes / GIB:.1f} GiB per host at an assumed {STOP_WRITE_BYTES_PER_SECOND / 1024**2:.0f} MiB/s",
    ]
    warning = stop.warning()
    if warning:
        rows.append(f"WARNING: {warning}.")
    return rows


def _host_rows(p: Plan, ft: TPUFineTune) -> list[str]:
    host, spec = p.host, ft.spec
    w = DTYPE_BYTES[spec.model.dtype]
    saved = _count(p.model.params if p.method == "full" else p.trainable_params)
    state = _gib(host.checkpoint_bytes - host.weights_bytes).strip()
    rows = [
        "",
        "Host memory per host (estimate)",
        f"  {'checkpoint':<12}{_gib(host.checkpoint_bytes)}   written per save in all: weights {saved} x {w} B"
        f" + {spec.training.optimizer} state of {_count(p.trainable_params)} trainable ({state})",
        f"  {'per host':<12}{_gib(host.per_host_bytes)}   / {host.shard} (fsdp x tensor) x {host.chips_holding}"
        " chips of the host holding distinct shards",
        f"  {'save':<12}{_gib(host.save_bytes)}   staging its shards in RAM at each save (one save in flight)",
        f"  {'load':<12}{_gib(host.load_bytes)}   the largest tensor, whole: {host.largest_tensor} x {w} B"
        + (f", in each of {host.processes} processes" if host.processes > 1 else ""),
        f"  {'export':<12}{_gib(host.export_bytes)}   one gather group of the final export",
        f"  {'runtime':<12}{_gib(host.runtime_bytes)}   allowance: Python, torch_xla/libtpu (a prepared dataset"
        " is memory-mapped: page cache)"
        if host.processes == 1
        else f"  {'runtime':<12}{_gib(host.runtime_bytes)}   allowance: {RUNTIME_HOST_GIB} GiB x {host.processes}"
        " processes (one per chip): Python, torch/TorchTPU/libtpu (assumed, not measured)",
    ]
    ram = host.ram_bytes // GIB
    verdict = "fits" if host.fits else "DOES NOT FIT"
    rows.append(
        f"  {'peak':<12}{_gib(host.peak_bytes)}   runtime + {host.phase} (the largest of load, save, export);"
        f" {host.peak_bytes / host.ram_bytes:.0%} of {ram} GiB ({host.machine_type}): {verdict}"
    )
    if not host.fits:
        known = host_ram_refusal(spec, p.shape) is not None
        refused = (
            " (`tpuft render` and the operator refuse this spec: spec.tpu.topology)"
            if known
            else " (the operator refuses this spec once its prepare Job has read the model, before any TPU"
            " is requested: spec.tpu.topology)"
            if spec.prepare.enabled
            else ""
        )
        rows.append(
            f"WARNING: a host needs more RAM than its {ram} GiB; it would likely run out of host memory"
            + refused
            + ". Try: "
            + "; ".join(host_suggestions(spec))
            + "."
        )
    return rows


def format_plan(p: Plan, ft: TPUFineTune) -> str:
    shape, fam = p.shape, p.shape.family
    fsdp, tensor, data, dcn = p.mesh
    rows = [
        f"TPUFineTune {p.name}",
        "",
        "Shape",
        f"  type        {fam.name} ({fam.accelerator}), topology {shape.topology}, {shape.slices} slice(s)",
        f"  chips       {shape.chips} ({shape.chips_per_slice} per slice)",
        f"  hosts       {shape.hosts} ({shape.hosts_per_slice} per slice), {shape.chips_per_host} chips per host,"
        f" machine {shape.machine_type}",
        f"  mesh        fsdp={fsdp} tensor={tensor} data={data} within a slice (ICI); dcn={dcn} across slices",
        f"  HBM         {fam.hbm_gib_per_chip} GiB per chip",
        f"  host RAM    {shape.host_ram_gib} GiB per host ({shape.machine_type})",
        f"  backend     {ft.spec.backend}: {BACKEND_DESCRIPTIONS[ft.spec.backend]}"
        + (f" ({shape.chips_per_host} per host)" if ft.spec.backend == "native" else ""),
    ]
    caveat = trainer_stack_caveat(ft.spec.model_dump(by_alias=True))
    if caveat:  # what the operator says in condition TrainerStackVerified; not a reason to exit 1
        rows.append(f"WARNING: {caveat}.")
    rows += [
        "",
        f"Model {ft.spec.model.name}: {_count(p.model.params)} parameters",
        f"  source      {p.model.source}",
        f"  method      {p.method}: {_count(p.trainable_params)} trainable; optimizer {ft.spec.training.optimizer};"
        f" dtype {ft.spec.model.dtype}",
        "",
        "Memory per chip (estimate)",
    ]
    rows += [f"  {line.name:<12}{_gib(line.bytes)}   {line.detail}" for line in p.lines]
    share = p.total_bytes / p.hbm_bytes
    verdict = "fits" if p.fits else "DOES NOT FIT"
    rows.append(
        f"  {'total':<12}{_gib(p.total_bytes)}   {share:.0%} of {fam.hbm_gib_per_chip} GiB: {verdict}"
    )
    warning = hbm_warning(p, ft)
    if warning is not None:
        rows.append(f"WARNING: {warning}")
    elif share > 0.75:
        rows.append("note: tight; XLA's temporary buffers may push it over. Leave some margin.")
    rows += _host_rows(p, ft)
    rows += _step_rows(p, ft)
    rows += _stop_rows(stop_save(p, ft.spec))
    rows += ["", *[f"note: {n}" for n in p.notes]] if p.notes else []
    rows += [
        "",
        "Assumptions: Llama-style decoder layers; weights, gradients and optimizer state sharded over",
        "fsdp x tensor and replicated across slices, one layer and the LM head gathered whole at a time;",
        "activations of one chip's batch, SDPA/eager attention without a flash kernel (seq x seq scores);",
        f"{HEADROOM:.0%} of HBM kept for XLA buffers and the runtime; per host, sharded checkpoints with one",
        f"save in flight and {RUNTIME_HOST_GIB} GiB of host RAM allowed for the runtime"
        + (" of each process (backend native: one per chip)" if ft.spec.backend == "native" else "")
        + ". See docs/plan.md.",
    ]
    return "\n".join(rows) + "\n"
