"""tpuft: fine-tune LLMs on GKE TPU slices from a Kubernetes custom resource."""

__version__ = "0.1.0"
