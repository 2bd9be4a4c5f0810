"""The native backend: torch-native FSDP2 + DTensor + torch.distributed.checkpoint, one process per chip
(TorchTPU's model on a slice; gloo on CPU). Small modules, one job each:

- ``launcher``: `tpuft train` on a pod re-runs itself under torch.distributed's elastic agent;
- ``runtime``: the process group, the device and the DeviceMesh;
- ``model``: the model on the meta device (with its LoRA adapter), tensor parallelism by transformers'
  plan, ``fully_shard`` per decoder layer, a sliced load;
- ``optimizer``: the optimizer and schedule exactly as the xla backend's Trainer builds them;
- ``batches``: which rows each process trains on at each step;
- ``checkpoints``: the xla backend's checkpoint layout, keys and small files;
- ``loop``: the run, top to bottom.

Nothing here imports torch_xla; torch is imported where it is used.
"""
