"""The recipe options on real SPMD, one process per configuration: ``python recipe_cases.py CASE OUT.json``
(the cases.py pattern: one process returns a JSON of observations for every assertion about it)."""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import itertools

import tiny
from spmd import finish_case

from tpuft_trainer import recipe
from tpuft_trainer.config import TrainingConfig
from tpuft_trainer.data.packing import best_fit, build_row
from tpuft_trainer.fsdp_v2 import get_fsdp_training_args, use_fsdp_v2
from tpuft_trainer.train import peft_lora_config

SEQ = 32
# Documents of a few lengths, several to a row once packed.
DOC_WORDS = (2, 5, 1, 3, 4, 2, 6, 1)


def _transfers() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _documents() -> list[list[int]]:
    tok = tiny.tokenizer()
    docs = []
    for i, words in enumerate(DOC_WORDS * 4):
        text = " ".join(tiny.WORDS[(i + k) % len(tiny.WORDS)] for k in range(words)) + "."
        docs.append(list(tok(text)["input_ids"]))
    return docs


def packed_rows(docs: list[list[int]], max_length: int, pad_id: int) -> dict[str, list[list[int]]]:
    """The documents packed as the trainer packs them (data.packing), every token in the loss."""
    import numpy as np

    members, starts = best_fit(np.asarray([len(d) for d in docs]), max_length)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "labels": []}
    for a, b in itertools.pairwise(starts):
        chosen = [np.asarray(docs[i]) for i in members[a:b]]
        row = build_row(chosen, [np.ones(len(d)) for d in chosen], max_length, pad_id, packed=True)
        for key in rows:
            rows[key].append(row[key].tolist())
    return rows


def _trainer(model: Any, dataset: Any, steps: int, **settings: Any) -> Any:
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **{"per_device_train_batch_size": 8, "learning_rate": 1e-2, **settings},
        **get_fsdp_training_args(model),
    )
    return Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)


def _logged(trainer: Any, key: str) -> list[float]:
    return [float(entry[key]) for entry in trainer.state.log_history if key in entry]


def packing(lora: bool = False) -> dict[str, Any]:
    """Training on packed rows keeps one graph; a document's logits packed equal its logits alone;
    the same row without position ids (plain concatenation) leaks; no host sync per forward.
    ``lora``: the same with the model under a LoRA adapter, as `tpuft train` wraps it (peft's model
    must pass the packed rows' position ids through to the base model)."""
    import torch
    import torch_xla
    from datasets import Dataset
    from transformers import TrainerCallback

    docs = _documents()
    rows = packed_rows(docs, SEQ, tiny.tokenizer().pad_token_id)
    model = tiny.model("llama")
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, peft_lora_config(None))
    compiles: list[int] = []

    class Compiles(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            compiles.append(_compiles())

    trainer = _trainer(model, Dataset.from_dict(rows), steps=6, per_device_train_batch_size=4)
    trainer.add_callback(Compiles())
    trainer.train()
    wrapped = trainer.model.eval()
    batch = {k: torch.tensor(v[:4]).to("xla") for k, v in rows.items() if k != "labels"}

    torch_xla.sync()
    before = _transfers()
    with torch.no_grad():
        packed = wrapped(**batch).logits
    torch_xla.sync()
    transfers_in_forward = _transfers() - before
    packed_cpu = packed.cpu()
    with torch.no_grad():
        leaky = wrapped(input_ids=batch["input_ids"]).logits.cpu()

    worst = worst_leak = 0.0
    documents = 0
    for row in range(4):
        positions = rows["position_ids"][row]
        starts = [i for i, p in enumerate(positions) if p == 0]
        for start, end in zip(starts, [*starts[1:], SEQ], strict=True):
            ids = rows["input_ids"][row][start:end]
            if rows["labels"][row][start + 1 : end].count(-100) == end - start - 1:
                continue  # the padding tail
            with torch.no_grad():
                alone = wrapped(input_ids=torch.tensor([ids]).to("xla")).logits.cpu()[0]
            worst = max(worst, float((packed_cpu[row, start:end] - alone).abs().max()))
            worst_leak = max(worst_leak, float((leaky[row, start:end] - alone).abs().max()))
            documents += 1
    return {
        "compiles": compiles,
        "losses": _logged(trainer, "loss"),
        "documents_compared": documents,
        "max_abs_diff_packed_vs_alone": worst,
        "max_abs_diff_concatenated_vs_alone": worst_leak,
        "transfers_in_forward": transfers_in_forward,
        "row_fill": sum(1 for label in rows["labels"][0] if label != -100) / SEQ,
        "trainable_share": sum(p.numel() for p in model.parameters() if p.requires_grad)
        / sum(p.numel() for p in model.parameters()),
    }


def packing_forward_transfers() -> str:
    """What compat_needed reports for packed_mask_on_device: host transfers in one packed forward."""
    import torch
    import torch_xla

    rows = packed_rows(_documents(), SEQ, tiny.tokenizer().pad_token_id)
    model = tiny.model("llama").to("xla")
    batch = {k: torch.tensor(v[:4]).to("xla") for k, v in rows.items() if k != "labels"}
    torch_xla.sync()
    before = _transfers()
    with torch.no_grad():
        model(**batch)
    torch_xla.sync()
    return f"host transfers in a packed forward={_transfers() - before}"


def knobs() -> dict[str, Any]:
    """Clipping under FSDPv2 clips; accumulation equals the bigger batch; the schedules' values."""
    import torch
    from transformers import TrainerCallback

    result: dict[str, Any] = {}

    class PostClipNorm(TrainerCallback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            grads = [p.grad for p in kw["model"].parameters() if p.grad is not None]
            self.norms.append(float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads))))

    for name, max_norm in (("clipped", 0.05), ("unclipped", 0.0)):
        post = PostClipNorm()
        trainer = _trainer(tiny.model(), tiny.token_dataset(), steps=3, max_grad_norm=max_norm)
        trainer.add_callback(post)
        trainer.train()
        result[name] = {"logged_grad_norms": _logged(trainer, "grad_norm"), "post_clip_norms": post.norms}

    for name, batch, accumulation in (("big_batch", 16, 1), ("accumulated", 8, 2)):
        trainer = _trainer(
            tiny.model(),
            tiny.token_dataset(),
            steps=3,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            optim="adamw_torch",
        )
        trainer.train()
        result[name] = {"losses": _logged(trainer, "loss"), "grad_norms": _logged(trainer, "grad_norm")}

    schedules = {
        "cosine": TrainingConfig(max_steps=8, learning_rate=0.01, lr_scheduler="cosine", warmup_ratio=0.25),
        "constant": TrainingConfig(max_steps=8, learning_rate=0.01, lr_scheduler="constant", warmup_steps=3),
        "linear": TrainingConfig(max_steps=8, learning_rate=0.01, warmup_steps=2),
    }
    for name, training in schedules.items():
        arguments = recipe.training_arguments(training, global_batch=8, evaluates=False)
        trainer = _trainer(tiny.model(), tiny.token_dataset(), steps=8, learning_rate=0.01, **arguments)
        trainer.train()
        result[f"schedule:{name}"] = _logged(trainer, "learning_rate")
    return result


def packing_lora() -> dict[str, Any]:
    return packing(lora=True)


CASES = {f.__name__: f for f in (packing, packing_lora, knobs)}

if __name__ == "__main__":
    case, out_path = sys.argv[1], sys.argv[2]
    use_fsdp_v2()
    try:
        outcome = CASES[case]()
    except Exception:
        traceback.print_exc()
        raise
    finish_case(out_path, outcome)
