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
    # trl tokenises every dataset it is given: prepared pairs are taken for raw ones
    "dpo_pretokenised": "KeyError: 'chosen'",
}


def test_every_patch_is_covered() -> None:
    assert {patch.name for patch in compat.PATCHES} <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_breakage_still_present(pool: Pool, name: str) -> None:
    found: dict[str, Any] = pool.get("compat@4").result
    assert found[name].startswith(EXPECTED[name]), f"{name}: {found[name]}"
    if name in ("reloadable_checkpoint", "gathers_compiled_once", "dpo_metrics_fixed_shape"):
        assert int(found[name].rsplit("=", 1)[1]) > 0


def test_dpo_on_prepared_pairs_has_the_losses_of_trls_own_tokenisation(pool: Pool) -> None:
    """The same DPOTrainer, model, seed and pairs: tokenised by trl at start, or prepared by
    data.prepare and taken as they are (dpo_pretokenised). The same batches, so the same losses."""
    found: dict[str, Any] = pool.get("compat@4").result
    assert found["dpo_pretokenised:patched"] == "no error: pairs=64", found["dpo_pretokenised:patched"]
    theirs, ours = found["dpo_losses:trl"][:3], found["dpo_losses:prepared"]
    assert len(ours) == 3 and ours == pytest.approx(theirs, abs=1e-6), (theirs, ours)
    assert len(set(ours)) > 1  # the steps trained: the batches differ and the policy moved


def test_prepared_pairs_refuse_a_trl_they_were_not_checked_against(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from tpuft_trainer.errors import ConfigError

    compat.check_prepared_pairs_trl()  # the pinned one
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.17.0" if name == "trl" else "0")
    with pytest.raises(ConfigError, match=r"trl 1\.17\.0; tpuft prepares preference pairs as trl 1\.16"):
        compat.check_prepared_pairs_trl()


def test_use_fsdp_v2_is_idempotent_and_applies_every_patch(pool: Pool) -> None:
    found = pool.get("twice@2").result
    assert found["spmd"] is True
    assert found["patches"] == [patch.name for patch in compat.PATCHES]


def test_use_fsdp_v2_after_xla_tensors_is_refused(pool: Pool) -> None:
    error = pool.get("late_spmd@2").result["error"]
    assert error is not None and error.startswith("TrainerError: use_fsdp_v2() must be called before"), error
