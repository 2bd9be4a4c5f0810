"""Sharded, asynchronous checkpoints in torch.distributed.checkpoint (DCP) format.

- ``layout``: the directory of a checkpoint, its completion marker, which one to resume from;
- ``state``: what a checkpoint holds, keyed by Hugging Face parameter names (backend-neutral);
- ``manager``: ``CheckpointManager``, the one owner of saving (staging, background writes, one in
  flight) and restoring;
- ``backend``: what the manager needs of a tensor runtime, and plain torch; ``xla``: PyTorch/XLA SPMD;
- ``hf_trainer``: the manager wired into a transformers Trainer through its own hooks.

Light at import: torch and torch_xla are imported where they are used.
"""
