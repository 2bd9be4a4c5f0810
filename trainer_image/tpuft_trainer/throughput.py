"""Model FLOPs per token and the MFU estimate (model FLOPs utilisation).

MFU = model FLOPs per token x tokens per second / (chips x the chip's peak bf16 FLOP/s). The peak comes
from the operator's topology catalog (rendered into ``world.peak_flops_per_chip``); without it there is
no MFU. It is an estimate, as everywhere it is quoted:

- model FLOPs per token, as in the PaLM paper (appendix B): 6 x N for the weight matmuls (2 forward,
  4 backward) + 12 x layers x hidden x sequence length for attention (QK^T and AV, forward and
  backward). N counts every parameter except the input embedding lookup (no FLOPs). With LoRA the
  frozen weights need no weight gradients: 4 x N for them, 6 x N for the adapters;
- recomputation (gradient checkpointing) is not counted: it is hardware work, not model work;
- a mixture of experts counts every expert (an over-estimate by num_experts / experts_per_token for
  the expert weights);
- padding positions count like tokens (the positions are computed whatever they hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFlops:
    frozen_matmul_params: int
    trainable_matmul_params: int
    layers: int
    hidden_size: int
    # DPO: a forward of the reference (a frozen copy, or the base without the adapters) per token.
    reference_forward: bool = False

    def per_token(self, seq_len: int) -> float:
        matmuls = 4 * self.frozen_matmul_params + 6 * self.trainable_matmul_params
        attention = 12 * self.layers * self.hidden_size * seq_len
        if self.reference_forward:
            matmuls += 2 * (self.frozen_matmul_params + self.trainable_matmul_params)
            attention += 4 * self.layers * self.hidden_size * seq_len
        return float(matmuls + attention)


def model_flops(model: Any, *, reference_forward: bool = False) -> ModelFlops:
    """From a transformers model (or a PEFT model around one), before it is wrapped."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings()
    lookup = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    output = base.get_output_embeddings()
    tied = output is not None and any(id(p) in lookup for p in output.parameters())
    frozen = trainable = 0
    for param in model.parameters():
        if id(param) in lookup and not tied:
            continue  # a lookup, no FLOPs (when tied, the same matrix is the output projection)
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return ModelFlops(
        frozen, trainable, int(config.num_hidden_layers), int(config.hidden_size), reference_forward
    )


def mfu(
    tokens_per_second: float | None, flops_per_token: float, chips: int, peak_per_chip: float | None
) -> float | None:
    if not tokens_per_second or not peak_per_chip or chips < 1:
        return None
    return tokens_per_second * flops_per_token / (chips * peak_per_chip)


class TokenCounter:
    """Counts, for every optimizer step ``trainer`` trains, the positions it processed and the ones that
    count in the loss, exactly. Positions are shapes, known on the host. Loss tokens the Trainer
    already counts on the device (``num_items_in_batch``, the loss's denominator, in
    ``get_batch_samples``: training only; evaluation counts elsewhere); they are summed there and read
    once, at the end, so no step waits for the host. (A step's micro-batches are fewer at an epoch's
    end, so positions are counted rather than assumed.)"""

    def __init__(self, trainer: Any) -> None:
        self.positions: list[int] = []  # per optimizer step
        self._loss_tokens: Any = None
        self._draw = trainer.get_batch_samples
        trainer.get_batch_samples = self._counting

    def _counting(self, *args: Any, **kwargs: Any) -> Any:
        batch_samples, items = self._draw(*args, **kwargs)
        self.positions.append(sum(int(batch["input_ids"].numel()) for batch in batch_samples))
        if items is not None:
            self._loss_tokens = items if self._loss_tokens is None else self._loss_tokens + items
        return batch_samples, items

    def loss_tokens(self) -> int | None:
        """None when the model takes no count (then the Trainer computes none)."""
        return None if self._loss_tokens is None else round(float(self._loss_tokens))
