"""TPUFineTune -> JobSet (jobset.x-k8s.io/v1alpha2), the trainer config inside it.

Layout: one replicated job ``slice`` with one Job per TPU slice (replicas = slices) and one pod per
TPU VM (parallelism = completions = hosts per slice, Indexed). Each pod requests all chips of its VM.

The trainer config travels in the pod template, as the annotation ``tpuft.dev/trainer-config``, and
a downward-API volume shows it to the trainer as ``/etc/tpuft/config.yaml``. Why not a ConfigMap:
one object means one write per run fewer (the benchmark's scarce resource is the API server), the
config and the pods that read it are created atomically, and no one can delete the config from under
a JobSet that restarts later. A config is ~1 KiB; an object's annotations may hold 256 KiB.

Every field the JobSet webhook would default is set here explicitly (successPolicy, startupPolicy,
network, completionMode, restartPolicy, failure-rule names, restartStrategy, groupName), so the object
the operator creates is byte-for-byte what the apiserver stores and a GitOps diff stays empty.
"""

from __future__ import annotations

from typing import Any

from tpuft_operator.api.models import TPUFineTune
from tpuft_operator.api.resources import FINETUNE, JOBSET
from tpuft_operator.plan import pods_grace_seconds
from tpuft_operator.render import naming
from tpuft_operator.render.native_env import JOB_INDEX_LABEL, native_env
from tpuft_operator.render.settings import RenderSettings
from tpuft_operator.topology import (
    ACCELERATOR_LABEL,
    INSTANCE_TYPE_LABEL,
    NODEPOOL_LABEL,
    PLACEMENT_POLICY_LABEL,
    RESERVATION_LABEL,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    SliceShape,
)
from tpuft_trainer.config import StopConfig
from tpuft_trainer.exit_codes import USER_ERROR_EXIT_CODES, ExitCode
from tpuft_trainer.pod_contract import (
    CHECKPOINT_REQUEST_ANNOTATION,
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_PATH,
    CONFIG_VOLUME,
    COORDINATOR_ADDRESS_ENV,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    REQUEST_FILE,
    RESTART_ATTEMPT_ENV,
    SLICE_INDEX_ENV,
    TRAINER_CONFIG_ANNOTATION,
)

Obj = dict[str, Any]

CONTAINER = "trainer"
# The trainer's stop channel (tpuft_trainer/stop.py): the first host listens on it, the others connect.
DEFAULT_STOP_PORT = StopConfig().coordination_port
STOP_PORT_NAME = "tpuft-stop"
# The names the pods and the trainer agree on (the config volume and its files, the annotations, the
# environment) are in tpuft_trainer/pod_contract.py. The checkpoint-request file sits in the config's
# volume, where the kubelet refreshes it while the pod runs.

FINETUNE_LABEL = "tpuft.dev/finetune"
FINETUNE_UID_LABEL = "tpuft.dev/finetune-uid"
FINETUNE_ANNOTATION = "tpuft.dev/finetune"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's WorkloadPriorityClass of a job: a label of the TPUFineTune, copied to its JobSet (Kueue reads
# it there; without it, Kueue takes the priority of the pods' spec.priorityClassName).
KUEUE_PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
RESTART_ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"


def owner_reference(ft: TPUFineTune) -> list[Obj]:
    """The TPUFineTune as controller of what it renders; empty when the object has no uid yet
    (`tpuft render` of a file): the apiserver needs a real uid."""
    if not ft.metadata.uid:
        return []
    return [
        {
            "apiVersion": FINETUNE.api_version,
            "kind": FINETUNE.kind,
            "name": ft.metadata.name,
            "uid": ft.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def common_labels(ft: TPUFineTune) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "tpuft-trainer",
        "app.kubernetes.io/managed-by": "tpuft",
        FINETUNE_LABEL: naming.label_value(ft.metadata.name),
    }
    if ft.metadata.uid:
        labels[FINETUNE_UID_LABEL] = ft.metadata.uid
    return labels


def object_metadata(ft: TPUFineTune, name: str, labels: dict[str, str], annotations: dict[str, str]) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": ft.metadata.namespace,
        "labels": labels,
        "annotations": {FINETUNE_ANNOTATION: ft.metadata.name, **annotations},
    }
    owners = owner_reference(ft)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def node_selector(ft: TPUFineTune, shape: SliceShape) -> dict[str, str]:
    tpu = ft.spec.tpu
    selector = {ACCELERATOR_LABEL: shape.family.accelerator, TOPOLOGY_LABEL: shape.topology}
    if shape.machine_type_ambiguous:
        # Both pool kinds carry the same accelerator and topology labels: without it a 2-host 2x4 run's
        # two 4-chip pods could share one 8-chip VM, which is not the slice libtpu is told it has.
        selector[INSTANCE_TYPE_LABEL] = shape.machine_type
    if tpu.placement_policy is not None:
        selector[PLACEMENT_POLICY_LABEL] = tpu.placement_policy
    if tpu.spot:
        selector[SPOT_LABEL] = "true"
    if tpu.reservation is not None:
        selector[RESERVATION_LABEL] = tpu.reservation
    return selector


def tolerations(ft: TPUFineTune) -> list[Obj]:
    # GKE taints TPU nodes google.com/tpu=present:NoSchedule and its admission adds this toleration to
    # pods requesting TPUs; stating it keeps the pod identical on clusters without that plugin.
    out: list[Obj] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if ft.spec.tpu.spot:
        out.append({"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    for t in ft.spec.tolerations or []:
        out.append(t.model_dump(by_alias=True, exclude_none=True))
    return out


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def env(ft: TPUFineTune, shape: SliceShape, jobset: str, settings: RenderSettings) -> list[Obj]:
    out: list[Obj] = [
        # Which slice this pod belongs to, and how many times the JobSet restarted (resume decision);
        # read by tpuft_trainer.world. Off GKE these replace the TPU_WORKER_* / MEGASCALE_* variables.
        _field_env(SLICE_INDEX_ENV, f"metadata.labels['{JOB_INDEX_LABEL}']"),
        _field_env(RESTART_ATTEMPT_ENV, f"metadata.annotations['{RESTART_ATTEMPT_ANNOTATION}']"),
        {"name": COORDINATOR_ADDRESS_ENV, "value": naming.coordinator_address(jobset)},
        _field_env(POD_NAME_ENV, "metadata.name"),
        _field_env(POD_NAMESPACE_ENV, "metadata.namespace"),
    ]
    if ft.spec.backend == "native":
        # torch.distributed's rendezvous and TorchTPU's launch variables (render/native_env.py).
        out += native_env(shape, jobset)
    ref = ft.spec.model.token_secret_ref
    if ref is not None:
        # The token's only way in: a secretKeyRef, never the trainer config or the command line.
        out.append(
            {"name": settings.token_env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    for e in ft.spec.env or []:
        out.append(e.model_dump(by_alias=True, exclude_none=True))
    return out


def resources(ft: TPUFineTune, shape: SliceShape) -> Obj:
    chips = str(shape.chips_per_host)
    extra = ft.spec.resources
    requests: dict[str, Any] = dict(extra.requests or {}) if extra else {}
    limits: dict[str, Any] = dict(extra.limits or {}) if extra else {}
    # Extended resources must have requests == limits; every chip of the VM, so no other pod shares it.
    requests[TPU_RESOURCE] = chips
    limits[TPU_RESOURCE] = chips
    return {"requests": requests, "limits": limits}


def security_context(settings: RenderSettings) -> tuple[Obj, Obj]:
    """(pod, container) security contexts: the restricted Pod Security Standard for a non-root user,
    baseline for root. The user is always explicit: the image's USER is not root.

    Why no `privileged`: GKE TPU pods reach the chips through the device plugin without privileged mode
    since GKE 1.28. Why root stays possible: see RenderSettings.run_as_user.
    """
    user = settings.run_as_user
    pod: Obj = {"seccompProfile": {"type": "RuntimeDefault"}, "runAsUser": user, "runAsGroup": user}
    container: Obj = {"allowPrivilegeEscalation": False, "privileged": False}
    if user != 0:
        pod.update({"runAsNonRoot": True, "fsGroup": user})
        container["capabilities"] = {"drop": ["ALL"]}
    return pod, container


def host_network(ft: TPUFineTune) -> bool:
    return ft.spec.network is not None and ft.spec.network.host_network


def host_network_fields(stop_port: int) -> tuple[Obj, list[Obj]]:
    """(pod spec fields, container ports) of a run with spec.network.hostNetwork, as xpk renders TPU
    pods: the VM's network namespace, and ClusterFirstWithHostNet so the pods still resolve cluster
    names (the coordinator address is the first pod's name under the JobSet's headless Service, which
    then resolves to its node's IP); the default policy would hand them the node's resolv.conf.

    The stop channel's port is declared, as a host port, because it now binds on the node: the
    scheduler then never puts two pods that need it on one node. Two runs never share a TPU VM anyway
    (each pod requests every chip of its VM), so this guards against other host-network pods. The TPU
    runtime's own ports are libtpu's, not declared (as for pod-network runs)."""
    pod = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    ports = [{"name": STOP_PORT_NAME, "containerPort": stop_port, "hostPort": stop_port, "protocol": "TCP"}]
    return pod, ports


def config_file_item() -> Obj:
    """The downward-API item that puts the trainer config (the pod's annotation) at CONFIG_FILE: the
    TPU pods and the prepare pod read the same file."""
    return {
        "path": CONFIG_FILE,
        "fieldRef": {"fieldPath": f"metadata.annotations['{TRAINER_CONFIG_ANNOTATION}']"},
    }


def pod_template(
    ft: TPUFineTune,
    shape: SliceShape,
    jobset: str,
    config_yaml: str,
    settings: RenderSettings,
    stop_port: int = DEFAULT_STOP_PORT,
) -> Obj:
    spec = ft.spec
    pod_security, container_security = security_context(settings)
    container: Obj = {
        "name": CONTAINER,
        "image": spec.image or settings.image_for(spec.backend),
        "imagePullPolicy": settings.image_pull_policy,
        # Exec form, fixed arguments: no spec value is ever parsed by a shell. The same for both
        # backends: for native, the trainer starts one process per chip itself (tpuft_trainer).
        "command": ["tpuft", "train", "--config", CONFIG_PATH],
        "env": env(ft, shape, jobset, settings),
        "resources": resources(ft, shape),
        "securityContext": container_security,
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
            *[m.model_dump(by_alias=True, exclude_none=True) for m in spec.volume_mounts or []],
        ],
    }
    pod_spec: Obj = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": pods_grace_seconds(spec, settings.termination_grace_period_seconds),
        "nodeSelector": node_selector(ft, shape),
        "tolerations": tolerations(ft),
        "securityContext": pod_security,
        "containers": [container],
        "volumes": [
            {
                "name": CONFIG_VOLUME,
                "downwardAPI": {
                    "items": [
                        config_file_item(),
                        {
                            "path": REQUEST_FILE,
                            "fieldRef": {
                                "fieldPath": f"metadata.annotations['{CHECKPOINT_REQUEST_ANNOTATION}']"
                            },
                        },
                    ],
                },
            },
            *[dict(v) for v in spec.volumes or []],
        ],
    }
    if host_network(ft):
        network, ports = host_network_fields(stop_port)
        pod_spec.update(network)
        container["ports"] = ports
    # The per-run account whose Role may patch only this run's status (progress reports), or the
    # user's own (Workload Identity), which the per-run RoleBinding then binds instead.
    pod_spec["serviceAccountName"] = naming.pod_service_account(spec.service_account_name)
    if spec.priority_class_name is not None:
        pod_spec["priorityClassName"] = spec.priority_class_name
    # The config last: validation refuses the key in spec.podAnnotations, and it would win anyway.
    annotations = {**(spec.pod_annotations or {}), TRAINER_CONFIG_ANNOTATION: config_yaml}
    return {"metadata": {"labels": common_labels(ft), "annotations": annotations}, "spec": pod_spec}


def config_of(jobset: Obj) -> str:
    """The trainer config (YAML) a rendered or live JobSet gives its pods."""
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return str(template["metadata"]["annotations"][TRAINER_CONFIG_ANNOTATION])


# The Job controller's message when a pod matches a FailJob rule on exit codes
# (pkg/controller/job/pod_failure_policy.go): "Container %s for pod %s/%s failed with exit code %v
# matching %v rule at index %d". The JobSet rules tell the two FailJob rules apart by it.
_RULE_MATCH = "matching FailJob rule at index {index}$"
USER_ERROR_RULE, CHECKPOINTED_STOP_RULE = 0, 1


def user_error_rule(container: str) -> Obj:
    """A pod failure policy rule: the trainer's user-error exit codes (64-78) in ``container`` fail the
    Job at once, with no retry (the TPU pods' Jobs and the prepare Job alike)."""
    return {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": container,
            "operator": "In",
            "values": sorted(int(code) for code in USER_ERROR_EXIT_CODES),
        },
    }


def failure_policies(ft: TPUFineTune) -> tuple[Obj, Obj]:
    """(Job podFailurePolicy, JobSet failurePolicy): user error / checkpointed stop / infrastructure.

    - A trainer exit code from `USER_ERROR_EXIT_CODES` (bad config, bad data, missing model,
      permission, out of memory) fails its Job (pod rule 0), and the JobSet fails at once: retrying
      cannot succeed and burns TPU hours.
    - Exit 75, a *checkpointed stop* (SIGTERM, then every host saved the step it reached: preemption,
      a drain, maintenance), fails its Job too (pod rule 1), and the JobSet restarts every Job
      without counting against maxRestarts: nothing was lost and the next start resumes from a
      newer checkpoint (a SIGTERM before any new step exits 143, which counts).
    - Any other failure (crash, SIGKILL, lost node) fails the Job through backoffLimit 0, and the
      JobSet's default action restarts every Job, up to maxRestarts.
    Both FailJob rules give the Job the reason PodFailurePolicy; the JobSet rules tell them apart by
    the rule index in the Job's failure message.

    Why not `Ignore` on the DisruptionTarget condition: the Job controller would then replace only the
    disrupted pod while its peers wait in a collective for a host that restarted from scratch; an SPMD
    program has to restart as a whole.
    """
    pod_failure_policy: Obj = {
        "rules": [
            user_error_rule(CONTAINER),
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": [int(ExitCode.STOPPED_AFTER_CHECKPOINT)],
                },
            },
        ]
    }
    jobset_failure_policy: Obj = {
        "maxRestarts": ft.spec.max_restarts,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": "userError",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [_RULE_MATCH.format(index=USER_ERROR_RULE)],
            },
            {
                "name": "checkpointedStop",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [_RULE_MATCH.format(index=CHECKPOINTED_STOP_RULE)],
            },
        ],
    }
    return pod_failure_policy, jobset_failure_policy


def jobset(
    ft: TPUFineTune,
    shape: SliceShape,
    config_yaml: str,
    settings: RenderSettings,
    stop_port: int = DEFAULT_STOP_PORT,
) -> Obj:
    """The run's JobSet; ``config_yaml`` is the trainer config its pods read (trainer_config.py),
    ``stop_port`` that config's stop.coordination_port."""
    spec = ft.spec
    name = naming.jobset_name(ft.metadata.name, ft.metadata.uid)
    labels = common_labels(ft)
    annotations: dict[str, str] = {}
    if spec.queue_name is not None:
        labels[KUEUE_QUEUE_LABEL] = spec.queue_name
    workload_priority = (ft.metadata.labels or {}).get(KUEUE_PRIORITY_CLASS_LABEL)
    if workload_priority:
        labels[KUEUE_PRIORITY_CLASS_LABEL] = workload_priority
    if shape.multi_host or shape.slices > 1:
        # One slice per node pool: JobSet places each Job's leader pod first and pins its followers
        # to the leader's pool, so a slice never straddles two pools (multi-host pools are atomic).
        annotations[EXCLUSIVE_TOPOLOGY_ANNOTATION] = NODEPOOL_LABEL
    pod_failure_policy, jobset_failure_policy = failure_policies(ft)
    hosts = shape.hosts_per_slice
    return {
        "apiVersion": JOBSET.api_version,
        "kind": JOBSET.kind,
        "metadata": object_metadata(ft, name, labels, annotations),
        "spec": {
            # Kueue admits a queued run by unsuspending it, so it must be created suspended.
            "suspend": spec.suspend or spec.queue_name is not None,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
            "successPolicy": {"operator": "All"},
            "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
            "failurePolicy": jobset_failure_policy,
            "replicatedJobs": [
                {
                    "name": naming.REPLICATED_JOB,
                    "groupName": "default",
                    "replicas": shape.slices,
                    "template": {
                        "metadata": {"labels": common_labels(ft)},
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "podFailurePolicy": pod_failure_policy,
                            "template": pod_template(ft, shape, name, config_yaml, settings, stop_port),
                        },
                    },
                }
            ],
        },
    }
