"""The tpuft training core: PyTorch/XLA FSDPv2 (SPMD) fine-tuning that runs in every TPU pod.

Importing this package is cheap: torch and friends are imported only by the modules that need them.
"""

__version__ = "0.1.0"
