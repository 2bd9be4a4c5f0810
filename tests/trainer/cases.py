"""Configurations run in their own SPMD process: ``python cases.py CASE OUT.json``.

use_spmd() is process-global, so the tests start one process per configuration and read back a JSON of
observations; one process covers every assertion about its configuration.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import tiny
from spmd import finish_case

from tpuft_trainer import compat
from tpuft_trainer.fsdp_v2 import get_fsdp_training_args, use_fsdp_v2, use_mesh

STEPS = 6


def _observer(model: Any) -> tuple[Any, dict[str, Any]]:
    """A callback recording losses, XLA compilations per step, and forwards of one decoder MLP (run
    twice per step when the block is checkpointed: again in the backward pass)."""
    import torch_xla.debug.metrics as met
    from transformers import TrainerCallback

    seen: dict[str, Any] = {"losses": [], "compiles": [], "mlp_forwards": []}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    calls = [0]
    base.model.layers[0].mlp.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    class Observer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            data = met.metric_data("CompileTime")
            seen["compiles"].append(int(data[0]) if data else 0)
            seen["mlp_forwards"].append(calls[0])
            calls[0] = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                seen["losses"].append(float(logs["loss"]))

    return Observer(), seen


def _sharding(model: Any) -> dict[str, str]:
    import torch_xla

    return {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in model.named_parameters()}


def _train(
    family: str, *, ckpt: bool = True, steps: int = STEPS, sft: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Exactly the optimum-tpu usage, plus an observing callback."""
    from transformers import Trainer, TrainingArguments

    model = tiny.model(family)
    args = get_fsdp_training_args(model, gradient_checkpointing=ckpt)
    out = tempfile.mkdtemp()
    settings = dict(
        max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1, report_to=[]
    )
    observer, seen = _observer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sft:
            from trl import SFTConfig, SFTTrainer

            trainer: Any = SFTTrainer(
                model=model,
                args=SFTConfig(output_dir=out, **settings, **args),
                train_dataset=tiny.token_dataset(),
                processing_class=tiny.tokenizer(),
            )
        else:
            trainer = Trainer(
                model=model,
                args=TrainingArguments(output_dir=out, **settings, **args),
                train_dataset=tiny.token_dataset(),
            )
    seen["deprecations"] = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
        and "transformers" in w.filename + str(w.message)
    ]
    trainer.add_callback(observer)
    trainer.train()
    seen["sharding"] = _sharding(trainer.model)
    seen["fsdp_args"] = args
    seen["trainer_args"] = {
        "optim": trainer.args.optim.value,
        "dataloader_drop_last": trainer.args.dataloader_drop_last,
        "activation_checkpointing": trainer.args.activation_checkpointing,
    }
    return trainer, seen


def optimum_tutorial() -> dict[str, Any]:
    """optimum-tpu's Llama tuning tutorial, call for call (tokenised rows of their own length, padded per
    batch by the collator), on a tiny Llama; and its Gemma notebook's SFTConfig without optim or
    drop_last, where XLA's defaults fill in."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from tpuft_trainer import fsdp_v2

    tokenizer = tiny.tokenizer()
    model = tiny.model("llama")
    data = tiny.text_dataset().map(lambda samples: tokenizer(samples["text"]), batched=True)
    fsdp_training_args = fsdp_v2.get_fsdp_training_args(model)
    observer, seen = _observer(model)
    trainer = Trainer(
        model=model,
        train_dataset=data,
        args=TrainingArguments(
            per_device_train_batch_size=8,
            num_train_epochs=10,
            max_steps=4,
            output_dir=tempfile.mkdtemp(),
            optim="adafactor",
            logging_steps=1,
            dataloader_drop_last=True,  # Required by FSDP v2 and SPMD.
            **fsdp_training_args,
        ),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.add_callback(observer)
    trainer.train()
    seen["fsdp_args_keys"] = sorted(fsdp_training_args)
    seen["sharding"] = _sharding(trainer.model)

    model = tiny.model("gemma")
    sft_observer, sft_seen = _observer(model)
    sft = SFTTrainer(
        model=model,
        train_dataset=tiny.text_dataset(),
        args=SFTConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=8,
            max_steps=3,
            logging_steps=1,
            max_length=32,
            dataset_text_field="text",
            report_to=[],
            **fsdp_v2.get_fsdp_training_args(model),
        ),
        processing_class=tokenizer,
    )
    sft.add_callback(sft_observer)
    sft.train()
    sft_seen["trainer_args"] = {
        "optim": sft.args.optim.value,
        "dataloader_drop_last": sft.args.dataloader_drop_last,
        "activation_checkpointing": sft.args.activation_checkpointing,
    }
    return {"trainer": seen, "sft": sft_seen}


def stock_llama() -> dict[str, Any]:
    """4 devices: checkpointing on and off, reload exactness, SFTTrainer."""
    import torch
    from transformers import LlamaForCausalLM

    result: dict[str, Any] = {}
    trainer, result["ckpt_on"] = _train("llama", ckpt=True)
    save_dir = Path(tempfile.mkdtemp()) / "final"
    trainer.save_model(str(save_dir))
    gathered = compat.gather_state_dict(trainer.model)
    reloaded = LlamaForCausalLM.from_pretrained(save_dir).state_dict()
    result["reload"] = {
        "files": sorted(p.name for p in save_dir.iterdir()),
        "hidden_size": LlamaForCausalLM.from_pretrained(save_dir).config.hidden_size,
        "missing": sorted(set(gathered) - set(reloaded)),
        "unequal": sorted(k for k in gathered if k in reloaded and not torch.equal(gathered[k], reloaded[k])),
        "count": len(reloaded),
    }
    _, result["ckpt_off"] = _train("llama", ckpt=False)
    _, result["sft"] = _train("llama", sft=True, steps=3)
    return result


def llama_only() -> dict[str, Any]:
    return {"ckpt_on": _train("llama")[1]}


def families() -> dict[str, Any]:
    return {family: _train(family, steps=4)[1] for family in ("gemma", "mistral", "qwen2")}


def compat_needed() -> dict[str, Any]:
    """Each workaround removed in turn: the upstream error must come back (else the workaround is obsolete)."""
    import torch
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import transformers.trainer
    from transformers import Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from tpuft_trainer import mesh as mesh_module
    from tpuft_trainer.config import MeshConfig

    found: dict[str, Any] = {}

    def attempt(name: str, fn: Any, *, patch: str | None = None) -> None:
        patch = patch or name
        if patch in {p.name for p in compat.PATCHES}:
            compat.disable(patch)
        try:
            found[name] = f"no error: {fn()}"
        except Exception as error:
            found[name] = f"{type(error).__name__}: {error}"
        finally:
            compat.enable()

    def trainer(model: Any, steps: int = 1, sft: bool = False, **extra: Any) -> Any:
        args = {**get_fsdp_training_args(model), **extra}
        settings = dict(
            output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=8, report_to=[]
        )
        if sft:
            return SFTTrainer(
                model=model,
                args=SFTConfig(**settings, **args),
                train_dataset=tiny.token_dataset(),
                processing_class=tiny.tokenizer(),
            )
        return Trainer(
            model=model, args=TrainingArguments(**settings, **args), train_dataset=tiny.token_dataset()
        )

    attempt("optimizer_before_scheduler", lambda: trainer(tiny.model()).train())

    def second_optimizer_copy() -> str:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        def compiles() -> int:
            data = met.metric_data("CompileTime")
            return int(data[0]) if data else 0

        t = trainer(tiny.model())
        t.train()
        xm._maybe_convert_to_cpu(t.optimizer.state_dict())  # what xm.save does at every checkpoint
        before = compiles()
        xm._maybe_convert_to_cpu(t.optimizer.state_dict())
        return f"compiles at the second copy={compiles() - before}"

    attempt("gathers_compiled_once", second_optimizer_copy)

    def save_unpatched() -> str:
        t = trainer(tiny.model())
        t.train()
        out = Path(tempfile.mkdtemp())
        t.save_model(str(out))
        files = sorted(p.name for p in out.iterdir())
        keys: list[str] = []
        if "pytorch_model.bin" in files:
            keys = list(torch.load(out / "pytorch_model.bin", weights_only=True))
        if "model.safetensors" in files:
            from safetensors import safe_open

            with safe_open(out / "model.safetensors", "pt") as f:
                keys = list(f.keys())
        return f"files={files} prefixed_keys={sum('_orig_module.' in k for k in keys)}"

    attempt("reloadable_checkpoint", save_unpatched)
    attempt("shard_any_output", lambda: trainer(tiny.model(), sft=True).train())

    def batch_spec() -> str:
        shape = mesh_module.plan_mesh(MeshConfig(data=2, fsdp=2), 4)
        use_mesh(mesh_module.build_mesh(shape))
        loader = pl.MpDeviceLoader(torch.utils.data.DataLoader([torch.zeros(2)] * 4, batch_size=4), "xla")
        spec = transformers.trainer.tpu_spmd_dataloader(loader)._parallel_loader_kwargs["input_sharding"]
        use_mesh(None)
        return f"partition_spec={spec.partition_spec}"

    attempt("batch_over_data_axes", batch_spec)

    def mesh_after_init() -> str:
        shape = mesh_module.plan_mesh(MeshConfig(fsdp=2, tensor=2), 4)
        use_mesh(mesh_module.build_mesh(shape))
        trainer(tiny.model())
        current = mesh_module.current_mesh_shape()
        compat.set_mesh(None)
        return f"mesh={current}"

    attempt("mesh_wins", mesh_after_init)
    from recipe_cases import packing_forward_transfers

    attempt("packed_mask_on_device", packing_forward_transfers)
    xs.set_global_mesh(None)

    # Without XLA's training defaults, the optimum-style call trains with the Trainer's fused AdamW, and
    # SFTConfig turns the Trainer's own checkpointing on.
    def default_optimizer() -> str:
        t = trainer(tiny.model())
        t.train()
        return f"trained with {t.args.optim} ({type(t.optimizer).__name__})"

    def dpo_trainer(steps: int = 1, lora: bool = False, pairs: Any = None, **extra: Any) -> Any:
        from datasets import Dataset
        from peft import LoraConfig
        from trl import DPOConfig, DPOTrainer

        model = tiny.model()
        return DPOTrainer(
            model=model,
            ref_model=None if lora else tiny.model(),
            args=DPOConfig(
                output_dir=tempfile.mkdtemp(),
                max_steps=steps,
                per_device_train_batch_size=8,
                report_to=[],
                bf16=False,
                max_length=32,
                pad_to_multiple_of=32,
                remove_unused_columns=False,
                **get_fsdp_training_args(model),
                **extra,
            ),
            train_dataset=Dataset.from_list(tiny.preference_pairs()) if pairs is None else pairs,
            processing_class=tiny.tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
        )

    def dpo_compiles_after_warm_up() -> str:
        import torch_xla.debug.metrics as met
        from transformers import TrainerCallback

        counts: list[int] = []

        class Count(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                data = met.metric_data("CompileTime")
                counts.append(int(data[0]) if data else 0)

        # A constant learning rate: its first steps are those of the shorter run on prepared pairs.
        t = dpo_trainer(steps=8, logging_steps=1, lr_scheduler_type="constant")
        t.add_callback(Count())
        t.train()
        # trl tokenised the pairs itself here: the reference for the run on prepared pairs below.
        found["dpo_losses:trl"] = [h["loss"] for h in t.state.log_history if "loss" in h]
        return f"compiles after warm-up={counts[-1] - counts[3]}"

    def prepared_pairs() -> Any:
        """tiny's pairs prepared as `tpuft train` prepares them (data/preference.py)."""
        from tpuft_trainer.config import DatasetSource
        from tpuft_trainer.data import prepare

        root = Path(tempfile.mkdtemp())
        path = tiny.write_rows(root / "pairs.jsonl", tiny.preference_pairs())
        source = DatasetSource(name=str(path), format="preference")
        config = tiny.trainer_config(source, root / "out", 32, objective="dpo")
        return prepare.find_or_prepare(config, tiny.tokenizer()).pairs()

    def dpo_on_prepared_pairs() -> str:
        t = dpo_trainer(steps=3, pairs=prepared_pairs(), logging_steps=1, lr_scheduler_type="constant")
        t.train()
        found["dpo_losses:prepared"] = [h["loss"] for h in t.state.log_history if "loss" in h]
        return f"pairs={len(t.train_dataset)}"

    attempt("dpo_metrics_fixed_shape", dpo_compiles_after_warm_up)
    attempt("dpo_lora_reference", lambda: dpo_trainer(lora=True).train())
    attempt("dpo_pretokenised", dpo_on_prepared_pairs)
    attempt("dpo_pretokenised:patched", dpo_on_prepared_pairs, patch="(none: every patch applied)")
    attempt(
        "xla_training_defaults:dpo",
        lambda: dpo_trainer(optim="adafactor").train(),
        patch="xla_training_defaults",
    )
    attempt("xla_training_defaults", default_optimizer)
    attempt(
        "xla_training_defaults:sft",
        lambda: trainer(tiny.model(), sft=True, optim="adafactor").train(),
        patch="xla_training_defaults",
    )
    return found


def sharded_load() -> dict[str, Any]:
    """loading.load_model on a fsdp=2 x tensor=2 mesh, from a local directory and from the Hugging Face
    cache by hub id (offline), against from_pretrained on the CPU; and a directory without
    safetensors, which falls back to from_pretrained."""
    import torch
    import torch_xla
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from tpuft_trainer import loading
    from tpuft_trainer import mesh as mesh_module
    from tpuft_trainer.config import MeshConfig, ModelSource

    use_mesh(mesh_module.build_mesh(mesh_module.plan_mesh(MeshConfig(fsdp=2, tensor=2), 4)))
    root = Path(tempfile.mkdtemp())
    local = tiny.save_model_dir(root / "llama")
    reference = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32, use_cache=False)
    ids = torch.randint(0, tiny.VOCAB_SIZE, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits

    def check(name: str, location: str) -> dict[str, Any]:
        loaded = loading.load_model(ModelSource(name=name, dtype="float32"), location)
        model = loaded.model
        on_device = next(model.parameters()).device.type == "xla"
        with torch.no_grad():
            logits = model(input_ids=ids.to(torch_xla.device()) if on_device else ids).logits.cpu()
        rotary = model.model.rotary_emb.inv_freq.cpu()
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        return {
            "sharded": loaded.sharded,
            "why": loaded.why,
            "tensor_parallel_weights": loaded.tensor_parallel_weights,
            "max_logit_difference": float((logits - expected).abs().max()),
            "rotary_equal": bool(torch.equal(rotary, reference.model.rotary_emb.inv_freq)),
            "q_proj_spec": torch_xla._XLAC._get_xla_sharding_spec(q_proj) if on_device else "",
        }

    found = {"local": check(str(local), str(local))}
    # The hub: the same files in a Hugging Face cache, read offline by repo id.
    cache = root / "hub"
    revision = "0" * 40
    snapshot = cache / "models--tpuft-test--tiny-llama" / "snapshots" / revision
    shutil.copytree(local, snapshot)
    (cache / "models--tpuft-test--tiny-llama" / "refs").mkdir()
    (cache / "models--tpuft-test--tiny-llama" / "refs" / "main").write_text(revision)
    constants.HF_HUB_CACHE = str(cache)
    found["hub"] = check("tpuft-test/tiny-llama", "tpuft-test/tiny-llama")
    bin_only = root / "bin-only"  # weights in a pickle (older repositories): no slices to read
    bin_only.mkdir()
    reference.config.save_pretrained(bin_only)
    torch.save(reference.state_dict(), bin_only / "pytorch_model.bin")
    found["bin_only"] = check(str(bin_only), str(bin_only))
    return found


def late_spmd() -> dict[str, Any]:
    """use_fsdp_v2() after an XLA tensor exists is refused (torch_xla would silently replicate it)."""
    import torch
    import torch_xla  # noqa: F401  (registers the XLA device)

    torch.zeros(2, device="xla")
    try:
        use_fsdp_v2()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def twice() -> dict[str, Any]:
    import torch_xla.runtime as xr

    use_fsdp_v2()  # a second call is harmless
    return {"spmd": xr.is_spmd(), "patches": compat.applied()}


CASES = {
    f.__name__: f
    for f in (
        stock_llama,
        llama_only,
        families,
        compat_needed,
        late_spmd,
        twice,
        optimum_tutorial,
        sharded_load,
    )
}

if __name__ == "__main__":
    case, out_path = sys.argv[1], sys.argv[2]
    if case != "late_spmd":
        use_fsdp_v2()
    try:
        result = CASES[case]()
    except Exception:
        traceback.print_exc()
        raise
    finish_case(out_path, result)
