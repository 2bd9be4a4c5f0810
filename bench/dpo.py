"""Preference tuning (issue 16) on 4 PJRT CPU devices, part of `make bench`'s trainer part.

`tpuft train` three times on the same tiny Llama, rows of SEQ_LEN and mesh: SFT on GLOBAL_ROWS rows
per step, then DPO (full, and LoRA) on GLOBAL_ROWS / 2 preference pairs per step, which are the same
GLOBAL_ROWS sequences (prompt + chosen, prompt + rejected). So the step times compare like for like
in positions: what DPO adds is the reference's forward (a frozen copy for full, the base with the
adapter disabled for LoRA) and trl's loss and metrics. Reported: the DPO loss from its first step
(ln 2: the policy starts as the reference) to its last, the reward margin and accuracy, the median
step time against SFT's, and the compilation counts after warm-up and at the end (flat: one shape).

Runs one after the other (the machine has two cores). Results: bench/results/dpo.json.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import results_file
from bench.recipes import DEVICES, MODEL, _config, run_tpuft_train

RESULTS = results_file("dpo")
SEQ_LEN, GLOBAL_ROWS, WARMUP_STEPS, TIMED_STEPS = 128, 16, 4, 16
CHOSEN = [f"w{i}" for i in range(10, 20)]  # the preferred kind of answer
REJECTED = [f"w{i}" for i in range(20, 30)]


def _materials(root: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(root / "model")
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, MODEL["vocab_size"])}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(root / "model")
    rng = random.Random(2)
    rows = (WARMUP_STEPS + TIMED_STEPS + 2) * GLOBAL_ROWS
    words = [f"w{i}" for i in range(30, MODEL["vocab_size"])]

    def text(n: int, pool: list[str]) -> str:
        return " ".join(rng.choice(pool) for _ in range(n))

    with (root / "pairs.jsonl").open("w") as out:
        for _ in range(rows):
            prompt = text(rng.randrange(SEQ_LEN // 4, SEQ_LEN // 2), words) + " "
            answer = rng.randrange(SEQ_LEN // 8, SEQ_LEN // 4)
            pair = {"prompt": prompt, "chosen": text(answer, CHOSEN), "rejected": text(answer, REJECTED)}
            out.write(json.dumps(pair) + "\n")
    with (root / "rows.jsonl").open("w") as out:  # SFT: a full row of SEQ_LEN positions each
        for _ in range(rows):
            out.write(json.dumps({"text": text(SEQ_LEN, words)}) + "\n")
    return root / "model"


def _train(root: Path, name: str, dataset: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    config = {
        "model": {"name": str(root / "model"), "dtype": "float32"},
        "dataset": dataset,
        "training": {
            "max_steps": WARMUP_STEPS + TIMED_STEPS,
            "learning_rate": 2e-3,
            "max_seq_length": SEQ_LEN,
            **training,
        },
        "output": {"uri": str(root / name)},
        "world": {"chips_per_host": DEVICES},
    }
    record = run_tpuft_train(config, root / f"{name}.yaml", timeout=1800)
    compiles = {int(k): v for k, v in record["compiles_after_step"].items()}
    result: dict[str, Any] = {
        "median_step_seconds": round(statistics.median(record["step_seconds"][-TIMED_STEPS:]), 4),
        "tokens_per_second": record["tokens_per_second"],
        "compiles_after_warmup": compiles[WARMUP_STEPS],
        "compiles_at_end": compiles[max(compiles)],
        "losses": [round(v, 4) for v in record["losses"].values()],
    }
    if record.get("reward_margins"):
        result["reward_margins"] = [round(v, 4) for v in record["reward_margins"].values()]
        result["reward_accuracies"] = [round(v, 3) for v in record["reward_accuracies"].values()]
        result["reference_sharded"] = record["reference_sharding"] == record["parameter_sharding"]
    return result


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tpuft-bench-dpo-"))
    _materials(root)
    rows = GLOBAL_ROWS // DEVICES
    pairs = {"name": str(root / "pairs.jsonl"), "format": "preference"}
    runs = {
        "sft": _train(root, "sft", {"name": str(root / "rows.jsonl")}, {"per_device_batch_size": rows}),
        "dpo_full": _train(root, "dpo-full", pairs, {"objective": "dpo", "per_device_batch_size": rows // 2}),
        "dpo_lora": _train(
            root,
            "dpo-lora",
            pairs,
            {
                "objective": "dpo",
                "method": "lora",
                "learning_rate": 1e-2,
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                "per_device_batch_size": rows // 2,
            },
        ),
    }
    sft = runs["sft"]["median_step_seconds"]
    results = {
        "what": (
            f"tiny Llama {MODEL}, rows of {SEQ_LEN}, {GLOBAL_ROWS} sequences per step (SFT rows, or "
            f"{GLOBAL_ROWS // 2} DPO pairs), {DEVICES} PJRT CPU devices, beta 0.1"
        ),
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "ln2": round(math.log(2), 4),
        **runs,
        "step_time_vs_sft": {
            k: round(runs[k]["median_step_seconds"] / sft, 2) for k in ("dpo_full", "dpo_lora")
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report(results)))
    return results


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"dpo ({results['what']}; bench/results/dpo.json):"]
    for name in ("sft", "dpo_full", "dpo_lora"):
        run = results[name]
        positions = GLOBAL_ROWS * SEQ_LEN / run["median_step_seconds"]  # the same positions every step
        line = (
            f"  {name:<9} step {run['median_step_seconds']:.3f} s ({positions:,.0f} positions/s), "
            f"compiles {run['compiles_after_warmup']}->{run['compiles_at_end']}, "
            f"loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}"
        )
        if "reward_margins" in run:
            line += (
                f", margin {run['reward_margins'][0]:.3f} -> {run['reward_margins'][-1]:.3f}, "
                f"accuracy {run['reward_accuracies'][-1]:.2f}, "
                f"step time {results['step_time_vs_sft'][name]:.2f}x SFT's"
            )
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
