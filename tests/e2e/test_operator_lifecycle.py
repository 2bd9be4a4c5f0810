"""The operator against the real control plane: JobSet controller + webhooks, Job controller,
scheduler, garbage collector and kwok TPU nodes. The operator runs as the chart's ServiceAccount.

Checked elsewhere through the same cluster, more strongly, and so not here: an infrastructure
failure restarts the run, counted, and it then succeeds (test_progress: a real trainer SIGKILLed
resumes from its checkpoint; test_faults: the count while it runs); the operator SIGKILLed during
a burst of creates leaves exactly one JobSet per run (test_faults, killed at a random moment after
its first create, with the log lines that explain it)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OPERATOR_NAMESPACE, OPERATOR_SETTINGS, SERVICE_ACCOUNT, OperatorProcess
from tests.support import NOT_PREPARE, condition, finetune, get_json, wait_for
from tpuft_dev.cluster import kwok
from tpuft_dev.cluster.local import LocalCluster
from tpuft_operator import topology
from tpuft_operator.render import render_run

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

HOLD_RUNNING = kwok.hold_running("15s")


def ft_get(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(get_json(cluster, "tpufinetune", name, "-n", namespace))


def wait_phase(
    cluster: LocalCluster, namespace: str, name: str, phase: str, timeout: float = 90
) -> dict[str, Any]:
    return wait_for(
        lambda: (ft := ft_get(cluster, namespace, name)).get("status", {}).get("phase") == phase and ft,
        timeout=timeout,
        what=f"TPUFineTune {name} to be {phase}",
    )


def events(cluster: LocalCluster, namespace: str, name: str) -> list[tuple[str, str]]:
    items = get_json(
        cluster,
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.kind=TPUFineTune,involvedObject.name={name}",
    )["items"]
    items.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [(e["reason"], e["message"]) for e in items]


def jobsets(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "jobsets", "-n", namespace)["items"])


@pytest.fixture
def v5p_pool(local_cluster: LocalCluster) -> list[str]:
    return local_cluster.add_nodepool("v5p", "2x2x2", prefix=unique("v5p"))


def test_apply_to_succeeded_with_the_rendered_jobset(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    body = finetune("llama", namespace, pod_annotations={**HOLD_RUNNING, **kwok.hold_prepare("3s")})
    local_cluster.apply([body])

    # First the data, on CPU: the prepare Job runs and no JobSet (no TPU) is asked for meanwhile.
    preparing = wait_phase(local_cluster, namespace, "llama", "Preparing", timeout=30)
    assert condition(preparing, "DataPrepared")["status"] == "False"  # type: ignore[index]
    assert not jobsets(local_cluster, namespace)
    expected = render_run(
        {**body, "metadata": {**body["metadata"], "uid": preparing["metadata"]["uid"]}},
        OPERATOR_SETTINGS.render_settings(),
    )
    assert expected.prepare_job is not None
    job = get_json(local_cluster, "job", "llama-prepare", "-n", namespace)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (rendered,) = expected.prepare_job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == rendered["command"] and container["resources"] == rendered["resources"]
    assert job["spec"]["podFailurePolicy"] == expected.prepare_job["spec"]["podFailurePolicy"]
    assert job["metadata"]["ownerReferences"][0]["uid"] == preparing["metadata"]["uid"]
    (prepare_pod,) = get_json(local_cluster, "pods", "-n", namespace, "-l", "job-name=llama-prepare")["items"]
    assert prepare_pod["spec"]["nodeName"].startswith(f"gke-{kwok.CPU_POOL}-")  # the CPU pool, no TPU
    assert topology.TPU_RESOURCE not in json.dumps(prepare_pod["spec"])

    running = wait_phase(local_cluster, namespace, "llama", "Running")
    status = running["status"]
    assert status["chips"] == 8 and status["hosts"] == 2 and status["restarts"] == 0
    assert status["jobSetName"] == "llama"
    assert status["observedGeneration"] == running["metadata"]["generation"]
    assert "startTime" in status and "completionTime" not in status
    assert condition(running, "Running")["status"] == "True"  # type: ignore[index]

    # The JobSet is exactly what `tpuft render` prints: the webhooks defaulted nothing (no drift).
    live = get_json(local_cluster, "jobset", "llama", "-n", namespace)
    assert live["spec"] == expected.jobset["spec"]
    # The JobSet came once the Job had completed; the run says the data is prepared, for which settings.
    job = get_json(local_cluster, "job", "llama-prepare", "-n", namespace)
    assert condition(job, "Complete")["status"] == "True"  # type: ignore[index]
    assert live["metadata"]["creationTimestamp"] >= job["status"]["completionTime"]
    prepared = condition(running, "DataPrepared")
    assert prepared is not None and (prepared["status"], prepared["reason"]) == ("True", "Prepared")
    assert status["data"]["settingsHash"] == expected.data_settings_hash
    assert live["metadata"]["ownerReferences"][0]["uid"] == running["metadata"]["uid"]
    pods = get_json(local_cluster, "pods", "-n", namespace, "-l", "jobset.sigs.k8s.io/jobset-name=llama")[
        "items"
    ]
    assert {p["spec"]["nodeName"] for p in pods} <= set(
        get_json(local_cluster, "nodes")["items"]
        and [
            n["metadata"]["name"]
            for n in get_json(local_cluster, "nodes", "-l", "cloud.google.com/gke-tpu-topology=2x2x2")[
                "items"
            ]
        ]
    )
    assert all(p["spec"]["serviceAccountName"] == "tpuft-trainer" for p in pods)

    table = local_cluster.kubectl("get", "tpuft", "llama", "-n", namespace).stdout
    assert table.split("\n")[0].split()[:5] == ["NAME", "PHASE", "TYPE", "TOPOLOGY", "SLICES"]
    assert "Running" in table and "v5p" in table and "2x2x2" in table

    done = wait_phase(local_cluster, namespace, "llama", "Succeeded", timeout=120)
    assert done["status"]["completionTime"] >= done["status"]["startTime"]
    reasons = [reason for reason, _ in events(local_cluster, namespace, "llama")]
    assert {"PrepareJobCreated", "DataPrepared", "JobSetCreated", "Running", "Succeeded"} <= set(reasons)
    assert reasons.index("PrepareJobCreated") <= reasons.index("JobSetCreated")


def test_a_spot_run_on_ironwood_is_warned_at_its_start_of_its_save_and_its_trainer_stack(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    """Qwen2.5-7B with AdamW on Spot: each host writes tens of GiB at a stop, far more than a reclaim's
    ~15 s allow. The operator says so with the numbers when it creates the JobSet, and the trainer is
    told the 15 s, which its saves are measured against (condition CheckpointSlow). On tpu7x (backend
    native: xla is refused there) it also says the native backend is unverified on TPU (an Event and a
    condition), and creates the JobSet."""
    spot = {"type": "tpu7x", "topology": "2x2x2", "spot": True}
    body = finetune(
        "spot",
        namespace,
        tpu=spot,
        backend="native",
        model={"name": "Qwen/Qwen2.5-7B"},
        training={"maxSteps": 10, "optimizer": "adamw", "saveSteps": 100},
    )
    local_cluster.apply([body])
    (message,) = wait_for(
        lambda: [m for r, m in events(local_cluster, namespace, "spot") if r == "SpotStopTooShort"],
        timeout=60,
        what="the SpotStopTooShort Event",
    )
    assert message.startswith("a Spot reclaim gives the pods 15 s") and "GiB of the checkpoint" in message
    assert "up to the 100 steps since the last periodic checkpoint" in message
    (caveat,) = wait_for(
        lambda: [m for r, m in events(local_cluster, namespace, "spot") if r == "TrainerStackUnverified"],
        timeout=60,
        what="the TrainerStackUnverified Event",
    )
    assert caveat.startswith("backend native is unverified on TPU")
    stack = wait_for(
        lambda: condition(ft_get(local_cluster, namespace, "spot"), "TrainerStackVerified"),
        timeout=60,
        what="condition TrainerStackVerified",
    )
    assert (stack["status"], stack["reason"], stack["message"]) == ("False", "NativeUnverifiedOnTpu", caveat)
    jobset = get_json(local_cluster, "jobset", "spot", "-n", namespace)
    config = render_run(
        jobset_owner(body, ft_get(local_cluster, namespace, "spot")), OPERATOR_SETTINGS.render_settings()
    )
    assert config.trainer_config.stop.grace_seconds == 15
    assert jobset["spec"] == config.jobset["spec"]  # what the pods get: 15 s in their config, 60 s to stop
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert (
        pod["terminationGracePeriodSeconds"] == 60
        and pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    )


def jobset_owner(body: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    return {**body, "metadata": {**body["metadata"], "uid": live["metadata"]["uid"]}}


def test_unschedulable_until_a_matching_pool_appears(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    # A reservation of its own: a reused cluster (TPUFT_KEEP_CLUSTER=1, or one started beforehand) may
    # have v4 2x2x4 pools left by earlier sessions or added by hand; none of them matches this run.
    reservation = unique("wait-pool")
    tpu = {"type": "v4", "topology": "2x2x4", "reservation": reservation}
    local_cluster.apply([finetune("wait-pool", namespace, tpu=tpu)])

    def unschedulable() -> dict[str, Any] | None:
        ft = ft_get(local_cluster, namespace, "wait-pool")
        cond = condition(ft, "Scheduled")
        return ft if cond and cond["status"] == "False" else None

    pending = wait_for(unschedulable, timeout=60, what="the Unschedulable condition")
    assert pending["status"]["phase"] == "Pending"
    message = condition(pending, "Scheduled")["message"]  # type: ignore[index]
    assert "tpu-v4-podslice" in message and "2x2x4" in message
    # The event carries the scheduler's words at the time (the node count in them changes when other
    # pools come and go), so match what it must say rather than the condition's latest text.
    wait_for(
        lambda: any(
            reason == "Unschedulable" and "tpu-v4-podslice" in text and "2x2x4" in text
            for reason, text in events(local_cluster, namespace, "wait-pool")
        ),
        timeout=30,
        what="the Unschedulable event",
    )

    pool = local_cluster.add_nodepool(
        "v4", "2x2x4", prefix=unique("v4"), labels={topology.RESERVATION_LABEL: reservation}
    )
    try:
        wait_phase(local_cluster, namespace, "wait-pool", "Succeeded", timeout=120)
    finally:
        local_cluster.kubectl("delete", "nodes", *pool, "--wait=false", check=False)


def test_user_error_fails_without_retries(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    local_cluster.apply(
        [finetune("bad-data", namespace, maxRestarts=3, pod_annotations=kwok.simulated_exit(65))]
    )
    failed = wait_phase(local_cluster, namespace, "bad-data", "Failed", timeout=120)
    assert failed["status"]["restarts"] == 0
    assert condition(failed, "Failed")["reason"] == "UserError"  # type: ignore[index]
    assert "exit code 65 (DATA_ERROR)" in failed["status"]["message"]
    assert get_json(local_cluster, "jobset", "bad-data", "-n", namespace)["status"].get("restarts", 0) == 0


def test_restarts_exhausted_fails(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    local_cluster.apply(
        [finetune("crashy", namespace, maxRestarts=1, pod_annotations=kwok.simulated_exit(137))]
    )
    failed = wait_phase(local_cluster, namespace, "crashy", "Failed", timeout=150)
    assert failed["status"]["restarts"] == 1
    assert "after 1 restart" in failed["status"]["message"]


def test_suspend_and_resume(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    local_cluster.apply([finetune("pausable", namespace, suspend=True, pod_annotations=HOLD_RUNNING)])
    wait_phase(local_cluster, namespace, "pausable", "Suspended")
    assert get_json(local_cluster, "jobset", "pausable", "-n", namespace)["spec"]["suspend"] is True
    time.sleep(2)
    # (The prepare Job ran meanwhile: it holds no TPU, so spec.suspend does not hold it.)
    assert not get_json(local_cluster, "pods", "-n", namespace, "-l", NOT_PREPARE)["items"]

    local_cluster.kubectl(
        "patch", "tpuft", "pausable", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    wait_phase(local_cluster, namespace, "pausable", "Running")
    local_cluster.kubectl(
        "patch", "tpuft", "pausable", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    suspended = wait_phase(local_cluster, namespace, "pausable", "Suspended")
    assert get_json(local_cluster, "jobset", "pausable", "-n", namespace)["spec"]["suspend"] is True
    assert condition(suspended, "Suspended")["status"] == "True"  # type: ignore[index]
    reasons = {reason for reason, _ in events(local_cluster, namespace, "pausable")}
    assert {"Suspended", "Resumed"} <= reasons


def test_delete_cascades_to_everything_the_run_created(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    local_cluster.apply([finetune("doomed", namespace, pod_annotations=HOLD_RUNNING)])
    wait_phase(local_cluster, namespace, "doomed", "Running")
    kinds = ("jobsets", "jobs", "serviceaccounts", "roles", "rolebindings")
    selector = "tpuft.dev/finetune=doomed"
    assert all(
        get_json(local_cluster, k, "-n", namespace, "-l", selector)["items"] for k in ("jobsets", "jobs")
    )
    assert get_json(local_cluster, "job", "doomed-prepare", "-n", namespace)["metadata"]["uid"]
    local_cluster.kubectl("delete", "tpuft", "doomed", "-n", namespace, "--wait=true", "--timeout=30s")
    wait_for(
        lambda: (
            not any(get_json(local_cluster, k, "-n", namespace, "-l", selector)["items"] for k in kinds)
            and not get_json(local_cluster, "pods", "-n", namespace)["items"]
        ),
        timeout=120,
        what="garbage collection of the run's objects",
    )


def test_deleted_jobset_is_recreated_while_active_but_not_after_completion(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    local_cluster.apply([finetune("fragile", namespace, pod_annotations=kwok.hold_running("8s"))])
    wait_phase(local_cluster, namespace, "fragile", "Running")
    first_uid = get_json(local_cluster, "jobset", "fragile", "-n", namespace)["metadata"]["uid"]
    local_cluster.kubectl("delete", "jobset", "fragile", "-n", namespace, "--wait=true", "--timeout=60s")

    recreated = wait_for(
        lambda: (
            (js := [j for j in jobsets(local_cluster, namespace) if j["metadata"]["uid"] != first_uid])
            and js[0]
        ),
        timeout=60,
        what="the operator to recreate the JobSet",
    )
    assert recreated["metadata"]["name"] == "fragile"
    # The data prepared for it is reused: no second prepare Job.
    assert [r for r, _ in events(local_cluster, namespace, "fragile")].count("PrepareJobCreated") == 1
    # Events are posted by their own threads (runtime.EventPoster): a moment after the JobSet.
    wait_for(
        lambda: "JobSetRecreated" in {reason for reason, _ in events(local_cluster, namespace, "fragile")},
        timeout=15,
        what="the JobSetRecreated Event",
    )
    wait_phase(local_cluster, namespace, "fragile", "Succeeded", timeout=120)

    local_cluster.kubectl("delete", "jobset", "fragile", "-n", namespace, "--wait=true", "--timeout=60s")
    time.sleep(8)  # longer than the operator's resync interval (5 s in these tests)
    assert not jobsets(local_cluster, namespace)
    assert ft_get(local_cluster, namespace, "fragile")["status"]["phase"] == "Succeeded"


def test_invalid_spec_past_the_crd_fails_with_the_field(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    # A cross-field rule the CRD does not check (a mount naming no volume); the operator does.
    body = finetune("bad-mount", namespace, volumeMounts=[{"name": "missing", "mountPath": "/data"}])
    local_cluster.apply([body])
    failed = wait_phase(local_cluster, namespace, "bad-mount", "Failed")
    valid = condition(failed, "Valid")
    assert valid is not None and valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert valid["message"].startswith("spec.volumeMounts[0].name: no volume named 'missing'")
    assert not jobsets(local_cluster, namespace)
    generation_before = failed["metadata"]["resourceVersion"]
    time.sleep(8)  # not retried in a loop: the object is not rewritten by resyncs
    assert ft_get(local_cluster, namespace, "bad-mount")["metadata"]["resourceVersion"] == generation_before


def test_paced_status_and_events_catch_up_and_jobsets_never_wait(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, v5p_pool: list[str]
) -> None:
    """--write-qps paces status patches and Events (pacing.py), never JobSet creates. Under one write
    a second, three runs applied at once (a pool each) all get their JobSet at once, and every status
    and Event still arrives, in its turn (the operator's metrics show the waits)."""
    for _ in range(2):  # v5p_pool is the first of three
        local_cluster.add_nodepool("v5p", "2x2x2", prefix=unique("v5p"))
    saved = dict(operator.settings)
    operator.stop()
    operator.settings.update(TPUFT_WRITE_QPS="1", TPUFT_WRITE_BURST="1")
    try:
        operator.start()
        names = [f"paced-{i}" for i in range(3)]
        hold = kwok.hold_running("120s")
        local_cluster.apply([finetune(n, namespace, pod_annotations=hold) for n in names])
        # Three JobSetCreated Events alone take three seconds of turns; the JobSets do not wait for them.
        wait_for(lambda: len(jobsets(local_cluster, namespace)) == 3, timeout=15, what="3 JobSets")
        for name in names:
            wait_phase(local_cluster, namespace, name, "Running", timeout=120)
            wait_for(
                lambda name=name: (
                    {"JobSetCreated", "Running"} <= {r for r, _ in events(local_cluster, namespace, name)}
                ),
                timeout=60,
                what=f"{name}'s JobSetCreated and Running Events",
            )
        waited = {
            write: float(line.split()[-1])
            for line in operator.metrics().splitlines()
            for write in ("status", "event")
            if line.startswith(f'tpuft_write_pace_wait_seconds_sum{{write="{write}"}}')
        }
        assert waited["status"] > 0 and waited["event"] > 0, waited
    finally:
        operator.stop()
        operator.settings.clear()
        operator.settings.update(saved)
        operator.start()


def test_operator_permissions_are_the_charts(local_cluster: LocalCluster, operator: OperatorProcess) -> None:
    who = f"--as=system:serviceaccount:{OPERATOR_NAMESPACE}:{SERVICE_ACCOUNT}"

    def can(*args: str) -> bool:
        result = local_cluster.kubectl("auth", "can-i", *args, who, check=False)
        return result.stdout.strip() == "yes"

    assert can("create", "jobsets.jobset.x-k8s.io", "-n", "default")
    assert can("create", "jobs.batch", "-n", "default")  # the prepare Job
    assert can("patch", "tpufinetunes.tpuft.dev", "--subresource=status", "-n", "default")
    assert not can("get", "secrets", "-A")
    assert not can("create", "pods", "-n", "default")
    assert not can("update", "tpufinetunes.tpuft.dev", "-n", "default")  # never writes spec
    assert not can("escalate", "roles.rbac.authorization.k8s.io", "-n", "default")
    assert not can("bind", "roles.rbac.authorization.k8s.io", "-n", "default")
    # An action outside its role fails for real when attempted with its credentials.
    denied = local_cluster.kubectl(
        "get", "secrets", "-n", "default", kubeconfig=operator.kubeconfig, check=False
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_metrics_and_health(local_cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    # A run of its own: the operator may have been restarted by the tests above after their creates
    # (the SIGKILL test's operator can find all its burst's JobSets made by the one it replaced).
    local_cluster.apply([finetune("metered", namespace)])
    wait_for(
        lambda: ft_get(local_cluster, namespace, "metered").get("status", {}).get("phase"),
        timeout=60,
        what="a status of run metered",
    )
    # The reconcile after the create (the JobSet's status) may come after the phase is first written:
    # wait for its figures rather than read the metrics once (a fresh operator process has none yet).
    other = 'tpuft_workqueue_queue_duration_seconds_count{work="other"}'
    text = wait_for(
        lambda: page if other in (page := operator.metrics()) else None,
        timeout=60,
        what="the operator's metrics of a reconcile after the create",
    )
    assert "tpuft_reconciles_total" in text
    assert 'tpuft_runs{phase="Running"}' in text
    # The run waited for a worker to create its JobSet, and for status work.
    assert 'tpuft_workqueue_queue_duration_seconds_count{work="create"}' in text
    assert other in text
    # ...and its reconciles, the one that created its JobSet apart from the rest.
    assert 'tpuft_reconcile_duration_seconds_count{work="create"}' in text
    assert 'tpuft_reconcile_duration_seconds_count{work="other"}' in text
    assert operator.alive()
