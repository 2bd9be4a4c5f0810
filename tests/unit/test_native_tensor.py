"""The native backend's tensor axis, without processes: which part of the batch a rank reads (it must
agree with the xla backend's device order, mesh.py) and transformers' plan with its refusals
(native/model.py). The training itself is tests/trainer/test_native.py's tensor chain."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from tpuft_trainer.errors import ConfigError
from tpuft_trainer.mesh import MeshShape
from tpuft_trainer.native import model as native_model
from tpuft_trainer.native.runtime import Runtime


def runtime(rank: int, shape: MeshShape) -> Runtime:
    return Runtime(rank, shape.devices, 0, None, "gloo", shape, mesh=None)


@pytest.mark.parametrize(
    "shape",
    [MeshShape(1, 1, 2, 2), MeshShape(1, 2, 2, 2), MeshShape(2, 1, 2, 4), MeshShape(1, 1, 1, 4)],
    ids=str,
)
def test_a_rank_reads_the_batch_part_of_its_coordinates_in_the_xla_device_order(shape: MeshShape) -> None:
    """The xla backend's mesh is the devices in order, reshaped to (dcn, data, fsdp, tensor), and the
    batch is split over the first three: device r reads part ravel(dcn, data, fsdp). The ranks of a
    tensor group share theirs."""
    devices = np.arange(shape.devices).reshape(shape.shape)
    parts: dict[int, set[int]] = {}
    for coordinates in itertools.product(*(range(n) for n in shape.shape)):
        rank = int(devices[coordinates])
        expected = int(np.ravel_multi_index(coordinates[:3], shape.shape[:3]))
        rt = runtime(rank, shape)
        assert (rt.data_rank, rt.data_ways) == (expected, shape.batch_ways), (rank, coordinates)
        parts.setdefault(rt.data_rank, set()).add(rank)
    assert all(len(ranks) == shape.tensor for ranks in parts.values())


def meta_model(family: str = "llama", **sizes: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family,
        **{
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
            "head_dim": 16,
            **sizes,
        },
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_plan_is_transformers_own_one_entry_per_module() -> None:
    plan = native_model.tensor_plan(meta_model(), 2)
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "embedding_rowwise" and plan["lm_head"] == "colwise_gather_output"
    assert not any("*" in name for name in plan)


@pytest.mark.parametrize(
    ("tensor", "sizes"),
    [(3, {}), (4, {}), (2, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3})],
    ids=["heads-4-over-3", "kv-heads-2-over-4", "kv-heads-3-over-2"],
)
def test_heads_that_do_not_divide_by_tensor_are_refused_naming_them(
    tensor: int, sizes: dict[str, int]
) -> None:
    with pytest.raises(
        ConfigError, match=rf"fsdp.mesh.tensor={tensor} must divide the model's attention heads"
    ):
        native_model.tensor_plan(meta_model(**sizes), tensor)


def test_a_plan_with_styles_not_verified_here_is_refused() -> None:
    """Qwen3's per-head norms need a gradient all-reduce over tensor that nothing here has checked."""
    with pytest.raises(ConfigError, match="replicated_with_grad_allreduce") as raised:
        native_model.tensor_plan(meta_model("qwen3"), 2)
    assert "set tensor: 1 or backend: xla" in str(raised.value)
