"""Preference tuning (objective dpo) in the native loop: trl's DPO loss on the prepared pairs, each
process scoring its pairs of the global batch, against a reference that is rebuilt, never checkpointed.

What is the xla backend's (dpo.py, trl 1.16's DPOTrainer with the settings dpo.arguments passes):

- the pairs: the prepared files (data/preference.py), in the xla order (batches.Order: each process its
  rows of each global batch); a batch is every pair's prompt + chosen, then every pair's prompt +
  rejected, cut to ``max_seq_length`` (``keep_start``) and right-padded to exactly it (one shape);
- the log-probs: trl's fused LM head (``add_fused_lm_head``: the per-token log-probs of the completion
  tokens, in chunks, never the whole ``rows x positions x vocabulary`` logits), summed per sequence;
  dropout off in both models (trl's ``disable_dropout``);
- the loss: ``beta`` and ``loss_type`` (sigmoid, hinge, ipo: config.DPO_LOSS_TYPES, the only ones the
  API offers), the mean over the step's pairs (trl takes the batch's mean; the Trainer the mean of its
  micro-batches'). Each process backpropagates its pairs' sum over the step's pair count, times the
  batch's parts (runtime.data_ways: FSDP2 averages gradients over them), and sums over the batch go
  through runtime.batch_sum, as the SFT loop's do;
- the metrics trl logs of the rewards (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
  ``rewards/margins``) and of the log-probs (``logps/chosen``, ``logps/rejected``): means over every
  pair since the last log; the loss-token count (completion tokens scored).

The reference (``Reference``): for method full a frozen second copy built as the policy is (meta
device, ``fully_shard``, each process reading its slices) from the model's source: it costs P / chips
of memory per chip (no gradients, no optimizer state) and one forward a micro-batch. Not trl's
precomputed log-probs: those need a pass over every pair before the first step (the whole data set,
however few steps the run takes) and, to survive a restart, a cache keyed on the model, the data and
the settings; the copy is also what the xla backend uses, so the backends compute the same numbers the
same way. With LoRA the reference is the policy with its adapter disabled (``AdapterDisabled``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tpuft_trainer import lora
from tpuft_trainer.config import DPO_LOSS_TYPES, TrainerConfig
from tpuft_trainer.errors import ConfigError
from tpuft_trainer.native import model as native_model
from tpuft_trainer.native import runtime

log = logging.getLogger(__name__)

# The sums a process keeps on the device between logs (one vector: one all-reduce at a log).
_LOSS, _CHOSEN, _REJECTED, _CORRECT, _LOGPS_CHOSEN, _LOGPS_REJECTED, _PAIRS = range(7)
_SUMS = 7
# trl's names of what it logs (TensorBoard: train/<name>; the run record keeps accuracies and margins).
REWARD_METRICS = {
    "rewards/chosen": _CHOSEN,
    "rewards/rejected": _REJECTED,
    "rewards/accuracies": _CORRECT,
    "logps/chosen": _LOGPS_CHOSEN,
    "logps/rejected": _LOGPS_REJECTED,
}
MARGINS = "rewards/margins"


@dataclass(frozen=True)
class Settings:
    beta: float
    loss_type: str
    max_length: int
    pad_id: int

    @classmethod
    def of(cls, config: TrainerConfig, tokenizer: Any) -> Settings:
        dpo = config.training.dpo_settings
        if dpo.loss_type not in DPO_LOSS_TYPES:  # the contract allows no other; a hand-edited file might
            raise ConfigError(
                f"training.dpo.loss_type {dpo.loss_type!r}: the native loop computes {list(DPO_LOSS_TYPES)}"
            )
        # trl's collator pads with the tokenizer's pad token, else its EOS (DPOTrainer sets it so).
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(dpo.beta, dpo.loss_type, config.training.max_seq_length, int(pad))


def collate(pairs: Sequence[dict[str, Any]], settings: Settings, device: Any) -> dict[str, Any]:
    """Prepared pairs -> ``input_ids``, ``attention_mask``, ``completion_mask`` of ``2 x pairs`` rows
    (chosen rows, then rejected) of exactly ``max_length`` positions, as trl's collator makes them
    with ``truncation_mode keep_start`` and ``pad_to_multiple_of = max_length``."""
    import torch

    length = settings.max_length
    ids = torch.full((2 * len(pairs), length), settings.pad_id, dtype=torch.long)
    attention = torch.zeros((2 * len(pairs), length), dtype=torch.long)
    completion = torch.zeros_like(attention)
    for side, key in enumerate(("chosen_ids", "rejected_ids")):
        for i, pair in enumerate(pairs):
            prompt, answer = list(pair["prompt_ids"]), list(pair[key])
            row = (prompt + answer)[:length]
            at = side * len(pairs) + i
            ids[at, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[at, : len(row)] = 1
            completion[at, len(prompt) : len(row)] = 1
    return {name: t.to(device) for name, t in
            (("input_ids", ids), ("attention_mask", attention), ("completion_mask", completion))}  # fmt: skip


def sequence_log_probs(model: Any, batch: dict[str, Any]) -> Any:
    """Each row's summed log-probability of its completion tokens (trl's fused LM head)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=labels,
        fused_lm_head=True,
    )
    return out.log_probs.sum(dim=1)


@dataclass
class Terms:
    """Per pair: the loss, beta x each side's log-ratio (trl's rewards)."""

    loss: Any
    chosen_rewards: Any
    rejected_rewards: Any


def dpo_terms(policy: Any, reference: Any, completion_mask: Any, settings: Settings) -> Terms:
    """trl 1.16's DPO loss (reverse KL, one loss type, no length weighting) from the per-sequence
    log-probs of the chosen rows then the rejected rows, of the policy and of the reference."""
    import torch
    import torch.nn.functional as F

    chosen, rejected = policy.chunk(2)
    reference_chosen, reference_rejected = reference.chunk(2)
    chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    delta = chosen_ratio - rejected_ratio
    beta = settings.beta
    if settings.loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * delta)
    elif settings.loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    elif settings.loss_type == "ipo":
        # trl normalises each side's log-ratio by its completion's length (the unshifted mask's count).
        chosen_mask, rejected_mask = completion_mask.chunk(2)
        normalised = chosen_ratio / chosen_mask.sum(dim=1).clamp(
            min=1.0
        ) - rejected_ratio / rejected_mask.sum(dim=1).clamp(min=1.0)
        loss = (normalised - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(
            f"training.dpo.loss_type {settings.loss_type!r} is not one the native loop computes"
        )
    return Terms(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


class Reference(Protocol):
    """Where the reference's log-probs come from."""

    def log_probs(self, batch: dict[str, Any]) -> Any: ...

    def sharding(self) -> dict[str, str]: ...

    def release(self) -> None: ...


class FrozenCopy:
    """Method full: a second copy of the source model, sharded as the policy, never trained."""

    def __init__(self, model: Any) -> None:
        model.requires_grad_(False)
        self.model = model.eval()

    def log_probs(self, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad():
            out = sequence_log_probs(self.model, batch)
        native_model.reshard(self.model)
        return out

    def sharding(self) -> dict[str, str]:
        return {name: str(tuple(getattr(p, "placements", ()))) for name, p in self.model.named_parameters()}

    def release(self) -> None:
        self.model = None


class AdapterDisabled:
    """Method lora: the policy itself with its adapter switched off (peft's ``disable_adapter``): the
    base weights, which LoRA never changes. No second copy."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def log_probs(self, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad(), lora.reference(self.policy):
            return sequence_log_probs(self.policy, batch)

    def sharding(self) -> dict[str, str]:
        return {}

    def release(self) -> None:
        pass


def prepare(policy: Any, config: TrainerConfig, rt: runtime.Runtime) -> Reference:
    """The policy given trl's fused LM head and dropout off; the reference for ``config``'s method."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    add_fused_lm_head(base)
    disable_dropout_in_model(policy)
    if config.training.method == "lora":
        return AdapterDisabled(policy)
    reference = native_model.build(config, rt, weights=True).model  # from the source, even on resume
    add_fused_lm_head(reference)
    disable_dropout_in_model(reference)
    return FrozenCopy(reference)


@dataclass
class Step:
    loss: Any  # this process's share of the step's mean loss (a device scalar; summed over processes)
    loss_tokens: Any  # completion tokens scored over every process (all-reduced)
    positions: int  # this process's positions (padding included)


class Trainer:
    """The DPO step and its metrics for the native loop; the loop keeps the optimizer, saves, stops."""

    def __init__(
        self, settings: Settings, reference: Reference, rt: runtime.Runtime, pairs_per_step: int
    ) -> None:
        import torch

        self.settings, self.reference, self.rt, self.pairs_per_step = settings, reference, rt, pairs_per_step
        self._sums = torch.zeros(_SUMS, dtype=torch.float32, device=rt.device)

    def step(self, policy: Any, micro_batches: Sequence[Sequence[dict[str, Any]]]) -> Step:
        """Forward and backward over this process's pairs of each micro-batch (no optimizer step)."""
        import torch

        total = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        tokens = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        positions = 0
        for pairs in micro_batches:
            batch = collate(pairs, self.settings, self.rt.device)
            reference = self.reference.log_probs(batch)
            logps = sequence_log_probs(policy, batch)
            terms = dpo_terms(logps, reference, batch["completion_mask"], self.settings)
            share = terms.loss.sum() / self.pairs_per_step
            (share * self.rt.data_ways).backward()  # FSDP2 averages over the batch's parts: undo it
            total += share.detach().float()
            tokens += batch["completion_mask"][:, 1:].sum().float()
            positions += batch["input_ids"].numel()
            self._add(terms, logps.detach())
        return Step(total, runtime.batch_sum(tokens, self.rt), positions)

    def _add(self, terms: Terms, logps: Any) -> None:
        import torch

        chosen, rejected = logps.float().chunk(2)
        self._sums += torch.stack(
            [
                terms.loss.detach().float().sum(),
                terms.chosen_rewards.float().sum(),
                terms.rejected_rewards.float().sum(),
                (terms.chosen_rewards > terms.rejected_rewards).float().sum(),
                chosen.sum(),
                rejected.sum(),
                torch.tensor(float(len(chosen)), device=chosen.device),
            ]
        )

    def metrics(self) -> dict[str, float]:
        """trl's reward and log-prob means over every pair since the last call (all processes')."""
        import torch

        sums = runtime.batch_sum(self._sums.to(torch.float64).cpu(), self.rt)
        self._sums.zero_()
        pairs = max(float(sums[_PAIRS]), 1.0)
        out = {name: float(sums[index]) / pairs for name, index in REWARD_METRICS.items()}
        out[MARGINS] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def eval_rows(pairs: int, global_batch: int, rank: int, processes: int) -> list[list[tuple[int, bool]]]:
    """This process's (pair, counts) of each evaluation batch: every pair once, in order, each global
    batch split as a training batch is; the last batch's missing places filled with pair 0 not counted
    (every process runs the same forwards: FSDP2's collectives need them all)."""
    per = global_batch // processes
    batches = math.ceil(pairs / global_batch)
    out = []
    for index in range(batches):
        start = index * global_batch + rank * per
        out.append([(i, True) if i < pairs else (0, False) for i in range(start, start + per)])
    return out


def evaluate(
    policy: Any, reference: Reference, rows: Any, settings: Settings, global_batch: int, rt: runtime.Runtime
) -> float:
    """The mean DPO loss over every evaluation pair (what trl's evaluation loop reports as eval_loss)."""
    import torch

    total = torch.zeros(2, dtype=torch.float64)
    policy.eval()
    try:
        with torch.no_grad():
            for batch_rows in eval_rows(len(rows), global_batch, rt.data_rank, rt.data_ways):
                batch = collate([rows[i] for i, _ in batch_rows], settings, rt.device)
                counts = torch.tensor([c for _, c in batch_rows], dtype=torch.float64)
                terms = dpo_terms(
                    sequence_log_probs(policy, batch),
                    reference.log_probs(batch),
                    batch["completion_mask"],
                    settings,
                )
                total += torch.stack([(terms.loss.double().cpu() * counts).sum(), counts.sum()])
    finally:
        native_model.reshard(policy)
        policy.train()
    runtime.batch_sum(total, rt)
    return float(total[0] / total[1].clamp(min=1))


class Evaluator:
    """The loop's evaluator for DPO (the SFT loop's _Evaluator's interface)."""

    def __init__(self, policy: Any, trainer: Trainer, rows: Any, global_batch: int) -> None:
        self.policy, self.trainer, self.rows, self.global_batch = policy, trainer, rows, global_batch

    @property
    def available(self) -> bool:
        return self.rows is not None

    def __call__(self) -> float:
        t = self.trainer
        return evaluate(self.policy, t.reference, self.rows, t.settings, self.global_batch, t.rt)
