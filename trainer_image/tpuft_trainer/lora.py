"""LoRA, the same on both backends: peft's ``LoraConfig`` from a run's ``training.lora``, the adapter
added to the model, and the adapter's first weights drawn from the run's seed.

peft initialises an adapter (``lora_A`` kaiming-uniform as ``nn.Linear``, ``lora_B`` zeros: the model
starts as the base model) from torch's global generator in whatever state it happens to be; on a
model on the meta device (the native backend builds its model there, then shards it) it draws
nothing at all. So after ``get_peft_model`` the adapter's weights are drawn again here, by peft's own
``reset_lora_parameters``, on CPU, from a generator seeded with ``training.seed`` and in module order:
every process of either backend starts from the same whole adapter, whatever the number of processes
(the native backend copies each process's shards out of it), and the global generator is left as it
was. The whole adapter on CPU is small next to the base (rank x (in + out) per adapted projection).
"""

from __future__ import annotations

from typing import Any

from tpuft_trainer.config import LoraConfig as LoraSettings


def peft_lora_config(settings: LoraSettings | None) -> Any:
    """peft's LoraConfig for a run's ``training.lora`` (its defaults when unset)."""
    from peft import LoraConfig

    lora = settings or LoraSettings()
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )


def adapt(model: Any, settings: LoraSettings | None, seed: int) -> tuple[Any, dict[str, Any]]:
    """(the PeftModel around ``model``, its adapter's initial weights by parameter name, on CPU).

    On a materialised model the adapter's parameters hold those weights already; on a meta-device
    model they stay on meta (the caller fills them in once they are materialised and sharded)."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_lora_config(settings))
    return peft_model, initialise(peft_model, seed)


def initialise(peft_model: Any, seed: int) -> dict[str, Any]:
    """Every LoRA layer's adapter weights drawn again by peft's ``reset_lora_parameters`` on CPU from
    ``seed``, in module order; each layer's adapter modules end on the device they were on (meta
    stays meta). Returns the drawn weights by parameter name."""
    import torch
    from peft.tuners.lora import LoraLayer

    drawn: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):  # the global generator is restored afterwards
        torch.manual_seed(seed)
        for module_name, module in peft_model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            parts = {name: getattr(module, name) for name in module.adapter_layer_names}
            devices = {name: _device(part) for name, part in parts.items()}
            for part in parts.values():
                part.to_empty(device="cpu")
            for adapter in module.lora_A.keys() | module.lora_embedding_A.keys():
                init = peft_model.peft_config[adapter].init_lora_weights
                module.reset_lora_parameters(adapter, init)
            for name, part in parts.items():
                for param_name, param in part.named_parameters():
                    drawn[f"{module_name}.{name}.{param_name}"] = param.detach().clone()
                if devices[name] is not None:
                    part.to(devices[name])
    return drawn


def _device(module: Any) -> Any:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else None


def reference(peft_model: Any) -> Any:
    """A context in which ``peft_model`` is its base model (the adapter disabled): the frozen
    reference of DPO under LoRA, with no second copy of the weights (what trl does on xla)."""
    return peft_model.disable_adapter()
