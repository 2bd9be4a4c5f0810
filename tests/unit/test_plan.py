"""`tpuft plan`: parameter counts, the memory estimate's arithmetic, config discovery, the CLI."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from tpuft_operator import plan as planning
from tpuft_operator.api.validation import parse
from tpuft_operator.plan_cli import find_config
from tpuft_operator.plan_cli import plan as plan_command
from tpuft_trainer.prepare_contract import ModelFigures

ROOT = Path(__file__).resolve().parents[2]

FT: dict[str, Any] = {
    "apiVersion": "tpuft.dev/v1alpha1",
    "kind": "TPUFineTune",
    "metadata": {"name": "p"},
    "spec": {
        "model": {"name": "meta-llama/Llama-3.1-8B"},
        "dataset": {"name": "tatsu-lab/alpaca"},
        "tpu": {"type": "v5p", "topology": "2x2x4"},
        "training": {"maxSteps": 10, "perDeviceBatchSize": 4, "maxSeqLength": 1024},
        "output": {"uri": "gs://bucket/out"},
    },
}


def ft(**spec_changes: Any) -> Any:
    obj = copy.deepcopy(FT)
    for key, value in spec_changes.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return parse(obj)


# Published parameter counts (model cards), to check the architecture arithmetic.
@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("meta-llama/Llama-3.1-8B", 8.03),
        ("meta-llama/Llama-3.1-70B", 70.6),
        ("meta-llama/Llama-3.2-1B", 1.24),
        ("google/gemma-2-2b", 2.61),
        ("google/gemma-2-9b", 9.24),
        ("Qwen/Qwen2.5-7B", 7.61),
        ("mistralai/Mistral-7B-v0.1", 7.24),
        ("meta-llama/Llama-2-7b-hf", 6.74),
        ("meta-llama/Llama-2-13b-hf", 13.0),
        ("meta-llama/Llama-2-70b-hf", 69.0),
        ("meta-llama/Meta-Llama-3-8B", 8.03),
        ("meta-llama/Llama-3.1-405B", 405.9),
        ("google/gemma-2b", 2.51),
        ("google/gemma-7b", 8.54),
        ("google/gemma-2-27b", 27.2),
        ("google/gemma-3-1b-pt", 1.0),
        ("google/gemma-3-4b-pt", 3.88),  # the language model of the 4.3B multimodal model
        ("google/gemma-3-27b-pt", 27.0),
        ("mistralai/Mixtral-8x7B-v0.1", 46.7),
        ("mistralai/Mixtral-8x22B-v0.1", 140.6),
        ("Qwen/Qwen2-72B", 72.7),
        ("Qwen/Qwen2.5-3B", 3.09),
        ("Qwen/Qwen2.5-14B", 14.7),
        ("Qwen/Qwen2.5-32B", 32.5),
        ("Qwen/Qwen3-0.6B", 0.6),
        ("Qwen/Qwen3-8B", 8.19),
        ("Qwen/Qwen3-32B", 32.8),
        ("microsoft/Phi-3-mini-4k-instruct", 3.82),
        ("microsoft/Phi-3-medium-4k-instruct", 14.0),
    ],
)
def test_known_model_sizes(model: str, billions: float) -> None:
    assert planning.KNOWN_MODELS[model].params / 1e9 == pytest.approx(billions, rel=0.02)


def test_every_family_the_trainer_supports_is_in_the_table() -> None:
    families = {model_id.split("/")[1].split("-")[0].lower() for model_id in planning.KNOWN_MODELS}
    assert {"llama", "meta", "gemma", "mistral", "mixtral", "qwen2", "qwen2.5", "qwen3", "phi"} <= families


def test_mixture_of_experts_flops_count_the_experts_a_token_runs() -> None:
    mixtral = planning.KNOWN_MODELS["mistralai/Mixtral-8x7B-v0.1"]
    # ~12.9B weights take part per token (two of eight experts), of 46.7B
    assert mixtral.active_matmul_params / 1e9 == pytest.approx(12.9, rel=0.02)
    dense = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    assert dense.flops_per_token(1024) == 6 * (dense.params - 128256 * 4096) + 12 * 32 * 4096 * 1024


def test_plan_shows_the_global_batch_with_accumulation_and_the_step_compute() -> None:
    run = ft(
        training={
            "maxSteps": 10,
            "perDeviceBatchSize": 4,
            "maxSeqLength": 1024,
            "gradientAccumulationSteps": 2,
        }
    )
    result = planning.plan(run, planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"])
    assert result.global_batch == 4 * 16 * 2  # 2x2x4 = 16 chips
    text = planning.format_plan(result, run)
    assert "4 per chip x 16 chips x 2 accumulated = 128 sequences of 1024" in text
    assert "459 TFLOP/s bf16" in text and "40% MFU" in text
    assert result.flops_per_step == pytest.approx(result.flops_per_token * 128 * 1024)


def test_dims_from_a_llama_config_match_the_table() -> None:
    config = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    assert (
        planning.dims_from_config(config, "x").params
        == planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"].params
    )


def test_dims_from_reported_figures_take_the_counted_parameters_over_the_computed() -> None:
    """The prepare Job's figures: the architecture from config.json, the parameters counted from the
    weight files' headers when it could (a model whose layers are not Llama-style counts right)."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336}
    config |= {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    figures = ModelFigures.from_config(config)
    computed = planning.dims_from_figures(figures, "x")
    assert computed.params == planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"].params
    counted = planning.dims_from_figures(replace(figures, params=8_100_000_000), "x")
    assert counted.params == 8_100_000_000 and counted.num_layers == 32 and counted.kv_width == 1024
    with pytest.raises(ValueError, match="config x: no hidden_size or n_embd"):
        planning.dims_from_config({"d_model": 512}, "config x")


def test_a_host_the_operator_refuses_only_after_preparing_says_so_in_the_plan() -> None:
    spec = _unchecked(
        model={"name": "org/private-70b", "dtype": "float32"},  # not in the catalog
        tpu={"type": "v5e", "topology": "4x4"},
        training={"optimizer": "adamw"},
    )
    text = planning.format_plan(planning.plan(spec, LLAMA_70B), spec)
    warning = next(line for line in text.splitlines() if line.startswith("WARNING: a host needs"))
    assert "the operator refuses this spec once its prepare Job has read the model" in warning
    assert "tpuft render" not in warning  # validation cannot read the model: it does not refuse


def test_dims_from_params_is_a_plausible_shape() -> None:
    guessed = planning.dims_from_params(8_000_000_000, "guess")
    assert guessed.params == 8_000_000_000
    assert 3584 <= guessed.hidden_size <= 5120 and 24 <= guessed.num_layers <= 48


def test_weights_shard_over_the_slice() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    small = planning.plan(ft(tpu={"topology": "2x2x2"}), model)
    large = planning.plan(ft(tpu={"topology": "2x2x4"}), model)
    assert small.lines[0].bytes == pytest.approx(2 * large.lines[0].bytes)
    assert large.mesh == (16, 1, 1, 1)


def test_lora_trains_few_weights_and_needs_less_memory() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    full = planning.plan(ft(training={"optimizer": "adamw"}), model)
    lora = planning.plan(ft(training={"method": "lora", "optimizer": "adamw", "lora": {"r": 16}}), model)
    # q_proj + v_proj at r=16: 16 x ((4096+4096) + (4096+1024)) x 32 layers
    assert lora.trainable_params == 16 * (8192 + 5120) * 32
    assert lora.total_bytes < full.total_bytes
    assert lora.lines[0].bytes == full.lines[0].bytes  # the frozen base is still there


def test_gradient_checkpointing_lowers_activations() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    on = planning.plan(ft(), model)
    off = planning.plan(ft(fsdp={"gradientCheckpointing": False}), model)
    assert off.lines[3].bytes > 5 * on.lines[3].bytes


def test_adamw_state_is_twice_the_weights() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    p = planning.plan(ft(training={"optimizer": "adamw"}), model)
    assert p.lines[2].bytes == pytest.approx(2 * p.lines[0].bytes)


def test_70b_full_on_one_v5e_host_does_not_fit() -> None:
    p = planning.plan(
        ft(model={"name": "meta-llama/Llama-3.1-70B"}, tpu={"type": "v5e", "topology": "2x2"}),
        planning.KNOWN_MODELS["meta-llama/Llama-3.1-70B"],
    )
    assert not p.fits
    text = planning.format_plan(p, ft(tpu={"type": "v5e", "topology": "2x2"}))
    assert "DOES NOT FIT" in text and "use training.method: lora" in text


def _llama_8k(**training: Any) -> Any:
    """Llama 3.1 8B at 8192 tokens on v6e-8, as MaxText's recipe runs it (with a flash kernel there)."""
    return ft(
        tpu={"type": "v6e", "topology": "2x4"},
        training={"perDeviceBatchSize": 4, "maxSeqLength": 8192, "optimizer": "adamw", **training},
    )


def _warning(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("WARNING: the estimate"))


def test_attention_scores_are_heads_x_seq_squared_per_sequence() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    p = planning.plan(_llama_8k(), model)
    assert p.line_bytes("attention") == 4 * 2 * 32 * 8192 * 8192 * 2  # one layer recomputed: 32 GiB
    twice = planning.plan(_llama_8k(maxSeqLength=16384), model)
    assert twice.line_bytes("attention") == pytest.approx(4 * p.line_bytes("attention"))
    assert twice.line_bytes("activations") == pytest.approx(2 * p.line_bytes("activations"))
    off = planning.plan(
        ft(tpu={"type": "v6e", "topology": "2x4"}, fsdp={"gradientCheckpointing": False}), model
    )
    on = planning.plan(ft(tpu={"type": "v6e", "topology": "2x4"}), model)
    assert off.line_bytes("attention") == pytest.approx(32 * on.line_bytes("attention"))  # every layer's


def test_long_sequences_say_activations_dominate_and_suggest_what_shrinks_them() -> None:
    spec = _llama_8k()
    p = planning.plan(spec, planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"])
    assert not p.fits and p.activations_dominate
    warning = _warning(planning.format_plan(p, spec))
    assert "Activations dominate" in warning and "attention 32.00" in warning
    advice = warning.split("Try: ")[1]
    assert "training.perDeviceBatchSize: 1 with training.gradientAccumulationSteps: 4" in advice
    assert "a shorter training.maxSeqLength" in advice
    # The weights' levers cannot fix it: they are named as such, not offered.
    for lever in ("training.method: lora", "training.optimizer: adafactor", "larger topology"):
        assert lever not in advice
    # Already one sequence per chip, without checkpointing: checkpointing first, no batch advice.
    off = ft(
        tpu={"type": "v6e", "topology": "2x4"},
        training={"perDeviceBatchSize": 1, "maxSeqLength": 8192},
        fsdp={"gradientCheckpointing": False},
    )
    p = planning.plan(off, planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"])
    advice = _warning(planning.format_plan(p, off)).split("Try: ")[1]
    assert (
        advice.startswith("turn on fsdp.gradientCheckpointing") and "perDeviceBatchSize: 1 with" not in advice
    )


def test_when_the_weights_dominate_the_advice_stays_lora_adafactor_topology() -> None:
    spec = ft(model={"name": "meta-llama/Llama-3.1-70B"}, tpu={"type": "v5e", "topology": "2x2"})
    p = planning.plan(spec, planning.KNOWN_MODELS["meta-llama/Llama-3.1-70B"])
    assert not p.activations_dominate
    warning = _warning(planning.format_plan(p, spec))
    assert "Activations dominate" not in warning and "use training.method: lora" in warning


GEMMA_2B = planning.KNOWN_MODELS["google/gemma-2b"]
# One gemma-2b decoder layer: q and o (8 heads of 256), k and v (1 head), the gated MLP, two norms.
GEMMA_2B_LAYER = 2048 * 8 * 256 * 2 + 2048 * 256 * 2 + 3 * 2048 * 16384 + 2 * 2048


def _gemma_v5e_8(**training: Any) -> Any:
    """gemma-2b full fine-tune on v5e-8 (optimum-tpu's tutorial shape), 7 x 1024 tokens per chip."""
    return ft(
        model={"name": "google/gemma-2b"},
        tpu={"type": "v5e", "topology": "2x4"},
        training={"perDeviceBatchSize": 7, "maxSeqLength": 1024, **training},
    )


def test_fsdp_gathers_a_whole_layer_and_the_lm_head_on_every_chip() -> None:
    assert GEMMA_2B.layer_params == GEMMA_2B_LAYER
    p = planning.plan(_gemma_v5e_8(), GEMMA_2B)
    head = 256000 * 2048 * 2  # the tied embedding / LM head in bfloat16: ~1 GiB
    assert p.line_bytes("gathered") == (2 * GEMMA_2B_LAYER * 2 + 2 * head)  # weights + gradients, whole
    # ~2.4 GiB more per chip: a run the estimate used to call a fit (83% of 16 GiB) no longer is one.
    assert p.total_bytes - p.line_bytes("gathered") < p.usable_bytes < p.total_bytes
    lora = planning.plan(_gemma_v5e_8(method="lora"), GEMMA_2B)
    adapters_per_layer = lora.trainable_params // 18
    assert lora.line_bytes("gathered") == (GEMMA_2B_LAYER + adapters_per_layer) * 2 + head  # frozen head


def test_the_tensor_axis_splits_a_gathered_layer_but_not_the_lm_head() -> None:
    one = planning.plan(_gemma_v5e_8(), GEMMA_2B)
    two = planning.plan(
        ft(
            model={"name": "google/gemma-2b"},
            tpu={"type": "v5e", "topology": "2x4"},
            training={"perDeviceBatchSize": 7, "maxSeqLength": 1024},
            fsdp={"mesh": {"tensor": 2}},
        ),
        GEMMA_2B,
    )
    head = 2 * 256000 * 2048 * 2
    assert two.line_bytes("gathered") - head == pytest.approx((one.line_bytes("gathered") - head) / 2)


def test_find_config_in_the_hugging_face_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "models--acme--tiny"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert find_config("acme/tiny", None) == repo / "snapshots" / "abc" / "config.json"
    assert find_config("acme/other", None) is None


def _run(tmp_path: Path, obj: dict[str, Any], *args: str) -> Any:
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(obj))
    return CliRunner().invoke(plan_command, ["-f", str(path), *args])


def test_cli_reads_a_local_config(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 128,
            }
        )
    )
    obj = copy.deepcopy(FT)
    obj["spec"]["model"] = {"name": str(model_dir), "dtype": "float32"}
    result = _run(tmp_path, obj)
    assert result.exit_code == 0, result.output
    assert "fits" in result.output and f"config {model_dir}/config.json" in result.output
    assert "mesh        fsdp=16 tensor=1 data=1" in result.output


def test_cli_unknown_model_needs_params_billions(tmp_path: Path) -> None:
    obj = copy.deepcopy(FT)
    obj["spec"]["model"] = {"name": "acme/unknown-model"}
    result = _run(tmp_path, obj)
    assert result.exit_code != 0 and "--params-billions" in result.output
    result = _run(tmp_path, obj, "--params-billions", "7")
    assert result.exit_code == 0 and "7.00 B parameters" in result.output


def test_cli_exit_code_when_it_does_not_fit(tmp_path: Path) -> None:
    obj = copy.deepcopy(FT)
    obj["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B"}
    obj["spec"]["tpu"] = {"type": "v5e", "topology": "2x2"}
    assert _run(tmp_path, obj).exit_code == 1


@pytest.mark.parametrize(
    "case, says",
    [
        ("missing file", "cannot read"),
        ("not yaml", "not valid YAML"),
        ("no finetune", "no TPUFineTune found"),
        ("unknown model", "--params-billions"),
        ("broken config", "cannot read"),
    ],
)
def test_cli_invalid_input_exits_2_not_the_does_not_fit_code(tmp_path: Path, case: str, says: str) -> None:
    path = tmp_path / "ft.yaml"
    obj = copy.deepcopy(FT)
    if case == "not yaml":
        path.write_text("spec: [unclosed\n")
    elif case == "no finetune":
        path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}))
    elif case == "unknown model":
        obj["spec"]["model"] = {"name": "acme/unknown-model"}
    elif case == "broken config":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        obj["spec"]["model"] = {"name": str(tmp_path / "model")}
    if case in ("unknown model", "broken config"):
        path.write_text(yaml.safe_dump(obj))
    result = CliRunner().invoke(plan_command, ["-f", str(path)])
    assert result.exit_code == 2 and says in result.output, (result.exit_code, result.output)
    assert "Traceback" not in result.output


def test_cli_invalid_spec_names_the_field(tmp_path: Path) -> None:
    obj = copy.deepcopy(FT)
    obj["spec"]["tpu"] = {"type": "v5e", "topology": "2x2x2"}
    result = _run(tmp_path, obj)
    assert result.exit_code == 2 and "spec.tpu.topology" in result.output


def test_cli_refuses_a_side_longer_than_any_slice_of_the_type(tmp_path: Path) -> None:
    obj = copy.deepcopy(FT)
    obj["spec"]["tpu"] = {"type": "v5p", "topology": "4x4x548"}  # 8768 chips: under the pod's 8960
    result = _run(tmp_path, obj)
    assert result.exit_code == 2, result.output
    assert "spec.tpu.topology: '4x4x548' has a side of 548 chips" in result.output
    assert "at most 256 chips a side" in result.output


def _dpo(method: str) -> Any:
    return ft(
        dataset={"format": "preference"},
        training={"objective": "dpo", "method": method, "optimizer": "adamw"},
    )


def test_full_dpo_counts_a_sharded_reference_copy_and_two_sequences_per_pair() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    sft = planning.plan(ft(training={"optimizer": "adamw"}), model)
    dpo = planning.plan(_dpo("full"), model)
    lines = {line.name: line.bytes for line in dpo.lines}
    assert lines["reference"] == pytest.approx(lines["parameters"])  # sharded like the policy
    sft_lines = {line.name: line.bytes for line in sft.lines}
    assert lines["activations"] == pytest.approx(2 * sft_lines["activations"])  # chosen + rejected
    assert dpo.global_batch == 2 * sft.global_batch
    assert dpo.flops_per_token > sft.flops_per_token  # + the reference's forward
    assert dpo.total_bytes > sft.total_bytes
    text = planning.format_plan(dpo, _dpo("full"))
    assert "reference" in text and "sharded like the weights" in text
    # The step line counts the slice's chips once: the pair doubles the sequences, not the chips.
    chips = f"x {sft.batch_chips} chips"
    assert chips in planning.format_plan(sft, ft()) and chips in text and "2 sequences each" in text
    assert f"= {dpo.global_batch} sequences" in text


def test_lora_dpo_has_no_reference_copy() -> None:
    model = planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    dpo = planning.plan(_dpo("lora"), model)
    assert "reference" not in {line.name for line in dpo.lines}
    assert any("adapter disabled" in note for note in dpo.notes)


# ---- host memory per host ------------------------------------------------------------------------
GIB = planning.GIB
LLAMA_70B = planning.KNOWN_MODELS["meta-llama/Llama-3.1-70B"]


def _70b(topology: str, **training: Any) -> Any:
    return ft(
        model={"name": "meta-llama/Llama-3.1-70B", "dtype": "float32"},
        tpu={"type": "v5e", "topology": topology},
        training={"optimizer": "adamw", **training},
    )


def _unchecked(**spec_changes: Any) -> Any:
    """Like `ft`, without the host-RAM rule (as `tpuft plan` parses)."""
    obj = copy.deepcopy(FT)
    for key, value in spec_changes.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return parse(obj, check_host_ram=False)


def test_the_checkpoint_is_the_saved_weights_and_the_optimizer_state() -> None:
    p = planning.plan(_70b("4x8"), LLAMA_70B)
    params = LLAMA_70B.params
    assert p.host.checkpoint_bytes == pytest.approx(params * 4 + 2 * params * 4)  # weights + adamw
    assert p.host.weights_bytes == pytest.approx(params * 4)
    adafactor = planning.plan(_70b("4x8", optimizer="adafactor"), LLAMA_70B)
    assert adafactor.host.checkpoint_bytes == pytest.approx(params * 4 + 2 * params / 8192 * 4)
    lora = planning.plan(_70b("4x8", method="lora"), LLAMA_70B)
    t = lora.trainable_params
    assert lora.host.checkpoint_bytes == pytest.approx(t * 4 + 2 * t * 4)  # the adapters only


def test_a_host_writes_the_distinct_shards_of_its_chips() -> None:
    p = planning.plan(_70b("4x8"), LLAMA_70B)  # 32 chips, 8 hosts of 4, fsdp=32
    assert p.host.per_host_bytes == pytest.approx(p.host.checkpoint_bytes / 32 * 4)
    assert p.host.save_bytes == p.host.per_host_bytes  # one save in flight: one staging copy
    # A data axis replicates: 8-way shards, each written once; a host's 4 chips hold 4 of them.
    data = planning.plan(
        _unchecked(tpu={"type": "v5e", "topology": "4x8"}, fsdp={"mesh": {"data": 4}}), LLAMA_70B
    )
    assert data.host.per_host_bytes == pytest.approx(data.host.checkpoint_bytes / 8 * 4)
    # Fewer shards than a host's chips: the host holds them all, whatever the replicas.
    replicated = planning.plan(
        _unchecked(tpu={"type": "v5e", "topology": "2x2"}, fsdp={"mesh": {"data": 4}}), LLAMA_70B
    )
    assert replicated.host.per_host_bytes == pytest.approx(replicated.host.checkpoint_bytes)
    # Slices replicate too: two slices write what one does.
    slices = planning.plan(_unchecked(tpu={"type": "v5e", "topology": "4x8", "slices": 2}), LLAMA_70B)
    assert slices.host.per_host_bytes == pytest.approx(
        planning.plan(_unchecked(tpu={"type": "v5e", "topology": "4x8"}), LLAMA_70B).host.per_host_bytes
    )


def test_peak_is_the_runtime_and_the_largest_of_load_save_and_export() -> None:
    p = planning.plan(_70b("4x8"), LLAMA_70B)
    host = p.host
    assert host.load_bytes == 128256 * 8192 * 4  # the embedding, whole, in float32
    assert host.export_bytes == GIB == planning.EXPORT_GROUP_BYTES
    assert host.runtime_bytes == planning.RUNTIME_HOST_GIB * GIB
    assert host.phase == "save"
    assert host.peak_bytes == pytest.approx(host.runtime_bytes + host.save_bytes)
    assert host.ram_bytes == 192 * GIB and host.machine_type == "ct5lp-hightpu-4t" and host.fits
    # A LoRA checkpoint is small: the load (the largest tensor) is the peak.
    lora = planning.plan(_70b("4x8", method="lora"), LLAMA_70B).host
    assert lora.phase == "load" and lora.peak_bytes == pytest.approx(lora.runtime_bytes + lora.load_bytes)


def test_the_plan_shows_host_ram_in_the_shape_and_a_host_memory_section() -> None:
    spec = ft()
    text = planning.format_plan(planning.plan(spec, planning.KNOWN_MODELS["meta-llama/Llama-3.1-8B"]), spec)
    assert "  host RAM    448 GiB per host (ct5p-hightpu-4t)" in text
    section = text.split("Host memory per host (estimate)\n")[1].split("\n\n")[0].splitlines()
    assert [line[2:14].strip() for line in section] == [
        "checkpoint", "per host", "save", "load", "export", "runtime", "peak"
    ]  # fmt: skip
    assert "/ 16 (fsdp x tensor) x 4 chips" in section[1]
    assert section[-1].endswith("of 448 GiB (ct5p-hightpu-4t): fits")


def test_a_host_that_cannot_hold_its_share_does_not_fit_and_says_what_helps() -> None:
    spec = _unchecked(
        model={"name": "meta-llama/Llama-3.1-70B", "dtype": "float32"},
        tpu={"type": "v5e", "topology": "4x4"},
        training={"optimizer": "adamw"},
    )
    p = planning.plan(spec, LLAMA_70B)
    expected = 12 * LLAMA_70B.params / 16 * 4 + planning.RUNTIME_HOST_GIB * GIB
    assert p.host.peak_bytes == pytest.approx(expected) and expected > 192 * GIB and not p.host.fits
    text = planning.format_plan(p, spec)
    peak = next(line for line in text.splitlines() if line.startswith("  peak"))
    assert f"{expected / GIB:.2f} GiB" in peak and "of 192 GiB (ct5lp-hightpu-4t): DOES NOT FIT" in peak
    warning = next(line for line in text.splitlines() if line.startswith("WARNING: a host needs"))
    assert "and the operator refuse this spec: spec.tpu.topology" in warning
    for lever in (
        "larger topology",
        "training.method: lora",
        "training.optimizer: adafactor",
        "model.dtype: bfloat16",
    ):
        assert lever in warning


def test_cli_exit_code_when_host_ram_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(tmp_path, FT).exit_code == 0
    monkeypatch.setattr(planning, "RUNTIME_HOST_GIB", 1000)  # HBM still fits; a host's RAM does not
    result = _run(tmp_path, FT)
    assert result.exit_code == 1, result.output
    assert "of 95 GiB: fits" in result.output
    assert "of 448 GiB (ct5p-hightpu-4t): DOES NOT FIT" in result.output


def test_cli_shows_a_spec_the_operator_refuses_for_host_ram_in_full(tmp_path: Path) -> None:
    obj = copy.deepcopy(FT)
    obj["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B", "dtype": "float32"}
    obj["spec"]["tpu"] = {"type": "v5e", "topology": "4x4"}
    obj["spec"]["training"]["optimizer"] = "adamw"
    result = _run(tmp_path, obj)
    assert result.exit_code == 1, result.output  # not 2: the estimate is the answer
    assert "Host memory per host (estimate)" in result.output
    assert "the operator refuse this spec" in result.output


# ---- a stop's save against the grace the pods really get ------------------------------------------
def _multislice(**training: Any) -> Any:
    doc = yaml.safe_load((ROOT / "examples" / "v6e-multislice.yaml").read_text())  # Qwen2.5-7B, Spot
    doc["spec"]["training"].update(training)
    return parse(doc)


def test_a_spot_reclaim_gives_15_seconds_whatever_the_grace_period_says() -> None:
    ft = _multislice()
    assert ft.spec.tpu.spot and ft.spec.termination_grace_period_seconds is None
    assert planning.stop_grace_seconds(ft.spec) == 15  # not the pods' 60
    assert (
        planning.stop_grace_seconds(
            ft.spec.model_copy(update={"tpu": ft.spec.tpu.model_copy(update={"spot": False})})
        )
        == 60
    )
    raised = ft.spec.tpu.model_copy(update={"spot_grace_period_seconds": 90})
    assert planning.stop_grace_seconds(ft.spec.model_copy(update={"tpu": raised})) == 60  # the pods' own cap
    assert planning.stop_grace_seconds(ft.spec.model_copy(update={"tpu": raised}), default=120) == 90


def test_a_grace_period_given_is_kept_as_given_and_only_a_missing_one_takes_the_default() -> None:
    """One reading of spec.terminationGracePeriodSeconds (pods_grace_seconds) for the pods and the
    trainer's stop: `spec.termination_grace_period_seconds or default` once turned a 0 into the
    default. The API forbids values below 10 today; the helper does not depend on that."""
    tpu = _multislice().spec.tpu.model_copy(update={"spot": False})
    spec = _multislice().spec.model_copy(update={"tpu": tpu})
    for given, expected in ((None, 45), (0, 0), (10, 10), (300, 300)):
        ruled = spec.model_copy(update={"termination_grace_period_seconds": given})
        assert planning.pods_grace_seconds(ruled, 45) == expected, given
        assert planning.stop_grace_seconds(ruled, 45) == expected, given


def test_plan_warns_when_a_spot_reclaims_save_cannot_fit_and_bounds_the_loss_with_save_steps() -> None:
    fits = _multislice()  # adafactor: ~3.6 GiB per host, ~10 s at the assumed bandwidth
    stop = planning.stop_save(planning.plan(fits, planning.KNOWN_MODELS[fits.spec.model.name]), fits.spec)
    assert stop.fits and stop.warning() is None and planning.spot_stop_warning(fits) is None
    heavy = _multislice(optimizer="adamw", saveSteps=2000)  # AdamW's two moments: ~10.6 GiB per host
    p = planning.plan(heavy, planning.KNOWN_MODELS[heavy.spec.model.name])
    stop = planning.stop_save(p, heavy.spec)
    assert stop.per_host_bytes / planning.GIB == pytest.approx(10.64, abs=0.01)
    assert stop.write_seconds == pytest.approx(stop.per_host_bytes / (400 * 1024**2))
    assert not stop.fits and stop.needed_seconds > 15
    warning = planning.spot_stop_warning(heavy)
    assert warning is not None and warning == stop.warning()
    assert warning.startswith("a Spot reclaim gives the pods 15 s")
    assert "10.6 GiB" in warning and "assumed 400 MiB/s" in warning
    bound = stop.bounding_save_steps
    assert bound * p.step_seconds == pytest.approx(600, rel=0.01)  # ~10 minutes of steps at risk
    assert "up to the 2000 steps" in warning and f"training.saveSteps: {bound}" in warning
    text = planning.format_plan(p, heavy)
    assert "A stop's save (estimate)" in text and "WARNING: a Spot reclaim gives the pods 15 s" in text
    # The same run on on-demand VMs gets its 60 s: the save fits.
    on_demand = heavy.model_copy(
        update={
            "spec": heavy.spec.model_copy(update={"tpu": heavy.spec.tpu.model_copy(update={"spot": False})})
        }
    )
    assert planning.stop_save(p, on_demand.spec).fits and planning.spot_stop_warning(on_demand) is None
