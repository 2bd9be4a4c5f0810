"""Preference tuning (objective dpo) end to end with `tpuft train`: trl's DPOTrainer on the FSDPv2 mesh,
full (a frozen reference sharded like the policy) and LoRA (the base with the adapter disabled), on
made-up pairs and a tiny Llama. The full run's config is the operator's render of a TPUFineTune."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from runs import logged_losses, losses, materials, metrics, write_config
from spmd import Pool, Proc, run_train

from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.exit_codes import ExitCode

pytestmark = pytest.mark.trainer

STEPS, SAVE = 8, 4
TRAINING = {"max_steps": STEPS, "learning_rate": 0.002, "per_device_batch_size": 2, "max_seq_length": 32}
LN2 = math.log(2)


def rendered_config() -> tuple[Path, Path]:
    """The operator's render of a DPO TPUFineTune (v5e 2x2: one host, four chips, like 4 CPU devices),
    pointed at the tiny model and pairs, written where the pods would read it."""
    from tpuft_operator.render import render_run
    from tpuft_operator.render.jobset import config_of

    m = materials()
    out = Path(tempfile.mkdtemp(prefix="tpuft-dpo-rendered-"))
    run = render_run(
        {
            "apiVersion": "tpuft.dev/v1alpha1",
            "kind": "TPUFineTune",
            "metadata": {
                "name": "dpo",
                "namespace": "default",
                "uid": "00000000-0000-0000-0000-000000000016",
            },
            "spec": {
                "model": {"name": str(m["model"]), "dtype": "float32"},
                "dataset": {"name": str(m["pairs"]), "format": "preference"},
                "tpu": {"type": "v5e", "topology": "2x2"},
                "training": {
                    "objective": "dpo",
                    "maxSteps": STEPS,
                    "learningRate": TRAINING["learning_rate"],
                    "perDeviceBatchSize": TRAINING["per_device_batch_size"],
                    "maxSeqLength": TRAINING["max_seq_length"],
                    "saveSteps": SAVE,
                    "loggingSteps": 1,  # the tests compare every step's loss
                    "dpo": {"beta": 0.1},
                },
                "output": {"uri": str(out / "model")},
            },
        }
    )
    text = config_of(run.jobset)
    assert TrainerConfig.from_yaml(text) == run.trainer_config
    path = out / "config.yaml"
    path.write_text(text)
    return path, out / "model"


def full() -> tuple[Proc, Path, TrainerConfig]:
    config, output = rendered_config()
    return run_train(config), output, TrainerConfig.load(config)


def dpo_config(
    dataset: dict[str, Any] | None = None, fsdp: dict[str, Any] | None = None, **training: Any
) -> tuple[Path, Path]:
    return write_config(
        {
            "dataset": {"name": str(materials()["pairs"]), "format": "preference", **(dataset or {})},
            "training": {"objective": "dpo", "save_steps": SAVE, **TRAINING, **training},
            **({"fsdp": fsdp} if fsdp else {}),
        }
    )


def stop_and_resume_on_two_devices() -> tuple[Proc, Proc, Path]:
    """SIGTERM at step 3 (a checkpoint, then exit 75), then the next start resumes: both on 2 devices."""
    # 4 pairs per device: the global batch of 8 pairs the 4-device run has with 2
    config, output = dpo_config(per_device_batch_size=4)
    stopped = run_train(config, 2, TPUFT_FAULT_SIGTERM_AT_STEP="3", TPUFT_RESTART_ATTEMPT="0")
    resumed = run_train(config, 2, TPUFT_RESTART_ATTEMPT="1")
    return stopped, resumed, output


def lora_kill_and_resume() -> tuple[Proc, Proc, Path]:
    """LoRA on chat-message pairs, killed at step 6 (after checkpoint-4), then resumed."""
    config, output = write_config(
        {
            "dataset": {"name": str(materials()["chat_pairs"]), "format": "preference"},
            "training": {
                "objective": "dpo",
                "method": "lora",
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                "save_steps": SAVE,
                **TRAINING,
                "learning_rate": 0.01,
                "max_seq_length": 64,  # the chat template's turn markers lengthen every prompt
            },
        }
    )
    killed = run_train(config, TPUFT_FAULT_KILL_AT_STEP="6", TPUFT_RESTART_ATTEMPT="0")
    resumed = run_train(config, TPUFT_RESTART_ATTEMPT="1")
    return killed, resumed, output


def full_tensor_parallel() -> tuple[Proc, Path]:
    """Full DPO on a 2 x 2 mesh (fsdp x tensor): the frozen reference must be split like the policy."""
    config, output = dpo_config(fsdp={"mesh": {"fsdp": 2, "tensor": 2}}, max_steps=2)
    return run_train(config), output


def missing_field() -> Proc:
    config, _ = dpo_config({"rejected_field": "worse"}, max_steps=2)
    return run_train(config, 2)


SPMD_JOBS = {
    "dpo:full": full,
    "dpo:full-tensor-parallel": full_tensor_parallel,
    "dpo:stop-resume@2": stop_and_resume_on_two_devices,
    "dpo:lora-resume": lora_kill_and_resume,
    "dpo:missing-field": missing_field,
}


def test_rendered_config_is_a_dpo_run(pool: Pool) -> None:
    _, _, config = pool.get("dpo:full")
    assert config.training.objective == "dpo" and config.dataset.format == "preference"
    assert config.training.dpo is not None and config.training.dpo.beta == 0.1
    assert (config.dataset.prompt_field, config.dataset.chosen_field, config.dataset.rejected_field) == (
        "prompt",
        "chosen",
        "rejected",
    )


def test_full_dpo_starts_at_ln2_and_learns_the_preference(pool: Pool) -> None:
    proc, output, _ = pool.get("dpo:full")
    assert proc.returncode == 0, proc.tail()
    record = metrics(output)
    got = losses(record)
    assert sorted(got) == list(range(1, STEPS + 1))
    # The policy starts as the reference: every log-ratio is 0, the loss -log sigmoid(0) = ln 2.
    assert got[1] == pytest.approx(LN2, abs=1e-5)
    assert got[STEPS] < LN2 - 0.2, got
    margins = {int(k): v for k, v in record["reward_margins"].items()}
    accuracies = {int(k): v for k, v in record["reward_accuracies"].items()}
    assert margins[1] == pytest.approx(0.0, abs=1e-5)
    assert margins[STEPS] > margins[2] > 0, margins
    assert accuracies[STEPS] >= 0.75, accuracies


def test_full_dpo_reference_is_sharded_like_the_policy(pool: Pool) -> None:
    _, output, _ = pool.get("dpo:full")
    record = metrics(output)
    policy, reference = record["parameter_sharding"], record["reference_sharding"]
    assert reference and set(reference) == set(policy)
    assert reference == policy
    assert reference["_orig_module.lm_head.weight"] == "{devices=[4,1]0,1,2,3}"


def test_full_dpo_reference_is_split_over_the_tensor_axis_like_the_policy(pool: Pool) -> None:
    proc, output = pool.get("dpo:full-tensor-parallel")
    assert proc.returncode == 0, proc.tail()
    record = metrics(output)
    assert record["mesh_during_training"] == {"dcn": 1, "data": 1, "fsdp": 2, "tensor": 2}
    assert record["tensor_parallel_weights"] == 2 * 7  # q k v o gate up down, two layers
    policy, reference = record["parameter_sharding"], record["reference_sharding"]
    assert reference == policy
    split = [name for name, spec in reference.items() if name.endswith("_proj.weight") and "[2,2]" in spec]
    assert len(split) == 2 * 7, reference


def test_dpo_compiles_stay_flat_after_warm_up(pool: Pool) -> None:
    """One batch shape (prompt + completion padded to maxSeqLength) and no data-dependent shape in
    trl's metrics (compat.dpo_metrics_fixed_shape): no graph is compiled after the first steps and
    the first save."""
    _, output, _ = pool.get("dpo:full")
    record = metrics(output)
    compiles = {int(k): v for k, v in record["compiles_after_step"].items()}
    assert compiles[STEPS] == compiles[SAVE + 1], compiles
    assert record["tokens"] == STEPS * 2 * 8 * int(TRAINING["max_seq_length"])  # 8 pairs, two rows each


def test_two_devices_give_the_same_losses_and_sigterm_resumes(pool: Pool) -> None:
    _, reference_output, _ = pool.get("dpo:full")
    stopped, resumed, output = pool.get("dpo:stop-resume@2")
    assert stopped.returncode == ExitCode.STOPPED_AFTER_CHECKPOINT, stopped.tail()
    assert resumed.returncode == 0, resumed.tail()
    reference = losses(metrics(reference_output))
    before, after = logged_losses(stopped), losses(metrics(output))
    assert metrics(output)["resumed_from"] == "checkpoint-3"
    # The pairs were prepared once, by the first start (rank 0 published them); the restart read them
    # memory-mapped and trl took them as they are: nobody tokenised them again.
    assert "preference pairs prepared before, not tokenised again" in stopped.stderr
    assert "prepared now" in stopped.stderr and "Tokenizing train dataset" not in stopped.stderr
    assert metrics(output)["data"]["reused"] is True
    assert "prepared before, read memory-mapped" in resumed.stderr
    assert "preparing dataset" not in resumed.stderr and "Tokenizing" not in resumed.stderr
    assert sorted(after) == list(range(4, STEPS + 1))
    # 2 devices (the stopped and the resumed run) against 4 (the rendered run): the same losses.
    assert {s: before[s] for s in (1, 2, 3)} == pytest.approx({s: reference[s] for s in (1, 2, 3)}, abs=1e-4)
    assert after == pytest.approx({s: reference[s] for s in after}, abs=1e-4)


def test_lora_dpo_learns_and_resumes_from_the_trained_adapter(pool: Pool) -> None:
    killed, resumed, output = pool.get("dpo:lora-resume")
    assert killed.returncode == -9, killed.tail()
    assert resumed.returncode == 0, resumed.tail()
    record = metrics(output)
    assert record["resumed_from"] == "checkpoint-4"
    assert record["reference_sharding"] == {}  # no second copy: the adapter is disabled instead
    before, after = logged_losses(killed), losses(record)
    assert before[1] == pytest.approx(LN2, abs=1e-4)
    assert sorted(after) == [5, 6, 7, 8]
    # Step 5 runs again from checkpoint-4's adapter: the loss it had before the kill (a fresh adapter
    # would give ln 2 again). The kill comes at the end of step 6, before its loss is logged.
    assert sorted(before) == [1, 2, 3, 4, 5], before
    assert after[5] == pytest.approx(before[5], abs=1e-3)
    assert after[STEPS] < LN2 - 0.1, (before, after)
    margins = {int(k): v for k, v in record["reward_margins"].items()}
    assert margins[STEPS] > 0.1, margins
    assert (output / "adapter_model.safetensors").is_file()


def test_a_missing_preference_field_is_a_data_error_naming_it(pool: Pool) -> None:
    proc = pool.get("dpo:missing-field")
    assert proc.returncode == ExitCode.DATA_ERROR, proc.tail()
    assert "has no 'worse' field (format preference, the rejected)" in proc.stderr
    assert "Set dataset.rejectedField" in proc.stderr
