"""The pod contract: every name the operator and the trainer pods it renders agree on, in one place.

The operator's renderer writes these into the JobSet's pod template (render/jobset.py,
render/trainer_config.py); validation, the admin policy and the CRD's CEL rules keep a spec from
taking them over (api/validation.py, api/policy.py, api/cel.py); the trainer reads them (world.py,
train.py, stop.py, cli.py, data.py, config.py). Each name says who sets it and who reads it.

The standard library only: the trainer image ships tpuft_trainer alone, and the operator image
imports this without torch (tests/unit/test_no_torch.py imports it with every third-party package
blocked).
"""

from __future__ import annotations

from typing import Final

# ------------------------------------------------------------------ the trainer config in the pod

# Set by the renderer on the pod template (the trainer config, YAML); the kubelet shows it as CONFIG_FILE.
TRAINER_CONFIG_ANNOTATION: Final = "tpuft.dev/trainer-config"
# Set by the reconciler on running pods (maintenance.py: the announced time); the kubelet shows it as REQUEST_FILE.
CHECKPOINT_REQUEST_ANNOTATION: Final = "tpuft.dev/checkpoint-request"
# The downward-API volume the renderer adds for the two annotations; the trainer reads its files.
CONFIG_VOLUME: Final = "tpuft-config"
# Where the renderer mounts CONFIG_VOLUME (read-only); no spec volumeMount may go there.
CONFIG_DIR: Final = "/etc/tpuft"
# TRAINER_CONFIG_ANNOTATION's file in CONFIG_VOLUME (the renderer's downward-API item).
CONFIG_FILE: Final = "config.yaml"
# The renderer's `tpuft train --config` argument, and trainer_image/Dockerfile's CMD; read by cli.train.
CONFIG_PATH: Final = f"{CONFIG_DIR}/{CONFIG_FILE}"
# CHECKPOINT_REQUEST_ANNOTATION's file in CONFIG_VOLUME: the renderer writes it as the config's
# stop.request_file, relative to the config (TrainerConfig.load); read by stop.read_request.
REQUEST_FILE: Final = "checkpoint-request"

# -------------------------------------------------------------------------- environment variables

# Set by the renderer (downward API: the JobSet's job-index label); read by world.detect_world when
# MEGASCALE_SLICE_ID is absent, and by the native launcher (the two must agree there).
SLICE_INDEX_ENV: Final = "TPUFT_SLICE_INDEX"
# Set by the renderer (downward API: the JobSet's restart-attempt annotation); read by world.detect_world.
RESTART_ATTEMPT_ENV: Final = "TPUFT_RESTART_ATTEMPT"
# Set by the renderer (the first host's DNS name); read by train.run for the stop channel (stop.open_channel).
COORDINATOR_ADDRESS_ENV: Final = "TPUFT_COORDINATOR_ADDRESS"
# Set by the renderer (downward API: metadata.name); read by no tpuft code (logs, the user's tools).
POD_NAME_ENV: Final = "POD_NAME"
# Set by the renderer (downward API: metadata.namespace); read by no tpuft code (logs, the user's tools).
POD_NAMESPACE_ENV: Final = "POD_NAMESPACE"
# Set by the renderer from spec.model.tokenSecretRef (secretKeyRef) under RenderSettings.token_env,
# this name by default; read by data.token, by the name the trainer config's model.token_env gives.
DEFAULT_TOKEN_ENV: Final = "HF_TOKEN"

# Set by the Indexed Job controller; read by world.detect_world (host index fallback) and cli (log prefix).
JOB_COMPLETION_INDEX_ENV: Final = "JOB_COMPLETION_INDEX"
# Set by GKE's TPU webhook; read by world.detect_world (host index), cli (log prefix) and PJRT.
TPU_WORKER_ID_ENV: Final = "TPU_WORKER_ID"
# Set by GKE's TPU webhook; read by world.detect_world (every host of the slice listed) and PJRT.
TPU_WORKER_HOSTNAMES_ENV: Final = "TPU_WORKER_HOSTNAMES"
# Set by GKE on multislice pods, and by the renderer on native ones (NATIVE_MULTISLICE_ENV); read by
# world.detect_world (slice index) and PJRT.
MEGASCALE_SLICE_ID_ENV: Final = "MEGASCALE_SLICE_ID"
# Set by GKE on multislice pods, and by the renderer on native ones (NATIVE_MULTISLICE_ENV); read by
# world.detect_world (must equal the config's slices) and PJRT.
MEGASCALE_NUM_SLICES_ENV: Final = "MEGASCALE_NUM_SLICES"

# ------------------------------------------------ backend native: torch.distributed and TorchTPU
# Set by the renderer on the pods of a `backend: native` run only (render/native_env.py, which cites
# where torch-tpu 0.2.0 reads each); read by the trainer's native launcher, which starts one process
# per chip with torch.distributed's elastic agent, and by torch-tpu's set_tpu_launch_env, which never
# overwrites a variable already set and derives the rest (TORCH_TPU_SLICEBUILDER_ADDRESSES from GKE's
# TPU_WORKER_HOSTNAMES, one slice's hosts) before the workers start.
# Hosts of the run, every slice's (slices x hosts per slice): the launcher's nnodes.
NNODES_ENV: Final = "NNODES"
# This host's rank among them, slice-major (slice index x hosts per slice + host index). Never
# rendered: the downward API cannot multiply, so the launcher computes it from SLICE_INDEX_ENV and
# HOST_INDEX_ENV and sets it before set_tpu_launch_env (which would otherwise derive a rank within
# one slice); one set by hand must agree.
NODE_RANK_ENV: Final = "NODE_RANK"
# Set by the renderer (downward API: the pod's completion index, its place in TPU_WORKER_HOSTNAMES);
# read by the native launcher: this host's index within its slice.
HOST_INDEX_ENV: Final = "TPUFT_HOST_INDEX"
# The first pod of the first slice's stable hostname, and the port of the rendezvous store of
# torch.distributed there.
MASTER_ADDR_ENV: Final = "MASTER_ADDR"
MASTER_PORT_ENV: Final = "MASTER_PORT"
# Not torch's 29500: the trainer's stop channel (stop.py, StopConfig.coordination_port) listens there
# on the first host. 29400 is torchrun's default rendezvous port.
NATIVE_MASTER_PORT: Final = 29400
# The slice's topology (AxB or AxBxC), the chips per host, and the first port of the per-chip
# TorchTPU endpoints (torch-tpu's own default, written out so a new release cannot move it unseen).
TORCH_TPU_TOPOLOGY_ENV: Final = "TORCH_TPU_TOPOLOGY"
TORCH_TPU_DEVICES_PER_HOST_ENV: Final = "TORCH_TPU_DEVICES_PER_HOST"
TORCH_TPU_BASE_PORT_ENV: Final = "TORCH_TPU_BASE_PORT"
TORCH_TPU_BASE_PORT: Final = 8070
# The variables a native run's pods get besides RENDERED_ENV (render/native_env.py, in this order).
NATIVE_RENDERED_ENV: Final = (
    NNODES_ENV,
    HOST_INDEX_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_BASE_PORT_ENV,
)
# Set by the renderer on a native run of several slices only; read by libtpu, whose MegaScale client
# joins the slices over DCN (torch-tpu 0.2.0's device_mesh.py:330-341 names the three), and
# MEGASCALE_SLICE_ID / MEGASCALE_NUM_SLICES by world.detect_world too. The coordinator is the first
# pod of the first slice at NATIVE_MEGASCALE_PORT, port included: torch-tpu gives each worker its own
# MEGASCALE_PORT (8080 + 2 x local rank), which libtpu would append to a bare host.
MEGASCALE_COORDINATOR_ADDRESS_ENV: Final = "MEGASCALE_COORDINATOR_ADDRESS"
NATIVE_MEGASCALE_PORT: Final = 8080
NATIVE_MULTISLICE_ENV: Final = (
    MEGASCALE_COORDINATOR_ADDRESS_ENV,
    MEGASCALE_SLICE_ID_ENV,
    MEGASCALE_NUM_SLICES_ENV,
)

# Set by the native launcher for the workers it starts, never rendered: the directory where each
# worker notes its exit code, so the pod exits with the workers' code (native/launcher.py).
NATIVE_EXIT_DIR_ENV: Final = "TPUFT_NATIVE_EXIT_DIR"

# Set by the trainer image (Dockerfile ENV) or tests, never rendered; read by data.cache_dir.
CACHE_DIR_ENV: Final = "TPUFT_CACHE_DIR"
# Set by a person (optional, default INFO), never rendered; read by cli._setup_logging.
LOG_LEVEL_ENV: Final = "TPUFT_LOG_LEVEL"
# Set by tests and chaos drills only; read by train.run: SIGKILL the process at the end of that step.
FAULT_KILL_AT_STEP_ENV: Final = "TPUFT_FAULT_KILL_AT_STEP"
# Set by tests and chaos drills only; read by train.run: SIGKILL it in the middle of that step's save
# (every file written, the completion marker not).
FAULT_KILL_IN_SAVE_AT_STEP_ENV: Final = "TPUFT_FAULT_KILL_IN_SAVE_AT_STEP"
# Set by tests and chaos drills only; read by train.run: the process sends itself SIGTERM while that
# step's periodic save is writing (in the background, as training goes on).
FAULT_SIGTERM_IN_SAVE_AT_STEP_ENV: Final = "TPUFT_FAULT_SIGTERM_IN_SAVE_AT_STEP"
# Set by tests and chaos drills only; read by train.run: the process sends itself SIGTERM after that step
# (once no save is writing: the stop then saves the step reached).
FAULT_SIGTERM_AT_STEP_ENV: Final = "TPUFT_FAULT_SIGTERM_AT_STEP"
# Set by tests and chaos drills only; read by train.run: every checkpoint write takes this many seconds
# more (slow storage), before its first file.
FAULT_SLOW_WRITE_SECONDS_ENV: Final = "TPUFT_FAULT_SLOW_WRITE_SECONDS"

# ------------------------------------------------------------------ what a spec may not take over

# The variables the renderer sets on every trainer container (render/jobset.env, in this order).
RENDERED_ENV: Final = (
    SLICE_INDEX_ENV,
    RESTART_ATTEMPT_ENV,
    COORDINATOR_ADDRESS_ENV,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
)
# Names spec.env may never use, whatever the admin allows (api/validation.py): the renderer's own
# and the pod identity Kubernetes and GKE give the trainer.
RESERVED_ENV: Final = frozenset(
    {
        *RENDERED_ENV,
        *NATIVE_RENDERED_ENV,
        NODE_RANK_ENV,
        # Rendered on native multislice pods only, reserved for every backend: on xla GKE sets them.
        *NATIVE_MULTISLICE_ENV,
        JOB_COMPLETION_INDEX_ENV,
        TPU_WORKER_ID_ENV,
        TPU_WORKER_HOSTNAMES_ENV,
    }
)
# Names spec.volumes may not use (api/validation.py): the renderer's own volume.
RESERVED_VOLUMES: Final = frozenset({CONFIG_VOLUME})
# Keys spec.podAnnotations may not set (api/validation.py, the CRD's CEL rule in api/cel.py), so a
# spec can neither replace the operator's annotations nor be silently overwritten by them.
RESERVED_ANNOTATIONS: Final = (TRAINER_CONFIG_ANNOTATION, CHECKPOINT_REQUEST_ANNOTATION)

# Variables spec.env may set only when the admin allows them (api/policy.py, and the chart's admission
# policy generated from it): each changes where the trainer sends its credentials or data, what code
# it loads, or how the TPU runtime behaves. The hub token comes only through spec.model.tokenSecretRef.
ADMIN_RESERVED_ENV_PREFIXES: Final = (
    "HF_",  # the hub: HF_ENDPOINT sends the token elsewhere, HF_HUB_* change what is trusted
    "HUGGINGFACE_",
    "HUGGING_FACE_",
    "PYTHON",  # PYTHONPATH, PYTHONSTARTUP, PYTHONHOME: code loaded into the trainer
    "LD_",  # LD_PRELOAD, LD_LIBRARY_PATH: libraries loaded into every process
    "TPU_",  # the TPU runtime's own topology and worker identity
    "LIBTPU_",
    "XLA_",
    "PJRT_",
    "MEGASCALE_",  # multislice coordination
    "TORCH_TPU_",  # TorchTPU's runtime, its endpoints and compiler options (backend native)
    "TPUFT_",  # the trainer's own settings
)
ADMIN_RESERVED_ENV_NAMES: Final = (
    # Proxies and certificate bundles: every request of the trainer (hub, GCS) goes where they say.
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "FTP_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy", "ftp_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
)  # fmt: skip
