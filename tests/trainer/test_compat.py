"""Each workaround in compat is needed: without it the upstream error comes back. (With it, the other
trainer tests pass; so deleting a needed workaround fails them, and an upstream fix fails this file.)"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from spmd import Pool, run_case

from tpuft_trainer import compat

pytestmark = pytest.mark.trainer

SPMD_JOBS = {
    "compat@4": functools.partial(run_case, "compat_needed", 4),
    "late_spmd@2": functools.partial(run_case, "late_spmd", 2),
    "twice@2": functools.partial(run_case, "twice", 2),
}

EXPECTED = {
    # one replication graph per sharded tensor at every save (with the patch: none after the first)
    "gathers_compiled_once": "no error: compiles at the second copy=",
    "optimizer_before_scheduler": "AttributeError: 'NoneType' object has no attribute 'param_groups'",
    "reloadable_checkpoint": "no error: files=['pytorch_model.bin', 'training_args.bin'] prefixed_keys=",
    "shard_any_output": "ValueError: Something went wrong, the output of the model shouldn't be `None`",
    "batch_over_data_axes": "no error: partition_spec=('fsdp', None)",
    "mesh_wins": "no error: mesh={'fsdp': 4, 'tensor': 1}",
    # a device -> host copy in every forward of packed rows (with the patch: none, test_recipes.py)
    "packed_mask_on_device": "no error: host transfers in a packed forward=1",
    "xla_training_defaults": "RuntimeError: `fused=True` requires all the params to be floating point Tensors",
    "xla_training_defaults:sft": "AttributeError: module 'torch' has no attribute 'xla'",
    "xla_training_defaults:dpo": "AttributeError: module 'torch' has no attribute 'xla'",
    # trl's DPO metrics index by the completion mask: new graphs at later steps (with the patch: none)
    "dpo_metrics_fixed_shape": "no error: compiles after warm-up=",
    "dpo_lora_reference": "TypeError: 'NoneType' object is not callable",
}


def test_every_patch_is_covered() -> None:
    assert {patch.name for patch in compat.PATCHES} <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_breakage_still_present(pool: Pool, name: str) -> None:
    found: dict[str, Any] = pool.get("compat@4").result
    assert found[name].startswith(EXPECTED[name]), f"{name}: {found[name]}"
    if name in ("reloadable_checkpoint", "gathers_compiled_once", "dpo_metrics_fixed_shape"):
        assert int(found[name].rsplit("=", 1)[1]) > 0


def test_use_fsdp_v2_is_idempotent_and_applies_every_patch(pool: Pool) -> None:
    found = pool.get("twice@2").result
    assert found["spmd"] is True
    assert found["patches"] == [patch.name for patch in compat.PATCHES]


def test_use_fsdp_v2_after_xla_tensors_is_refused(pool: Pool) -> None:
    error = pool.get("late_spmd@2").result["error"]
    assert error is not None and error.startswith("TrainerError: use_fsdp_v2() must be called before"), error
