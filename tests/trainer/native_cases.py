"""Cases run in the native venv under torchrun (tests/trainer/test_native.py): ``meta_load`` builds the
model as the native loop does (meta device, fully_shard, a sliced load from safetensors) on every
process and compares its logits with ``from_pretrained``'s on rank 0; it also reports whether the
native entry point imported torch_xla (it must not: the native image has none)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def meta_load(model_dir: str, out: str) -> None:
    import importlib.util

    import tpuft_trainer.cli
    import tpuft_trainer.native.launcher
    import tpuft_trainer.native.loop  # noqa: F401  (what a worker imports)

    entry_point = {
        "torch_xla_installed": importlib.util.find_spec("torch_xla") is not None,
        "torch_xla_imported": "torch_xla" in sys.modules,
    }
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tpuft_trainer.config import TrainerConfig
    from tpuft_trainer.native import model as native_model
    from tpuft_trainer.native import runtime

    config = TrainerConfig.model_validate(
        {
            "backend": "native",
            "model": {"name": model_dir, "dtype": "float32"},
            "dataset": {"name": "unused"},
            "training": {"max_steps": 1},
            "output": {"uri": "/nonexistent"},
        }
    )
    rt = runtime.start(config.fsdp.mesh)
    built = native_model.build(config, rt, weights=True)
    from torch.distributed.tensor import DTensor

    # Before the forward: FSDP2 keeps the root's parameters gathered after one (for the backward).
    not_sharded = [n for n, p in built.model.named_parameters() if not isinstance(p, DTensor)]
    ids = (torch.arange(2 * 24).reshape(2, 24) * 7) % 120 + 4
    with torch.no_grad():
        sharded = built.model.eval()(input_ids=ids).logits
    if rt.is_rank_zero:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
        Path(out).write_text(
            json.dumps(
                {
                    "max_abs_diff": float((sharded - expected).abs().max()),
                    "sharded_load": built.sharded_load,
                    "wrapped_layers": built.wrapped_layers,
                    "not_sharded": not_sharded,
                    "world_size": rt.world_size,
                    "torch": torch.__version__,
                    **entry_point,
                }
            )
        )
    dist.barrier()
    runtime.finish()


if __name__ == "__main__":
    {"meta_load": meta_load}[sys.argv[1]](*sys.argv[2:])
