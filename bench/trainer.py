"""FSDPv2 on 1, 2, 4 and 8 PJRT CPU devices: steps/s, tokens/s, XLA compilations, and the bytes of
parameters each device holds against total / N; then the two training backends, xla and native, side
by side through `tpuft train` (bench/backends.py). Results: bench/results/trainer.json, one run of
both. `python -m bench trainer` then runs the recipes' and DPO's benchmarks (recipes.json, dpo.json)
unless `--skip-recipes`.

Each device count runs in its own process (SPMD is process-global). CPU "devices" share one host's
cores, so the throughput column shows the cost of SPMD partitioning and collectives on CPU, not TPU
speed; the bytes-per-device column is the real point: FSDPv2 holds ~1/N of the parameters per device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import results_file

RESULTS = results_file("trainer")
DEVICE_COUNTS = (1, 2, 4, 8)
MODEL: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, vocab_size=512
)
SEQ_LEN, GLOBAL_BATCH, WARMUP_STEPS, TIMED_STEPS = 64, 16, 3, 10


def worker() -> dict[str, Any]:
    """Runs inside the per-device-count process."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from tpuft_trainer.fsdp_v2 import get_fsdp_training_args, use_fsdp_v2

    use_fsdp_v2()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, num_key_value_heads=4, use_cache=False))
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = (WARMUP_STEPS + TIMED_STEPS) * GLOBAL_BATCH
    ids = torch.randint(0, MODEL["vocab_size"], (rows, SEQ_LEN)).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "labels": ids})
    marks: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            data = met.metric_data("CompileTime")
            marks.append((time.perf_counter(), int(data[0]) if data else 0))

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=tempfile.mkdtemp(),
            max_steps=WARMUP_STEPS + TIMED_STEPS,
            per_device_train_batch_size=GLOBAL_BATCH,
            logging_steps=1,  # a loss fetch per step: every step really finishes before the clock reads
            report_to=[],
            disable_tqdm=True,
            save_strategy="no",
            **get_fsdp_training_args(model),
        ),
        train_dataset=dataset,
        callbacks=[Clock()],
    )
    trainer.train()
    per_device: dict[str, int] = {}
    assert trainer.model is not None
    for param in trainer.model.parameters():
        for shard in torch_xla._XLAC._get_local_shards([param])[0]:
            tensor, device = shard
            per_device[device] = per_device.get(device, 0) + tensor.numel() * tensor.element_size()
    devices = xr.global_runtime_device_count()
    seconds = marks[-1][0] - marks[WARMUP_STEPS - 1][0]
    return {
        "devices": devices,
        "steps_per_second": round(TIMED_STEPS / seconds, 3),
        "tokens_per_second": round(TIMED_STEPS * GLOBAL_BATCH * SEQ_LEN / seconds, 1),
        "compiles_after_warmup": marks[WARMUP_STEPS - 1][1],
        "compiles_at_end": marks[-1][1],
        "parameter_bytes_total": total_bytes,
        "parameter_bytes_per_device_max": max(per_device.values()),
        "parameter_bytes_total_over_n": total_bytes // devices,
        "parameter_bytes_per_device": dict(sorted(per_device.items())),
    }


def run(devices: int) -> dict[str, Any]:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), HF_HUB_OFFLINE="1")
    out = Path(tempfile.mkdtemp()) / "result.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench.trainer", "--worker", str(out)],
        env=env,
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode:
        raise SystemExit(f"bench on {devices} devices failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_seconds"] = round(time.monotonic() - started, 1)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--skip-recipes",
        action="store_true",
        help="rewrite trainer.json only (the device counts and the backends), not recipes.json and dpo.json",
    )
    return p


def main(skip_recipes: bool = False) -> None:
    from bench import backends  # tpuft train at backend xla and native: needs the native venv

    backends.native_python()  # missing: an error saying how to get it, before anything runs
    started, load_start = datetime.now(UTC), _load_average()
    results = [run(n) for n in DEVICE_COUNTS]
    both = backends.main()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "what": "tiny Llama (FSDPv2, stock Trainer) on PJRT CPU devices",
                "started": started.isoformat(timespec="seconds"),
                "load_average": {"start": load_start, "end": _load_average()},
                "model": MODEL,
                "seq_len": SEQ_LEN,
                "global_batch": GLOBAL_BATCH,
                "timed_steps": TIMED_STEPS,
                "cpu_count": os.cpu_count(),
                "results": results,
                "backends": both,
            },
            indent=1,
        )
        + "\n"
    )
    print(
        f"{'devices':>7} {'steps/s':>8} {'tokens/s':>9} {'compiles':>9} {'bytes/device':>13} {'total/N':>9}"
    )
    for r in results:
        compiles = f"{r['compiles_after_warmup']}->{r['compiles_at_end']}"
        print(
            f"{r['devices']:>7} {r['steps_per_second']:>8} {r['tokens_per_second']:>9} {compiles:>9} "
            f"{r['parameter_bytes_per_device_max']:>13} {r['parameter_bytes_total_over_n']:>9}"
        )
    print("\n".join(backends.report(both)))
    print(f"written to {RESULTS}")
    if skip_recipes:
        return
    from bench import recipes  # the recipes' targets: packing's gain, tpuft train's overhead

    recipes.main()
    from bench import dpo  # preference tuning: DPO's loss, margin, step time and compiles against SFT's

    dpo.main()


def _load_average() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        Path(sys.argv[2]).write_text(json.dumps(worker()))
    else:
        main(**vars(parser().parse_args(sys.argv[1:])))
