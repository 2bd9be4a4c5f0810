"""What a checkpoint holds, as state dicts keyed by Hugging Face parameter names. Backend-neutral:
plain ``torch`` tensors, XLA tensors and DTensors alike.

- ``model``: every *trainable* parameter (all of them for a full fine-tune, the adapter for LoRA:
  frozen weights come back from the model source), under the name the unwrapped model gives it
  (FSDPv2's ``_orig_module.`` prefixes stripped), each tied weight once.
- ``optim``: the optimizer's tensors keyed ``<parameter name>.<state key>``, not by parameter index
  (so a checkpoint survives a change in parameter order, and int keys never meet a planner that
  turns them into strings: trap A in shared/facts/distributed-checkpoint.md).
- ``optimizer.json``: what is not a tensor (Adafactor's int ``step``, AdamW's hyperparameters in
  ``param_groups``), written beside the shards. On load the tensors are written in place into the
  optimizer's own (primed) state and these values are set back one by one: never through
  ``optimizer.load_state_dict``, which casts the state to each parameter's dtype (trap B: Adafactor's
  float32 factors became bfloat16).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_WRAPPER = re.compile(r"(^|\.)_orig_module\.")
# param_groups keys that are not hyperparameters: the parameters themselves and their names.
_GROUP_SKIP = frozenset({"params", "param_names"})


def hf_name(name: str) -> str:
    """The parameter name of the unwrapped model (SpmdFullyShardedDataParallel keeps the wrapped
    module as ``_orig_module``, at the root and around every wrapped decoder block)."""
    return _WRAPPER.sub(r"\1", name)


def parameter_names(model: Any) -> dict[int, str]:
    """id(parameter) -> its HF name; a parameter shared by two names (tied embeddings) keeps the first."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), hf_name(name))
    return names


def trainable_state(model: Any) -> dict[str, Any]:
    """The model's part of a checkpoint: its trainable parameters by HF name, each tensor once."""
    state: dict[str, Any] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            state[hf_name(name)] = param.detach()
    return state


def optimizer_state(optimizer: Any, names: Mapping[int, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, extras): the optimizer's tensor state keyed ``<name>.<key>``, and the rest as plain
    JSON-able values (per-parameter scalars and each group's hyperparameters, groups by parameter
    names)."""
    import torch

    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, state in optimizer.state.items():
        name = names[id(param)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = _plain(value)
    groups = [
        {
            "params": [names[id(p)] for p in group["params"]],
            **{k: _plain(v) for k, v in group.items() if k not in _GROUP_SKIP},
        }
        for group in optimizer.param_groups
    ]
    return tensors, {"scalars": scalars, "param_groups": groups}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_plain(v) for v in value]}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"optimizer state value {value!r} ({type(value).__name__}) is neither a tensor nor plain")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_unplain(v) for v in value["__tuple__"])
    return value


def dumps_extras(extras: Mapping[str, Any]) -> str:
    return json.dumps(extras, indent=1, sort_keys=True)


def restore_extras(optimizer: Any, names: Mapping[int, str], extras: Mapping[str, Any]) -> None:
    """Sets the non-tensor optimizer state and the groups' hyperparameters back (the tensors were
    loaded in place). A group whose parameters differ from the saved one's is an error: the
    optimizer was built for another model."""
    from tpuft_trainer.errors import ConfigError

    scalars = extras.get("scalars") or {}
    for param, state in optimizer.state.items():
        for key, value in (scalars.get(names[id(param)]) or {}).items():
            state[key] = _unplain(value)
    saved_groups = list(extras.get("param_groups") or [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ConfigError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this run's has "
            f"{len(optimizer.param_groups)}: it was saved by a run of another configuration"
        )
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        ours = [names[id(p)] for p in group["params"]]
        if ours != list(saved.get("params") or []):
            raise ConfigError(
                "the checkpoint's optimizer holds other parameters than this run's "
                f"({len(saved.get('params') or [])} vs {len(ours)}): it was saved by a run of another configuration"
            )
        for key, value in saved.items():
            if key not in _GROUP_SKIP:
                group[key] = _unplain(value)


def stateful_tensors(model_state: Mapping[str, Any], optim_tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The one dict DCP saves and loads: ``model.<name>`` and ``optim.<name>.<key>``."""
    return {"model": dict(model_state), "optim": dict(optim_tensors)}


def missing_optimizer_state(optimizer: Any) -> list[Any]:
    """Trainable parameters without optimizer state yet (before the first step, or never primed)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p not in optimizer.state]
