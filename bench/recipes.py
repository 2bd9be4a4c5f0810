"""The recipes' two throughput targets (issue 15), on 4 PJRT CPU devices, part of `make bench`'s trainer part:

1. packing: loss-bearing tokens per second, padded vs packed rows of the same documents, on an
   instruction-like length distribution (most documents a fraction of the row). Target >= 2.5x.
2. overhead: `tpuft train`'s step time against a minimal hand-written torch_xla SPMD loop
   (SpmdFullyShardedDataParallel, MpDeviceLoader, AdamW, clipping, a loss read per step) for the same
   model, batch, data and mesh. Target <= 15%.

Each measurement runs in its own process (SPMD is process-global), one after the other, so they do
not share the machine's two cores. CPU step times are noisy: the report gives ratios from one run,
each side the median of its timed steps. Results: bench/results/recipes.json.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from bench import results_file

RESULTS = results_file("recipes")
DEVICES = 4
MODEL: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=512,
)
SEQ_LEN, GLOBAL_BATCH, WARMUP_STEPS, TIMED_STEPS = 256, 16, 4, 16
# Instruction-like documents: log-normal lengths, median 40 tokens (a sixth of the row), 8 to the row.
MEDIAN_TOKENS, SIGMA, DOCUMENTS = 40, 0.8, 4000
TARGET_PACKING_RATIO, TARGET_OVERHEAD = 2.5, 0.15
ROUNDS = 3


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL, use_cache=False, pad_token_id=0)


def _documents() -> list[Any]:
    from bench.legacy_data import Document

    rng = random.Random(0)
    docs = []
    for _ in range(DOCUMENTS):
        length = min(SEQ_LEN, max(8, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))))
        ids = [rng.randrange(2, MODEL["vocab_size"]) for _ in range(length)]
        docs.append(Document(ids, list(ids)))
    return docs


def _steps_timer() -> tuple[Any, list[float]]:
    from transformers import TrainerCallback

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append(time.perf_counter())

    return Clock(), marks


def _median_step(marks: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(marks[-TIMED_STEPS - 1 :]))


def packing_worker() -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator

    from bench.legacy_data import figures, packed_rows, padded_rows
    from tpuft_trainer.fsdp_v2 import get_fsdp_training_args, use_fsdp_v2

    use_fsdp_v2()
    docs = _documents()
    result: dict[str, Any] = {
        "documents": len(docs),
        "mean_tokens": statistics.mean(len(d.input_ids) for d in docs),
    }
    forms = {"padded": padded_rows(docs, SEQ_LEN, 0), "packed": packed_rows(docs, SEQ_LEN, 0)}
    # The two forms alternate (the machine is shared); each keeps its best round's median step.
    for name, rows in [*forms.items()] * ROUNDS:
        dataset = Dataset.from_dict(rows)
        shares = figures(dataset)
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        clock, marks = _steps_timer()
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=tempfile.mkdtemp(),
                max_steps=WARMUP_STEPS + TIMED_STEPS,
                per_device_train_batch_size=GLOBAL_BATCH,
                logging_steps=1,
                report_to=[],
                disable_tqdm=True,
                save_strategy="no",
                **get_fsdp_training_args(model, gradient_checkpointing=False),
            ),
            train_dataset=dataset,
            data_collator=default_data_collator,
            callbacks=[clock],
        )
        trainer.train()
        step = _median_step(marks)
        if name in result and result[name]["median_step_seconds"] <= step:
            continue
        loss_tokens_per_step = shares.loss_share * GLOBAL_BATCH * SEQ_LEN
        result[name] = {
            "rows": shares.rows,
            "loss_token_share": round(shares.loss_share, 4),
            "median_step_seconds": round(step, 4),
            "loss_tokens_per_second": round(loss_tokens_per_step / step, 1),
        }
    result["ratio"] = round(
        result["packed"]["loss_tokens_per_second"] / result["padded"]["loss_tokens_per_second"], 2
    )
    return result


def _token_rows() -> list[list[int]]:
    rng = random.Random(1)
    rows = (WARMUP_STEPS + TIMED_STEPS + 2) * GLOBAL_BATCH
    return [[rng.randrange(2, MODEL["vocab_size"]) for _ in range(SEQ_LEN)] for _ in range(rows)]


def hand_loop_worker() -> dict[str, Any]:
    """The minimal torch_xla SPMD FSDPv2 loop, as torch_xla's documentation writes it."""
    import functools

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch.utils.data import DataLoader
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(devices), (devices, 1), ("fsdp", "tensor"))
    xs.set_global_mesh(mesh)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(_config())
    model = model.to("xla")  # (transformers types `to` as if its first argument were the model)

    def shard_output(output: Any, mesh: Any) -> None:
        # Called for the model's output and every wrapped block's (a tensor, or a tuple starting with one).
        tensor = getattr(output, "logits", None)
        if tensor is None:
            tensor = output[0] if isinstance(output, tuple) else output
        xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))

    model = SpmdFullyShardedDataParallel(
        model,
        mesh=mesh,
        shard_output=shard_output,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
        ),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor(_token_rows())
    rows = [{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)} for row in ids]
    loader = pl.MpDeviceLoader(
        # a list is a map-style dataset (torch types the argument as a Dataset)
        DataLoader(cast(Any, rows), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True),
        "xla",
        input_sharding=xs.ShardingSpec(mesh, ("fsdp", None)),
    )
    marks: list[float] = []
    losses: list[float] = []
    for step, batch in enumerate(loader):
        if step == WARMUP_STEPS + TIMED_STEPS:
            break
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())  # a loss read every step, as the Trainer's logging_steps=1
        marks.append(time.perf_counter())
    return {"median_step_seconds": round(_median_step(marks), 4), "losses": losses}


def tpuft_train_run() -> dict[str, Any]:
    """`tpuft train --config` on the same model, rows, batch and mesh."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    root = Path(tempfile.mkdtemp(prefix="tpuft-bench-"))
    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(root / "model")
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, MODEL["vocab_size"])}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>").save_pretrained(
        root / "model"
    )
    with (root / "rows.jsonl").open("w") as out:
        for row in _token_rows():
            out.write(json.dumps({"text": " ".join(f"w{i}" for i in row)}) + "\n")
    config = {
        "model": {"name": str(root / "model"), "dtype": "float32"},
        "dataset": {"name": str(root / "rows.jsonl")},
        "fsdp": {"gradient_checkpointing": False},
        "training": {
            "max_steps": WARMUP_STEPS + TIMED_STEPS,
            "learning_rate": 1e-3,
            "per_device_batch_size": GLOBAL_BATCH // DEVICES,
            "max_seq_length": SEQ_LEN,
            "optimizer": "adamw",
        },
        "output": {"uri": str(root / "out")},
        "world": {"chips_per_host": DEVICES},
    }
    record = run_tpuft_train(config, root / "config.yaml", timeout=900)
    steps = record["step_seconds"][-TIMED_STEPS:]
    return {
        "median_step_seconds": round(statistics.median(steps), 4),
        "losses": list(record["losses"].values()),
    }


def run_tpuft_train(config: dict[str, Any], path: Path, *, timeout: float) -> dict[str, Any]:
    """`tpuft train` on ``config`` (written to ``path``) on this machine's CPU devices; its run record
    (tpuft-metrics.json at the config's output). A failed run ends the benchmark with its stderr."""
    import yaml

    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [str(Path(sys.executable).with_name("tpuft")), "train", "--config", str(path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        raise SystemExit(f"tpuft train ({path.name}) failed:\n{done.stderr[-3000:]}")
    return json.loads((Path(config["output"]["uri"]) / "tpuft-metrics.json").read_text())


def _env() -> dict[str, str]:
    return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES), HF_HUB_OFFLINE="1")


def _worker(name: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.recipes", name, str(out)],
        env=_env(),
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode:
        raise SystemExit(f"bench.recipes {name} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> dict[str, Any]:
    packing = _worker("packing")
    # The machine is shared: the two sides alternate, and each keeps its best round's median step.
    rounds = [{"hand_loop": _worker("hand-loop"), "tpuft_train": tpuft_train_run()} for _ in range(ROUNDS)]
    hand = min((r["hand_loop"] for r in rounds), key=lambda r: r["median_step_seconds"])
    ours = min((r["tpuft_train"] for r in rounds), key=lambda r: r["median_step_seconds"])
    overhead = ours["median_step_seconds"] / hand["median_step_seconds"] - 1
    results = {
        "what": f"tiny Llama {MODEL}, rows of {SEQ_LEN}, global batch {GLOBAL_BATCH}, {DEVICES} PJRT CPU devices",
        "cpu_count": os.cpu_count(),
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "packing": packing,
        "overhead": {
            "hand_loop": hand,
            "tpuft_train": ours,
            "overhead": round(overhead, 3),
            "rounds": [
                {side: r[side]["median_step_seconds"] for side in ("hand_loop", "tpuft_train")}
                for r in rounds
            ],
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report(results)))
    return results


def report(results: dict[str, Any]) -> list[str]:
    packing, overhead = results["packing"], results["overhead"]
    verdict = "met" if packing["ratio"] >= TARGET_PACKING_RATIO else "NOT met"
    lines = [
        f"recipes ({results['what']}; bench/results/recipes.json):",
        f"  documents: {packing['documents']}, mean {packing['mean_tokens']:.1f} tokens (median {MEDIAN_TOKENS}) in rows of {SEQ_LEN}",
    ]
    for name in ("padded", "packed"):
        side = packing[name]
        lines.append(
            f"  {name:<7} {side['rows']:>5} rows, {side['loss_token_share']:.1%} of positions in the loss, "
            f"step {side['median_step_seconds']:.3f} s, {side['loss_tokens_per_second']:,.0f} loss tokens/s"
        )
    lines.append(
        f"  packed / padded loss tokens/s: {packing['ratio']:.2f}x (target >= {TARGET_PACKING_RATIO}x: {verdict})"
    )
    verdict = "met" if overhead["overhead"] <= TARGET_OVERHEAD else "NOT met"
    lines.append(
        f"  step time: tpuft train {overhead['tpuft_train']['median_step_seconds']:.3f} s, hand-written loop "
        f"{overhead['hand_loop']['median_step_seconds']:.3f} s: overhead {overhead['overhead']:+.1%} "
        f"(target <= {TARGET_OVERHEAD:.0%}: {verdict}; best of {len(overhead['rounds'])} alternating rounds: "
        + ", ".join(f"{r['tpuft_train']:.3f}/{r['hand_loop']:.3f}" for r in overhead["rounds"])
        + ")"
    )
    return lines


if __name__ == "__main__":
    workers = {"packing": packing_worker, "hand-loop": hand_loop_worker}
    if len(sys.argv) == 3 and sys.argv[1] in workers:
        Path(sys.argv[2]).write_text(json.dumps(workers[sys.argv[1]]()))
    else:
        main()
