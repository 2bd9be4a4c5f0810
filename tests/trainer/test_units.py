"""The pure parts of the training core: world, mesh plan, layer classes, progress, exit codes."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny
from click.testing import CliRunner
from transformers.training_args import OptimizerNames

from tpuft_trainer import cli, fsdp_v2, host_memory
from tpuft_trainer.cli import exit_code_for
from tpuft_trainer.config import MeshConfig, ProgressConfig, TrainerConfig, WorldConfig
from tpuft_trainer.errors import ConfigError, DataError, NotFoundError, StoppedAfterCheckpoint, WorldError
from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.mesh import plan_mesh
from tpuft_trainer.progress import Meter, Snapshot, StatusReporter, format_duration
from tpuft_trainer.world import check_one_feeder, check_runtime, detect_world

pytestmark = pytest.mark.trainer


# ---- world ----------------------------------------------------------------------------------------
def test_local_defaults() -> None:
    world = detect_world(WorldConfig(), {})
    assert (world.process_index, world.process_count, world.restart_attempt) == (0, 1, 0)


def test_gke_multislice_rank() -> None:
    env = {
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "a,b",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_NUM_SLICES": "2",
        "TPUFT_RESTART_ATTEMPT": "3",
    }
    world = detect_world(WorldConfig(slices=2, hosts_per_slice=2, chips_per_host=4), env)
    assert (world.process_index, world.process_count, world.expected_devices) == (3, 4, 16)
    assert world.restart_attempt == 3 and not world.is_rank_zero


def test_job_completion_index_and_slice_label_fallbacks() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "TPU_WORKER_HOSTNAMES": "a,b", "TPUFT_SLICE_INDEX": "0"}
    assert detect_world(WorldConfig(hosts_per_slice=2), env).process_index == 1


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        (WorldConfig(hosts_per_slice=2), {}, "independent cop"),
        (WorldConfig(hosts_per_slice=2), {"TPU_WORKER_HOSTNAMES": "a"}, "independent cop"),
        (WorldConfig(slices=2), {}, "DCN"),
        (WorldConfig(), {"TPU_WORKER_ID": "1"}, "outside"),
        (WorldConfig(), {"TPU_WORKER_ID": "x"}, "not an integer"),
    ],
)
def test_world_refuses_inconsistent_environment(
    config: WorldConfig, env: dict[str, str], message: str
) -> None:
    with pytest.raises(WorldError, match=message):
        detect_world(config, env)


def test_runtime_mismatch_fatal_on_tpu_only() -> None:
    world = detect_world(WorldConfig(chips_per_host=4), {})
    assert check_runtime(world, process_count=1, device_count=4, on_tpu=True) == []
    assert check_runtime(world, process_count=1, device_count=8, on_tpu=False)
    with pytest.raises(WorldError, match="8 devices"):
        check_runtime(world, process_count=1, device_count=8, on_tpu=True)


def test_the_trainer_must_see_one_feeding_process() -> None:
    check_one_feeder(world_size=1, process_index=0)
    with pytest.raises(WorldError, match="a world of 2 process"):
        check_one_feeder(world_size=2, process_index=0)
    with pytest.raises(WorldError, match="this one 1"):
        check_one_feeder(world_size=1, process_index=1)


def test_a_slow_stop_save_is_advised_as_the_stop_it_was_measured_against() -> None:
    from tpuft_trainer.stop import slow_save_advice

    off_spot = slow_save_advice(40.2, 60, spot=False)
    assert off_spot.startswith("the stop's save took 40.2 s, more than half the 60 s grace period")
    assert "raise spec.terminationGracePeriodSeconds" in off_spot
    on_spot = slow_save_advice(9.0, 15, spot=True)
    assert "more than half the 15 s a Spot reclaim gives the pods" in on_spot
    # On Spot a longer grace period changes nothing: the advice must not ask for one.
    assert "raise spec.terminationGracePeriodSeconds" not in on_spot
    assert "whatever spec.terminationGracePeriodSeconds says" in on_spot
    assert "a smaller training.saveSteps" in on_spot and "spec.tpu.spotGracePeriodSeconds only" in on_spot


# ---- mesh -----------------------------------------------------------------------------------------
def test_mesh_defaults_fsdp_to_the_rest() -> None:
    assert plan_mesh(MeshConfig(), 8).shape == (1, 1, 8, 1)
    assert plan_mesh(MeshConfig(tensor=2), 8).shape == (1, 1, 4, 2)
    shape = plan_mesh(MeshConfig(data=2, dcn_data=2), 16)
    assert shape.shape == (2, 2, 4, 1) and shape.batch_ways == 16


@pytest.mark.parametrize(
    "mesh", [MeshConfig(fsdp=3), MeshConfig(tensor=3), MeshConfig(dcn_data=3), MeshConfig(fsdp=2, tensor=1)]
)
def test_mesh_must_cover_the_devices(mesh: MeshConfig) -> None:
    with pytest.raises(ConfigError):
        plan_mesh(mesh, 4)


# ---- layer classes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "layer"),
    [
        ("llama", "LlamaDecoderLayer"),
        ("gemma", "GemmaDecoderLayer"),
        ("mistral", "MistralDecoderLayer"),
        ("qwen2", "Qwen2DecoderLayer"),
    ],
)
def test_layer_class_by_model_type(family: str, layer: str) -> None:
    assert fsdp_v2.resolve_layer_classes(tiny.model(family)) == [layer]


def test_every_known_layer_class_exists_in_transformers() -> None:
    for model_type, names in fsdp_v2.LAYER_CLASSES.items():
        module = importlib.import_module(
            f"transformers.models.{model_type.removesuffix('_text')}.modeling_{model_type.removesuffix('_text')}"
        )
        for name in names:
            assert hasattr(module, name), (model_type, name)


def test_peft_model_is_unwrapped() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny.model("llama"), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    )
    args = fsdp_v2.get_fsdp_training_args(model, gradient_checkpointing=False)
    assert args["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert args["fsdp_config"]["xla_fsdp_grad_ckpt"] is False


def test_override_and_unknown_class_lists_what_exists() -> None:
    model = tiny.model("llama")
    assert fsdp_v2.resolve_layer_classes(model, "LlamaMLP") == ["LlamaMLP"]
    with pytest.raises(ConfigError, match=r"NopeLayer.*\['LlamaDecoderLayer'\]"):
        fsdp_v2.get_fsdp_training_args(model, ["NopeLayer"])


def test_fallback_to_no_split_modules() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    assert fsdp_v2.resolve_layer_classes(model) == ["GPT2Block"]


def test_xla_defaults_fill_only_what_the_caller_left_out(tmp_path: Path) -> None:
    from transformers import TrainingArguments
    from trl import SFTConfig

    args = fsdp_v2.get_fsdp_training_args(tiny.model("llama"))
    assert sorted(args) == ["fsdp", "fsdp_config"]
    filled = TrainingArguments(output_dir=str(tmp_path), **args)
    assert (filled.optim, filled.dataloader_drop_last, filled.activation_checkpointing) == (
        "adafactor",
        True,
        False,
    )
    chosen = TrainingArguments(str(tmp_path), optim="adamw_torch", dataloader_drop_last=False, **args)
    assert (chosen.optim, chosen.dataloader_drop_last) == ("adamw_torch", False)
    sft = SFTConfig(output_dir=str(tmp_path), **args)  # trl's default would turn checkpointing on
    assert (sft.optim, sft.activation_checkpointing) == ("adafactor", False)
    # without FSDPv2 nothing changes
    assert TrainingArguments(output_dir=str(tmp_path)).optim.value == "adamw_torch_fused"


@pytest.mark.parametrize(
    ("chosen", "message"),
    [
        (
            {"optim": "adamw_torch_fused"},
            r"optim='adamw_torch_fused' cannot run under xla_fsdp_v2.*adafactor",
        ),
        ({"optim": OptimizerNames.ADAMW_TORCH_FUSED}, r"optim='adamw_torch_fused' cannot run"),
        ({"gradient_checkpointing": True}, r"gradient_checkpointing=True cannot run.*xla_fsdp_grad_ckpt"),
        ({"activation_checkpointing": True}, r"activation_checkpointing=True cannot run"),
    ],
)
def test_a_chosen_value_that_cannot_run_on_xla_is_refused(
    tmp_path: Path, chosen: dict[str, Any], message: str
) -> None:
    from transformers import TrainingArguments

    with pytest.raises(ConfigError, match=message):
        TrainingArguments(output_dir=str(tmp_path), **chosen, **fsdp_v2.get_fsdp_training_args(tiny.model()))


def test_get_fsdp_config_as_optimum_spells_it() -> None:
    config = fsdp_v2.get_fsdp_config("LlamaDecoderLayer")
    assert config == {
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "xla": True,
        "xla_fsdp_v2": True,
        "xla_fsdp_grad_ckpt": True,
    }
    assert fsdp_v2.get_fsdp_config(["A", "B"], "C")["transformer_layer_cls_to_wrap"] == ["A", "B", "C"]
    with pytest.raises(ConfigError, match="at least one"):
        fsdp_v2.get_fsdp_config()


# ---- progress -------------------------------------------------------------------------------------
class FakeApi:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail = fail

    def patch_namespaced_custom_object_status(self, **kwargs: Any) -> None:
        if self.fail:
            raise RuntimeError("403 Forbidden")
        self.calls.append(kwargs)


def reporter(api: FakeApi, interval: float, clock: list[float]) -> StatusReporter:
    r = StatusReporter(
        ProgressConfig(namespace="ns", name="run", min_interval_seconds=interval), clock=lambda: clock[0]
    )
    r._api = api
    return r


def test_status_patch_body_and_throttle() -> None:
    api, clock = FakeApi(), [0.0]
    r = reporter(api, 10, clock)
    snap = Snapshot(step=5, total_steps=20, loss=1.25, tokens_per_second=100.0, eta_seconds=30.4)
    r.report(snap)
    clock[0] = 5
    r.report(snap)  # throttled
    r.report(snap, final=True)  # the last one always goes out
    assert len(api.calls) == 2
    call = api.calls[0]
    assert (call["group"], call["version"], call["plural"], call["namespace"], call["name"]) == (
        "tpuft.dev",
        "v1alpha1",
        "tpufinetunes",
        "ns",
        "run",
    )
    assert call["_content_type"] == "application/merge-patch+json"
    progress = call["body"]["status"]["progress"]
    assert {
        k: progress[k] for k in ("step", "totalSteps", "loss", "etaSeconds", "tokensPerSecond", "summary")
    } == {
        "step": 5,
        "totalSteps": 20,
        "loss": 1.25,
        "etaSeconds": 30,
        "tokensPerSecond": 100.0,
        "summary": "5/20 (25%)",
    }


def test_eval_loss_reaches_the_status_and_the_log_line() -> None:
    snap = Snapshot(step=6, total_steps=8, loss=2.5, tokens_per_second=None, eta_seconds=None, eval_loss=2.25)
    assert snap.to_status()["evalLoss"] == 2.25 and "eval loss 2.2500" in snap.to_line()
    assert "evalLoss" not in Snapshot(6, 8, 2.5, None, None).to_status()
    assert "evalLoss" not in Snapshot(6, 8, 2.5, None, None, float("nan")).to_status()


def test_broken_channel_warns_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    api, clock = FakeApi(fail=True), [0.0]
    r = reporter(api, 0, clock)
    with caplog.at_level(logging.WARNING):
        for step in range(5):
            r.report(Snapshot(step, 5, 1.0, None, None))
    assert sum("not working" in m for m in caplog.messages) == 1 and r.sent == 0


def test_absent_channel_is_silent() -> None:
    r = StatusReporter(ProgressConfig())
    r.report(Snapshot(1, 2, None, None, None))
    assert not r.enabled and r._api is None


def test_meter_rates_ignore_compiling_saving_and_evaluating_steps() -> None:
    clock = [0.0]
    meter = Meter(total_steps=1000, tokens_per_step=100, clock=lambda: clock[0])
    assert meter.update(500, 5.0).eta_seconds is None  # the first step of a resumed run: nothing to time
    clock[0] = 60.0
    meter.update(501, 4.0)  # the second graph compiles: one step of 60 s
    clock[0] = 62.0
    snap = meter.update(505, 3.0)  # then 0.5 s a step
    assert snap.tokens_per_second == pytest.approx(200) and snap.eta_seconds == pytest.approx(495 * 0.5)
    clock[0] = 102.0
    meter.update(506, 3.0)  # a save
    for step in range(510, 530, 4):
        clock[0] += 2.0
        snap = meter.update(step, 3.0)
    assert snap.tokens_per_second == pytest.approx(200)  # a mean since the start would say ~70
    assert meter.update(526, 3.0).tokens_per_second == pytest.approx(200)  # a repeated report changes nothing
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"


# ---- host memory ----------------------------------------------------------------------------------
def test_each_part_of_a_run_reports_its_own_peak_memory() -> None:
    """tpuft-metrics.json's peak_rss: a part that peaked lower than an earlier one says so, instead
    of repeating the earlier peak (what VmHWM alone gives)."""
    host_memory.part_peak()  # the parts before this one
    block = b"x" * (256 << 20)  # every page written: resident
    del block
    host_memory.release()
    with_block = host_memory.part_peak()  # the part that held it for a moment
    without_block = host_memory.part_peak()  # a part that did not
    assert with_block - without_block > 200 << 20, (with_block, without_block)


# ---- exit codes and config ------------------------------------------------------------------------
def test_exit_codes() -> None:
    assert exit_code_for(ConfigError("x")) == ExitCode.CONFIG_ERROR
    assert exit_code_for(DataError("x")) == ExitCode.DATA_ERROR
    assert exit_code_for(NotFoundError("x")) == ExitCode.NOT_FOUND
    assert (
        exit_code_for(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")) == ExitCode.OUT_OF_MEMORY
    )
    assert exit_code_for(WorldError("x")) == 1
    assert exit_code_for(RuntimeError("connection reset")) == 1


@pytest.mark.parametrize(
    ("noted", "failed", "code"),
    [
        ({0: 0, 1: 0}, None, ExitCode.OK),
        ({0: 75, 1: 75}, None, ExitCode.STOPPED_AFTER_CHECKPOINT),  # every worker saved and stopped
        ({0: 75, 1: 64}, [(1, 64)], ExitCode.CONFIG_ERROR),  # a user error wins over a stop
        ({0: 0}, [(1, -9)], 128 + 9),  # a worker SIGKILLed before it noted a code: infrastructure
        ({0: 75}, [(1, -9)], 128 + 9),  # ... even while the other stopped cleanly
        ({0: 0}, None, 1),  # a worker gone without a note or a failure on record
    ],
)
def test_the_native_launcher_exits_with_the_workers_code(
    tmp_path: Path, noted: dict[int, int], failed: list[tuple[int, int]] | None, code: int
) -> None:
    """native/launcher.py: the pod's exit code carries the operator's failure split, from the codes
    the workers noted and the agent's record of the ones that died (exit code -N: killed by signal N)."""
    from types import SimpleNamespace

    from tpuft_trainer.native import launcher

    for rank, value in noted.items():
        (tmp_path / f"{rank}.code").write_text(str(value))
    failure = None
    if failed is not None:
        failure = SimpleNamespace(
            failures={rank: SimpleNamespace(exitcode=value, timestamp=rank) for rank, value in failed}
        )
    assert launcher._exit_code(tmp_path, 2, failure) == code


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (None, ExitCode.OK),
        (DataError("the dataset has no text field"), ExitCode.DATA_ERROR),
        (StoppedAfterCheckpoint("stopped after checkpoint-4"), ExitCode.STOPPED_AFTER_CHECKPOINT),
        (RuntimeError("connection reset"), 1),
    ],
)
def test_a_started_run_ends_with_its_code_and_without_the_interpreters_teardown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: BaseException | None, code: int
) -> None:
    """`tpuft train` leaves through os._exit once the run has started (cli.end: a native abort in
    torch_xla's teardown must not replace the exit code the operator reads)."""
    import tpuft_trainer.train

    def run(config: TrainerConfig) -> Any:
        if outcome is not None:
            raise outcome
        return type("Record", (), {"final_step": 3, "seconds": 1.0})()

    ended: list[int] = []

    def exit_now(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(tpuft_trainer.train, "run", run)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {name: m}\ndataset: {name: d.jsonl}\ntraining: {max_steps: 3}\noutput: {uri: /tmp/o}\n"
    )
    result = CliRunner().invoke(cli.train, ["--config", str(config)])
    assert ended == [code] and result.exit_code == code, result.output


@pytest.mark.parametrize(
    ("error", "code", "kind"),
    [
        (WorldError("this job has 2 hosts but MASTER_ADDR is unset"), 1, "infrastructure"),
        (ConfigError("bad mesh"), 64, "CONFIG_ERROR"),
    ],
)
def test_a_native_launch_that_fails_exits_with_its_code_and_says_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    code: int,
    kind: str,
) -> None:
    """The native launcher's own failures (before any worker): exit 1, a WorldError's, is no ExitCode
    member and once crashed the log call with a ValueError instead of saying why."""
    from tpuft_trainer.native import launcher

    def launch(config: TrainerConfig, config_path: Path, env: Any = None) -> int:
        raise error

    ended: list[int] = []

    def exit_now(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    for marker in (*launcher.WORKER_MARKERS, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(marker, raising=False)  # this process is the launcher, not a worker
    config = tmp_path / "config.yaml"
    config.write_text(
        "backend: native\nmodel: {name: m}\ndataset: {name: d.jsonl}\ntraining: {max_steps: 3}\n"
        "output: {uri: /tmp/o}\n"
    )
    result = CliRunner().invoke(cli.train, ["--config", str(config)])
    assert ended == [code] and result.exit_code == code, result.output
    assert f"launch failed ({kind}, exit {code}): {error}" in caplog.text


def test_config_round_trip_with_added_fields() -> None:
    text = """
model: {name: m}
dataset: {name: d.jsonl}
training: {max_steps: 3, method: lora, keep_checkpoints: 2, lora: {save_merged: true}}
output: {uri: gs://b/run}
"""
    config = TrainerConfig.from_yaml(text)
    assert TrainerConfig.from_yaml(config.to_yaml()) == config
    assert config.training.lora is not None and config.training.lora.save_merged
    assert config.progress.plural == "tpufinetunes"


# ---- data -----------------------------------------------------------------------------------------
def test_token_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpuft_trainer import data
    from tpuft_trainer.config import ModelSource

    monkeypatch.setenv("TPUFT_TEST_TOKEN", "hf_secret")
    assert data.token(ModelSource(name="org/model", token_env="TPUFT_TEST_TOKEN")) == "hf_secret"
    assert data.token(ModelSource(name="org/model")) is None


def test_local_sources_missing_or_malformed(tmp_path: Path) -> None:
    from tpuft_trainer import data
    from tpuft_trainer.config import DatasetSource, ModelSource

    with pytest.raises(NotFoundError):
        data.model_location(ModelSource(name=str(tmp_path / "absent")))
    with pytest.raises(NotFoundError):
        data.load_rows(DatasetSource(name=str(tmp_path / "absent.jsonl")))
    source = DatasetSource(name=str(tiny.write_jsonl(tmp_path / "d.jsonl", n=8)))
    with pytest.raises(DataError, match=r"has no 'body' field.*dataset.textField"):
        tiny.prepared_rows(
            source.model_copy(update={"text_field": "body"}), tiny.tokenizer(), 16, tmp_path / "o"
        )
    encoded = tiny.prepared_rows(source, tiny.tokenizer(), 16, tmp_path / "o")
    assert len(encoded) == 8 and {len(row["input_ids"]) for row in encoded} == {16}
    first = encoded[0]
    assert [lab for lab, m in zip(first["labels"], first["attention_mask"], strict=True) if not m] == [
        -100
    ] * (16 - sum(first["attention_mask"]))


def test_chat_rows_use_the_chat_template(tmp_path: Path) -> None:
    from tpuft_trainer.config import DatasetSource

    source = DatasetSource(name=str(tiny.write_jsonl(tmp_path / "c.jsonl", n=4, chat=True)), format="chat")
    encoded = tiny.prepared_rows(source, tiny.tokenizer(), 64, tmp_path / "o")
    text = "".join(tiny.tokenizer().convert_ids_to_tokens(encoded[0]["input_ids"]))
    assert text.startswith("<s>user: ")


# ---- output storage -------------------------------------------------------------------------------
def test_a_uri_output_gets_the_local_files_but_not_checkpoints_and_a_marker_last(tmp_path: Path) -> None:
    from tpuft_trainer import storage

    local = tmp_path / "local"
    (local / "checkpoint-4").mkdir(parents=True)  # written to the output directly, never uploaded
    (local / "checkpoint-4" / "trainer_state.json").write_text("4")
    (local / "config.json").write_text("{}")
    (local / "tensorboard").mkdir()
    (local / "tensorboard" / "events").write_text("e")
    uri = f"file://{tmp_path / 'remote'}"
    storage.upload(local, uri)
    remote = tmp_path / "remote"
    assert sorted(p.name for p in remote.iterdir()) == [storage.COMPLETE, "config.json", "tensorboard"]
    assert (remote / "tensorboard" / "events").read_text() == "e"
    assert storage.local_dir(uri) != storage.local_dir(uri + "-other")
    assert storage.local_dir(str(local)) == local


def test_the_request_file_is_found_next_to_the_config_wherever_the_volume_is_mounted(tmp_path: Path) -> None:
    config = tmp_path / "mounted" / "config.yaml"
    config.parent.mkdir()
    config.write_text(
        "model: {name: m}\ndataset: {name: d}\ntraining: {max_steps: 1}\noutput: {uri: /o}\n"
        "stop: {request_file: checkpoint-request}\n"
    )
    assert TrainerConfig.load(config).stop.request_file == str(tmp_path / "mounted" / "checkpoint-request")
    config.write_text(config.read_text().replace("checkpoint-request", "/abs/request"))
    assert TrainerConfig.load(config).stop.request_file == "/abs/request"


def test_dpo_rewards_reach_the_status_the_api_accepts_and_the_log_line() -> None:
    from types import SimpleNamespace

    from tpuft_operator.api.models import Progress
    from tpuft_trainer.progress import make_callback

    class Sink:
        def __init__(self) -> None:
            self.snapshots: list[Snapshot] = []

        def report(self, snapshot: Snapshot, *, final: bool = False) -> None:
            self.snapshots.append(snapshot)

    sink = Sink()
    callback = make_callback([sink], Meter(10, tokens_per_step=64), is_rank_zero=True)
    logs = {"loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.125}
    callback.on_log(None, SimpleNamespace(global_step=3), None, logs=logs)
    status = sink.snapshots[-1].to_status()
    assert (status["loss"], status["rewardAccuracy"], status["rewardMargin"]) == (0.61, 0.75, 0.125)
    Progress.model_validate(status)  # the fields the CRD's status.progress declares
    assert "reward accuracy 0.75 margin 0.1250" in sink.snapshots[-1].to_line()
    assert "rewardAccuracy" not in Snapshot(6, 8, 2.5, None, None).to_status()


def test_progress_advances_every_step_while_the_loss_is_read_every_logging_steps(tmp_path: Path) -> None:
    """training.logging_steps 3 of 8 steps, with the Trainer's own flow callback deciding when to log:
    the loss is read (logged) at steps 3, 6 and the last, 8; every step reports its step, throughput
    and ETA, with the last loss read in the status but not on a line of a step that read none."""
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    from tpuft_trainer.progress import make_callback

    class Sink:
        def __init__(self) -> None:
            self.snapshots: list[tuple[Snapshot, bool]] = []

        def report(self, snapshot: Snapshot, *, final: bool = False) -> None:
            self.snapshots.append((snapshot, final))

    clock = [0.0]
    sink, lines = Sink(), []
    logger = SimpleNamespace(info=lambda fmt, line: lines.append(line), warning=print)
    meter = Meter(8, tokens_per_step=64, clock=lambda: clock[0])
    callback = make_callback([sink], meter, is_rank_zero=True, logger=logger)  # type: ignore[arg-type]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, logging_steps=3, report_to=[])
    state, flow, read = TrainerState(max_steps=8, logging_steps=3), DefaultFlowCallback(), []
    for step in range(1, 9):
        clock[0] += 0.5
        state.global_step = step
        control = TrainerControl()
        flow.on_step_end(args, state, control)  # the Trainer's callbacks run in order, its own first
        callback.on_step_end(args, state, control)
        if control.should_log:  # the Trainer reads the loss (the mean since the last read) and logs it
            read.append(step)
            callback.on_log(args, state, control, logs={"loss": float(step)})
    callback.on_train_end(args, state, control)

    assert read == [3, 6, 8]
    assert [s.step for s, _ in sink.snapshots] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert [final for _, final in sink.snapshots] == [False] * 8 + [True]
    fifth = sink.snapshots[4][0]
    assert fifth.tokens_per_second == pytest.approx(128) and fifth.eta_seconds == pytest.approx(1.5)
    assert fifth.to_status()["loss"] == 3.0 and fifth.to_status()["summary"] == "5/8 (62%)"
    assert [s.loss for s, _ in sink.snapshots] == [None, None, 3.0, 3.0, 3.0, 6.0, 6.0, 8.0, 8.0]
    assert [("loss" in line) for line in lines] == [False, False, True, False, False, True, False, True, True]
    assert lines[4].startswith("step 5/8 | 128 tokens/s | ETA 0:02")


def test_dpo_and_preference_need_each_other_in_the_trainer_config() -> None:
    from pydantic import ValidationError

    base: dict[str, Any] = {
        "model": {"name": "m"},
        "dataset": {"name": "d"},
        "training": {"max_steps": 1},
        "output": {"uri": "/o"},
    }
    with pytest.raises(ValidationError, match=r"objective dpo needs dataset\.format preference"):
        TrainerConfig.model_validate({**base, "training": {"max_steps": 1, "objective": "dpo"}})
    with pytest.raises(ValidationError, match=r"format preference needs training\.objective dpo"):
        TrainerConfig.model_validate({**base, "dataset": {"name": "d", "format": "preference"}})
    with pytest.raises(ValidationError, match=r"training\.dpo is set but training\.objective is not dpo"):
        TrainerConfig.model_validate({**base, "training": {"max_steps": 1, "dpo": {"beta": 0.2}}})
    ok = TrainerConfig.model_validate(
        {
            **base,
            "dataset": {"name": "d", "format": "preference"},
            "training": {"max_steps": 1, "objective": "dpo"},
        }
    )
    assert ok.training.dpo_settings.beta == 0.1 and ok.training.dpo_settings.loss_type == "sigmoid"
    native = TrainerConfig.model_validate({**ok.model_dump(), "backend": "native"})  # no longer refused
    assert native.backend == "native" and native.training.objective == "dpo"


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_the_native_dpo_loss_is_trls(loss_type: str) -> None:
    """native/preference.py's loss and rewards against trl 1.16's own DPOTrainer._compute_loss (called on
    a stand-in trainer whose models return the given per-token log-probs), for every loss type the
    API offers, on completions of different lengths (ipo normalises by them; one with no prompt, whose
    first token is never scored but is counted)."""
    import types

    import torch
    from trl.trainer.dpo_trainer import DPOTrainer

    from tpuft_trainer.native import preference

    generator = torch.Generator().manual_seed(0)
    pairs, length, beta = 3, 9, 0.3
    completion = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row, (start, end) in enumerate([(0, 9), (3, 6), (1, 8), (4, 9), (2, 5), (3, 7)]):
        completion[row, start:end] = 1
    shifted = completion[:, 1:]

    def per_token() -> Any:
        return -torch.rand(2 * pairs, length - 1, generator=generator) * shifted

    policy, reference = per_token().requires_grad_(), per_token()

    def model_returning(log_probs: Any) -> Any:
        zeros = torch.zeros_like(shifted, dtype=torch.float32)
        out = types.SimpleNamespace(
            log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )
        return lambda **kwargs: out

    trained = torch.nn.Module()  # the policy trl checks (training mode, no checkpointing, not peft)
    trained.is_gradient_checkpointing = False
    identity = types.SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t)
    stand_in = types.SimpleNamespace(
        model=trained, accelerator=identity, aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=False, ref_model=model_returning(reference), args=types.SimpleNamespace(
            gradient_checkpointing_kwargs=None), f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False, _total_train_tokens=0, _tp_size=1,
        _metrics={"train": __import__("collections").defaultdict(list)},
    )  # fmt: skip
    ids = torch.zeros(2 * pairs, length, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
    trl_loss = DPOTrainer._compute_loss(stand_in, model_returning(policy), inputs, False)  # type: ignore[arg-type]

    settings = preference.Settings(beta, loss_type, length, 0)
    terms = preference.dpo_terms(policy.sum(1), reference.sum(1), completion, settings)
    assert float(terms.loss.mean()) == pytest.approx(float(trl_loss), abs=1e-6)
    metrics = stand_in._metrics["train"]
    assert float(terms.chosen_rewards.mean()) == pytest.approx(metrics["rewards/chosen"][0], abs=1e-6)
    assert float(terms.rejected_rewards.mean()) == pytest.approx(metrics["rewards/rejected"][0], abs=1e-6)
    accuracy = float((terms.chosen_rewards > terms.rejected_rewards).float().mean())
    assert accuracy == pytest.approx(metrics["rewards/accuracies"][0])
    # The gradient too: the policy's log-probs get trl's.
    (trl_grad,) = torch.autograd.grad(trl_loss, policy)
    (ours,) = torch.autograd.grad(terms.loss.mean(), policy)
    assert torch.allclose(ours, trl_grad, atol=1e-6)


def test_every_evaluation_pair_is_counted_once_over_any_number_of_processes() -> None:
    """native DPO evaluation: 20 pairs, global batches of 8 on 2 processes (4 each): 3 batches, the
    last one's 4 missing places filled with pair 0, not counted; every process runs 3 forwards."""
    from tpuft_trainer.native.preference import eval_rows

    for processes in (1, 2, 4):
        plans = [eval_rows(20, 8, rank, processes) for rank in range(processes)]
        assert {len(plan) for plan in plans} == {3}
        counted = sorted(i for plan in plans for batch in plan for i, counts in batch if counts)
        assert counted == list(range(20))
        assert all(len(batch) == 8 // processes for plan in plans for batch in plan)


def test_preference_fields_and_kinds_are_checked() -> None:
    from tpuft_trainer.config import DatasetSource
    from tpuft_trainer.data import preference

    source = DatasetSource(name="pairs", format="preference", chosen_field="good", rejected_field="bad")
    preference.check_fields(["prompt", "good", "bad", "extra"], source)
    with pytest.raises(DataError, match=r"has no 'good' field .*Set dataset\.chosenField"):
        preference.check_fields(["prompt", "chosen", "bad"], source)
    assert preference.kind_of({"prompt": ["q? "], "good": ["yes"], "bad": ["no"]}, source) == "text"
    message = [{"role": "assistant", "content": "yes"}]
    mixed = {"prompt": ["q? "], "good": [message], "bad": [message]}
    with pytest.raises(DataError, match="every prompt, chosen and rejected value must be a string"):
        preference.kind_of(mixed, source)
    same = DatasetSource(name="pairs", format="preference", chosen_field="prompt", rejected_field="bad")
    with pytest.raises(DataError, match="three different fields"):
        preference.check_fields(["prompt", "bad"], same)


# ---- TPU device files and the pod's user -----------------------------------------------------------
def test_a_non_root_user_that_cannot_open_the_tpu_devices_is_told_why_and_what_to_change(
    tmp_path: Path,
) -> None:
    from tpuft_trainer import device_access
    from tpuft_trainer.errors import PermissionDeniedError

    (tmp_path / "vfio").mkdir()
    for name in ("vfio/0", "vfio/vfio", "accel0"):
        (tmp_path / name).touch()
    (tmp_path / "null").touch()  # not a TPU device
    found = device_access.tpu_devices(tmp_path)
    assert [Path(d.path).relative_to(tmp_path).as_posix() for d in found] == ["accel0", "vfio/0", "vfio/vfio"]

    def device(path: str, uid: int, gid: int, mode: int) -> device_access.Device:
        return device_access.Device(path, uid, gid, mode)

    root_only = [device("/dev/vfio/0", 0, 0, 0o600), device("/dev/vfio/vfio", 0, 0, 0o666)]
    device_access.check_tpu_device_access(root_only, uid=0, gids=[0])  # root opens anything
    with pytest.raises(PermissionDeniedError) as refused:
        device_access.check_tpu_device_access(root_only, uid=1000, gids=[1000])
    message = str(refused.value)
    assert "/dev/vfio/0 (owner 0:0, mode 0600)" in message and "/dev/vfio/vfio" not in message
    assert "user 1000" in message and "trainerSecurity.restricted=false" in message
    assert refused.value.exit_code == ExitCode.PERMISSION_DENIED  # a setting: not restarted
    # The runtime handing ownership to the pod's user (device_ownership_from_security_context), or a
    # group the user is in, or a world-writable node: all open.
    device_access.check_tpu_device_access([device("/dev/vfio/0", 1000, 1000, 0o600)], uid=1000, gids=[1000])
    device_access.check_tpu_device_access([device("/dev/accel0", 0, 44, 0o660)], uid=1000, gids=[1000, 44])
    device_access.check_tpu_device_access([device("/dev/accel0", 0, 0, 0o666)], uid=1000, gids=[1000])
    with pytest.raises(PermissionDeniedError):  # read-only is not enough
        device_access.check_tpu_device_access([device("/dev/accel0", 0, 0, 0o644)], uid=1000, gids=[1000])
    device_access.check_tpu_device_access([], uid=1000, gids=[1000])  # a CPU host: nothing to check


# ---- evaluation sets of any size ------------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True])
def test_an_evaluation_set_is_filled_to_whole_batches_with_rows_that_carry_no_loss(
    packed: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tpuft_trainer import evaluation
    from tpuft_trainer.config import DatasetSource
    from tpuft_trainer.data import prepare
    from tpuft_trainer.data.packing import IGNORE

    def ready(held: int) -> Any:
        path = tiny.write_jsonl(tmp_path / "t.jsonl", n=20)
        source = DatasetSource(name=str(path), packing=packed, eval_fraction=held / 20)
        return prepare.find_or_prepare(tiny.trainer_config(source, tmp_path / "out", 64), tiny.tokenizer())

    small = ready(3)  # documents of ~60 tokens: one to a row, packed or not
    real = [small.rows("eval")[i] for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="tpuft_trainer.evaluation"):
        filled, batches = evaluation.full_batches(small, 4, name="tiny.jsonl")
    assert "fewer than one global batch (4)" in caplog.text  # a tiny set: said, not refused
    assert len(filled) == 4 and set(filled[0]) == set(real[0])
    assert all((filled[i][key] == real[i][key]).all() for i in range(3) for key in real[i])  # real rows first
    blank = filled[3]
    assert blank["labels"].tolist() == [IGNORE] * 64 and blank["input_ids"].tolist() == [0] * 64
    assert blank.get("attention_mask", np.ones(64)).tolist() == [1] * 64  # attends (zeros give NaN)
    loss_tokens = sum(int((row["labels"][1:] != IGNORE).sum()) for row in real)
    assert (batches.rows, batches.padding, batches.loss_tokens, batches.batches) == (3, 1, loss_tokens, 1)
    assert batches.items_per_batch == loss_tokens
    # Two batches, the second part-filled: each batch's sum over loss_tokens / 2 averages to the token mean.
    _, two = evaluation.full_batches(ready(6), 4, name="x")
    assert two.batches == 2 and two.padding == 2 and two.items_per_batch == two.loss_tokens / 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tpuft_trainer.evaluation"):
        same, none = evaluation.full_batches(ready(8), 4, name="x")
    assert len(same) == 8 and none.padding == 0 and not caplog.text  # whole batches: left alone
