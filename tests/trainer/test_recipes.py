"""The recipe options on real SPMD over 4 CPU devices: packing isolation, clipping, accumulation,
schedules (recipe_cases.py), and `tpuft train` with every option on at once: chat with assistant-only
loss, packing, held-out evaluation, warmup + cosine, weight decay, clipping, accumulation, TensorBoard."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import tiny
from spmd import Pool, Proc, run_case, run_train
from test_train_cli import materials, write_config

from tpuft_trainer.exit_codes import ExitCode

pytestmark = pytest.mark.trainer

EVERYTHING = {
    "max_steps": 8,
    "learning_rate": 0.01,
    "per_device_batch_size": 1,  # x 4 devices x 2 accumulated = 8 rows a step
    "gradient_accumulation_steps": 2,
    "max_seq_length": 256,
    "save_steps": 4,
    "eval_steps": 3,  # evaluations at 3 and 6, and at the end (8)
    "lr_scheduler": "cosine",
    "warmup_ratio": 0.25,
    "weight_decay": 0.01,
    "max_grad_norm": 0.5,
    "optimizer": "adamw",
}


def everything_config() -> tuple[Path, Path]:
    root = Path(tempfile.mkdtemp(prefix="tpuft-recipe-"))
    chats = tiny.write_rows(root / "chats.jsonl", tiny.long_question_chats(96))
    return write_config(
        {
            "dataset": {"name": str(chats), "format": "chat", "packing": True, "eval_fraction": 0.25},
            "training": EVERYTHING,
            "world": {"chips_per_host": 4, "peak_flops_per_chip": 1e12},
        }
    )


def everything_on() -> tuple[Proc, Path]:
    config, output = everything_config()
    return run_train(config), output


def everything_on_stopped_and_resumed() -> tuple[Proc, Proc, Path]:
    """The same run, SIGTERMed after step 5 (between the evaluation at 3 and the one at 6), resumed."""
    config, output = everything_config()
    stopped = run_train(config, TPUFT_FAULT_SIGTERM_AT_STEP="5")
    return stopped, run_train(config, TPUFT_RESTART_ATTEMPT="1"), output


def bad(overrides: dict[str, Any]) -> Proc:
    config, _ = write_config(overrides)
    return run_train(config)


def gpt2_packing() -> Proc:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = Path(tempfile.mkdtemp(prefix="tpuft-gpt2-"))
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=tiny.VOCAB_SIZE)).save_pretrained(
        path
    )
    tiny.tokenizer().save_pretrained(path)
    return bad({"model": {"name": str(path)}, "dataset": {"packing": True}})


def small_eval_set() -> tuple[Proc, Path, Path]:
    """12 held-out rows (0.19 of 64) for a global batch of 8: two evaluation batches, the second filled
    with 4 rows that carry no loss (a set smaller than one batch was refused before)."""
    config, output = write_config({"dataset": {"name": str(materials()["text"]), "eval_fraction": 0.19}})
    return run_train(config), config, output


SPMD_JOBS = {
    "recipe:train": everything_on,
    "recipe:train:stopped": everything_on_stopped_and_resumed,
    "recipe:packing@4": functools.partial(run_case, "packing", 4, "recipe_cases.py"),
    "recipe:packing-lora@4": functools.partial(run_case, "packing_lora", 4, "recipe_cases.py"),
    "recipe:knobs@4": functools.partial(run_case, "knobs", 4, "recipe_cases.py"),
    "recipe:bad:gpt2-packing": gpt2_packing,
    "recipe:small-eval": small_eval_set,
}


def result(pool: Pool, name: str) -> dict[str, Any]:
    return pool.get(name).result  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", ["recipe:packing@4", "recipe:packing-lora@4"])
def test_packed_documents_do_not_see_each_other(pool: Pool, case: str) -> None:
    found = result(pool, case)
    assert found["documents_compared"] >= 8
    assert found["row_fill"] > 0.6  # several short documents to a row
    assert found["max_abs_diff_packed_vs_alone"] < 1e-4, found
    # the same rows as plain concatenations leak across documents: the comparison can fail
    assert found["max_abs_diff_concatenated_vs_alone"] > 1e-2, found
    assert found["transfers_in_forward"] == 0  # compat.packed_mask_on_device: no host sync per forward
    assert len(set(found["compiles"][2:])) == 1, found["compiles"]  # after warm-up, one graph for all steps
    assert found["losses"][-1] < found["losses"][0]
    # the LoRA case trains its adapter alone (the base weights are frozen), the other everything
    assert (found["trainable_share"] < 0.5) == case.startswith("recipe:packing-lora"), found[
        "trainable_share"
    ]


def test_gradient_clipping_under_fsdp_v2_clips(pool: Pool) -> None:
    found = result(pool, "recipe:knobs@4")
    clipped, unclipped = found["clipped"], found["unclipped"]
    assert all(norm > 0.5 for norm in clipped["logged_grad_norms"])  # logged: the norm before clipping
    assert clipped["post_clip_norms"] == pytest.approx([0.05] * 3, rel=1e-3)
    assert unclipped["post_clip_norms"] == pytest.approx(unclipped["logged_grad_norms"], rel=1e-4)


def test_accumulation_equals_the_bigger_batch(pool: Pool) -> None:
    found = result(pool, "recipe:knobs@4")
    assert len(found["accumulated"]["losses"]) == 3
    assert found["accumulated"]["losses"] == pytest.approx(found["big_batch"]["losses"], rel=1e-5)
    assert found["accumulated"]["grad_norms"] == pytest.approx(found["big_batch"]["grad_norms"], rel=1e-4)


def transformers_schedule(name: str, warmup: int, steps: int = 8, peak: float = 0.01) -> list[float]:
    """The learning rate of each step, from transformers' own scheduler (what step k trains with)."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("ours", "theirs", "warmup"),
    [("cosine", "cosine", 2), ("constant", "constant_with_warmup", 3), ("linear", "linear", 2)],
)
def test_schedules_are_transformers_own(pool: Pool, ours: str, theirs: str, warmup: int) -> None:
    got = result(pool, "recipe:knobs@4")[f"schedule:{ours}"]
    assert got == pytest.approx(transformers_schedule(theirs, warmup), rel=1e-6, abs=1e-12)


def metrics(output: Path) -> dict[str, Any]:
    return json.loads((output / "tpuft-metrics.json").read_text())  # type: ignore[no-any-return]


def by_step(values: dict[str, float]) -> dict[int, float]:
    return {int(step): value for step, value in values.items()}


def test_everything_on_trains_evaluates_and_keeps_one_graph(pool: Pool) -> None:
    proc, output = pool.get("recipe:train")
    assert proc.returncode == 0, proc.tail()
    record = metrics(output)
    evals = by_step(record["eval_losses"])
    assert sorted(evals) == [3, 6, 8], evals
    assert evals[8] < evals[3], evals  # the held-out answers are learned
    assert "eval loss" in proc.stderr and "progress: step 8/8" in proc.stderr
    assert record["rows_per_step"] == 8
    # 36 packed rows = 9 micro-batches an epoch: each epoch's last step has one micro-batch, not two
    rows = 8 * 8 - 4
    assert record["tokens"] == rows * 256
    # assistant-only loss: the one-word answers are a few percent of the packed positions
    assert 0.02 < record["loss_token_share"] < 0.12, record["loss_token_share"]
    # exactly the answers' tokens of the rows trained on (the evaluation's rows are not counted): the
    # dataset's mean per row times the rows, within what sampling 64 of 36 rows can change
    assert abs(record["loss_tokens"] - record["loss_token_share"] * 256 * rows) < 2 * rows, record[
        "loss_tokens"
    ]
    assert record["tokens_per_second"] > 0 and record["flops_per_token"] > 0
    assert record["mfu"] == pytest.approx(
        record["tokens_per_second"] * record["flops_per_token"] / (4 * 1e12), rel=1e-6
    )
    assert by_step(record["learning_rates"]) == pytest.approx(
        dict(enumerate(transformers_schedule("cosine", 2), start=1)), rel=1e-6
    )
    assert all(norm > 0 for norm in record["grad_norms"].values())
    compiles = by_step(record["compiles_after_step"])
    after_eval, after_save = by_step(record["compiles_after_eval"]), by_step(record["compiles_after_save"])
    # warm-up: the first steps, the first evaluation (3) and the first save (4) compile; then the steps
    # and the evaluations compile nothing (an evaluation runs after its step's on_step_end)
    assert compiles[6] == compiles[7] == compiles[8], compiles
    assert after_eval[6] == compiles[6], (after_eval, compiles)
    assert after_eval[8] == after_save[8], (after_eval, after_save)  # the final evaluation reuses its graph


def test_a_stopped_packed_evaluated_run_resumes_with_the_same_losses(pool: Pool) -> None:
    """Resume with packing, assistant-only loss, evaluation and accumulation on: the packed rows, the
    held-out split and the schedule come back as they were, so the steps after the stop and the
    evaluations at 6 and 8 equal the uninterrupted run's."""
    stopped, resumed, output = pool.get("recipe:train:stopped")
    reference = metrics(pool.get("recipe:train")[1])
    assert stopped.returncode == ExitCode.STOPPED_AFTER_CHECKPOINT, stopped.tail()
    assert resumed.returncode == 0, resumed.tail()
    record = metrics(output)
    assert record["resumed_from"] == "checkpoint-5"
    got, want = by_step(record["losses"]), by_step(reference["losses"])
    assert sorted(got) == [6, 7, 8]
    assert got == pytest.approx({step: want[step] for step in (6, 7, 8)}, rel=1e-5)
    evals, want_evals = by_step(record["eval_losses"]), by_step(reference["eval_losses"])
    assert evals == pytest.approx({step: want_evals[step] for step in (6, 8)}, rel=1e-5), evals


def test_tensorboard_events_hold_the_losses(pool: Pool) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, output = pool.get("recipe:train")
    assert proc.returncode == 0, proc.tail()
    logs = output / "tensorboard"
    assert list(logs.glob("events.out.tfevents.*")), sorted(p.name for p in output.iterdir())
    events = EventAccumulator(str(logs))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "eval/loss", "train/learning_rate", "train/grad_norm"} <= set(scalars), scalars
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses == pytest.approx(by_step(metrics(output)["losses"]), rel=1e-6)
    assert sorted(e.step for e in events.Scalars("eval/loss")) == [3, 6, 8]


@pytest.mark.parametrize(
    ("job", "code", "message"),
    [
        ("recipe:bad:gpt2-packing", ExitCode.CONFIG_ERROR, "'gpt2' is not one of them"),
    ],
)
def test_recipe_misconfigurations_fail_fast(pool: Pool, job: str, code: int, message: str) -> None:
    proc = pool.get(job)
    assert proc.returncode == code, proc.tail()
    assert message in proc.stderr
    assert "progress: step" not in proc.stderr


def test_a_small_evaluation_set_works_and_its_loss_is_the_mean_over_its_tokens(pool: Pool) -> None:
    """The padding rows carry no loss, and the partly filled batch counts by its tokens: the run's
    final evaluation loss is the exported model's mean over the 12 real rows' tokens, computed here on
    plain torch, not the mean of the two batches' means (which the Trainer alone would report)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuft_trainer.config import TrainerConfig
    from tpuft_trainer.data import prepare

    proc, config_path, output = pool.get("recipe:small-eval")
    assert proc.returncode == 0, proc.tail()
    assert "12 rows padded with 4 that carry no loss" in proc.stderr
    record = metrics(output)
    assert (record["eval_set"]["rows"], record["eval_set"]["padding"], record["eval_set"]["batches"]) == (
        12,
        4,
        2,
    )
    config = TrainerConfig.load(config_path)
    tokenizer = AutoTokenizer.from_pretrained(output)
    ready = prepare.find_or_prepare(config, tokenizer)  # the run's own prepared set: no tokenising
    assert ready.reused
    held_out = ready.rows("eval")
    rows = {key: [held_out[i][key].tolist() for i in range(len(held_out))] for key in held_out[0]}
    model = AutoModelForCausalLM.from_pretrained(output, torch_dtype=torch.float32).eval()
    sums, counts = [], []
    with torch.no_grad():
        for batch in ({k: v[:8] for k, v in rows.items()}, {k: v[8:] for k, v in rows.items()}):
            labels = torch.tensor(batch["labels"])
            logits = model(
                input_ids=torch.tensor(batch["input_ids"]),
                attention_mask=torch.tensor(batch["attention_mask"]),
            ).logits
            targets = labels[:, 1:]
            sums.append(
                torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
                ).item()
            )
            counts.append(int((targets != -100).sum()))
    assert sum(counts) == record["eval_set"]["loss_tokens"]
    token_mean = sum(sums) / sum(counts)
    mean_of_batch_means = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    assert abs(mean_of_batch_means - token_mean) > 1e-3 * token_mean  # the two differ here
    assert record["eval_losses"]["8"] == pytest.approx(token_mean, rel=1e-4), (
        token_mean,
        mean_of_batch_means,
    )
