"""The prepare Job (issue 47): its render, the status derived from it, and the reconcile decision.

Pure functions and the Reconciler against the recording API of test_reconciler; the same flow
against the local cluster is in tests/e2e (test_operator_lifecycle, test_kueue, test_policy).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace
from typing import Any

import pytest

from tests.unit.test_reconciler import OURS, Events, RecordingApi, reconciler
from tests.unit.test_render import BASE, pod_spec, with_spec
from tests.unit.test_status import NOW, cond, jobset
from tests.unit.test_status import finetune as status_finetune
from tpuft_operator import plan, preparing
from tpuft_operator.api.validation import SpecError, parse
from tpuft_operator.reconcile import Decision, decide
from tpuft_operator.render import RenderSettings, render_run
from tpuft_operator.render.jobset import KUEUE_QUEUE_LABEL, config_of
from tpuft_operator.render.prepare_job import DATA_SETTINGS_LABEL, JOB_UID_LABEL, data_settings_hash
from tpuft_operator.slim import slim_pod
from tpuft_operator.status import Observed, derive_status
from tpuft_operator.topology import TPU_RESOURCE
from tpuft_trainer.pod_contract import TRAINER_CONFIG_ANNOTATION
from tpuft_trainer.prepare_contract import SUMMARY_LIMIT, ModelFigures, PrepareSummary, error_message

SUMMARY = PrepareSummary(
    fingerprint="a1b2c3",
    reused=False,
    documents=1000,
    dropped=3,
    rows=640,
    positions=640 * 1024,
    loss_tokens=327680,
    eval_rows=20,
    seconds=42.4,
    tokens_per_second=15000.0,
)


def job_of(spec: dict[str, Any]) -> dict[str, Any]:
    job = render_run(spec).prepare_job
    assert job is not None
    return job


def container(job: dict[str, Any]) -> dict[str, Any]:
    containers = job["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


# ------------------------------------------------------------------------------------------ render


def test_the_job_runs_tpuft_prepare_with_the_jobsets_config_image_identity_and_security() -> None:
    spec = with_spec(
        model={"name": "google/gemma-2-2b", "tokenSecretRef": {"name": "hf", "key": "token"}},
        env=[{"name": "TEAM", "value": "ml"}],
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
        podAnnotations={"gke-gcsfuse/volumes": "true"},
        serviceAccountName="trainer-wi",
    )
    run = render_run(spec)
    job, tpu_pod = job_of(spec), pod_spec(run.jobset)
    pod = job["spec"]["template"]["spec"]
    c, tpu_container = container(job), tpu_pod["containers"][0]
    assert job["metadata"]["name"] == "run-prepare"
    assert job["metadata"]["ownerReferences"] == run.jobset["metadata"]["ownerReferences"]
    # The very config the TPU pods read, mounted the same way: what it prepares is what they load.
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations[TRAINER_CONFIG_ANNOTATION] == config_of(run.jobset)
    assert annotations["gke-gcsfuse/volumes"] == "true"
    assert c["command"] == [
        "tpuft", "prepare", "--config", "/etc/tpuft/config.yaml", "--workers", "4",
        "--summary-file", "/dev/termination-log",
    ]  # fmt: skip
    assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == ("/dev/termination-log", "File")
    assert c["image"] == tpu_container["image"]
    assert c["volumeMounts"] == tpu_container["volumeMounts"]
    assert pod["volumes"][1:] == tpu_pod["volumes"][1:]  # the spec's volumes; the config volume first
    assert pod["serviceAccountName"] == tpu_pod["serviceAccountName"] == "trainer-wi"
    assert pod["securityContext"] == tpu_pod["securityContext"]
    assert c["securityContext"] == tpu_container["securityContext"]
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
    # The token only by secretKeyRef, the spec's variables, and nothing that only a JobSet pod has.
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["TEAM"]["value"] == "ml"
    assert not {"TPUFT_SLICE_INDEX", "TPUFT_RESTART_ATTEMPT", "TPUFT_COORDINATOR_ADDRESS"} & set(env)


def test_the_job_holds_no_tpu_and_is_none_of_kueues_business() -> None:
    job = job_of(with_spec(queueName="team-a", tolerations=[{"key": "team", "value": "ml"}]))
    pod = job["spec"]["template"]["spec"]
    resources = container(job)["resources"]
    assert TPU_RESOURCE not in resources["requests"] and TPU_RESOURCE not in resources["limits"]
    assert "nodeSelector" not in pod and "tolerations" not in pod  # spec.tolerations are the TPU pods'
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        assert KUEUE_QUEUE_LABEL not in labels


def test_resources_default_from_the_data_figures_and_workers_follow_the_cpu_request() -> None:
    resources = container(job_of(copy.deepcopy(BASE)))["resources"]
    assert resources == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    given = with_spec(prepare={"resources": {"requests": {"cpu": "2500m", "memory": "40Gi"}}})
    c = container(job_of(given))
    assert c["resources"] == {"requests": {"cpu": "2500m", "memory": "40Gi"}, "limits": {"memory": "40Gi"}}
    assert c["command"][c["command"].index("--workers") + 1] == "3"  # ceil(2.5)


def test_the_prepare_pods_own_scheduling_deadline_and_failure_policy() -> None:
    job = job_of(
        with_spec(
            prepare={
                "nodeSelector": {"pool": "cpu"},
                "tolerations": [{"key": "dedicated", "value": "cpu", "effect": "NoSchedule"}],
                "deadlineSeconds": 3600,
            }
        )
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
    ]
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job_of(copy.deepcopy(BASE))["spec"]["activeDeadlineSeconds"] == 6 * 3600
    assert job["spec"]["backoffLimit"] == 2
    user_error, disruption = job["spec"]["podFailurePolicy"]["rules"]
    assert user_error["action"] == "FailJob"
    assert user_error["onExitCodes"] == {
        "containerName": "prepare",
        "operator": "In",
        "values": [64, 65, 66, 77, 78],
    }
    assert disruption == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }


def test_the_job_is_keyed_on_the_data_settings_only() -> None:
    def key(spec: dict[str, Any]) -> str:
        job = job_of(spec)
        assert (
            job["metadata"]["labels"][DATA_SETTINGS_LABEL]
            == job["metadata"]["annotations"][DATA_SETTINGS_LABEL]
        )
        return str(job["metadata"]["labels"][DATA_SETTINGS_LABEL])

    base = key(copy.deepcopy(BASE))
    assert base == data_settings_hash(render_run(copy.deepcopy(BASE)).trainer_config)
    # What the prepared rows are made of: another hash.
    assert key(with_spec(dataset={"name": "tatsu-lab/alpaca", "packing": True})) != base
    assert key(with_spec(training={"maxSteps": 10, "maxSeqLength": 2048})) != base
    # What only training does with them (steps, learning rate, the slice): the same data.
    assert key(with_spec(training={"maxSteps": 99, "learningRate": 1e-4})) == base
    assert key(with_spec(tpu={"type": "v5e", "topology": "2x4"})) == base


def test_prepare_enabled_false_renders_no_job() -> None:
    assert render_run(with_spec(prepare={"enabled": False})).prepare_job is None


@pytest.mark.parametrize(
    ("prepare", "field"),
    [
        ({"resources": {"requests": {TPU_RESOURCE: "4"}}}, "spec.prepare.resources.requests"),
        ({"resources": {"requests": {"cpu": "0"}}}, "spec.prepare.resources.requests.cpu"),
        ({"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}, "spec.prepare.resources.requests.memory"),
        ({"nodeSelector": {"pool name": "cpu"}}, "spec.prepare.nodeSelector"),
        ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "spec.prepare.tolerations[0].operator"),
    ],
)  # fmt: skip
def test_a_bad_prepare_spec_is_refused_naming_the_field(prepare: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as error:
        render_run(parse(with_spec(prepare=prepare)))
    assert field in [e.field for e in error.value.errors]


# ----------------------------------------------------------------------------- the observed Job

HASH = data_settings_hash(render_run(copy.deepcopy(BASE)).trainer_config)


def job(
    *conditions: str, settings_hash: str = HASH, failed: int = 0, **condition_fields: str
) -> dict[str, Any]:
    """A prepare Job as its watch keeps it (preparing.slim_job), with these True conditions."""
    return preparing.slim_job(
        {
            "metadata": {
                "name": "run-prepare",
                "namespace": "ns",
                "uid": "job-1",
                "labels": {DATA_SETTINGS_LABEL: settings_hash, "tpuft.dev/component": "prepare"},
                "ownerReferences": [{"kind": "TPUFineTune", "name": "run", "uid": "u-1", "controller": True}],
            },
            "status": {
                "conditions": [{"type": c, "status": "True", **condition_fields} for c in conditions],
                "failed": failed,
            },
        }
    )


def prepare_pod(
    phase: str = "Running", *, exit_code: int | None = None, message: str = "", name: str = "run-prepare-x1"
) -> dict[str, Any]:
    """A prepare pod as its watch keeps it (slim_pod): the termination message survives."""
    status: dict[str, Any] = {"phase": phase, "startTime": "2026-11-30T11:59:00Z"}
    if exit_code is not None:
        status["containerStatuses"] = [
            {"name": "prepare", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
        ]
    return slim_pod(
        {
            "metadata": {
                "name": name,
                "labels": {
                    "tpuft.dev/component": "prepare",
                    JOB_UID_LABEL: "job-1",
                    "tpuft.dev/finetune": "run",
                },
            },
            "status": status,
        }
    )


def observe(
    ft: dict[str, Any], prepare_job: dict[str, Any] | None, pods: list[dict[str, Any]] = (), **kw: Any
) -> dict[str, Any]:  # type: ignore[assignment]
    return derive_status(
        Observed(
            finetune=ft,
            jobset=kw.pop("js", None),
            prepare=preparing.PrepareSeen(HASH, prepare_job, pods),
            chips=4,
            hosts=1,
            now=NOW,
            **kw,
        )
    )


def finetune(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return status_finetune(status, training={"maxSteps": 25, "perDeviceBatchSize": 2})


def test_while_the_job_runs_the_run_is_preparing_and_holds_no_jobset() -> None:
    status = observe(finetune(), job(), [prepare_pod()])
    assert status["phase"] == "Preparing"
    assert "preparing the data on CPU (Job run-prepare)" in status["message"]
    prepared = cond(status, "DataPrepared")
    assert (prepared["status"], prepared["reason"]) == ("False", "Preparing")
    assert "jobSetName" not in status and "data" not in status
    # No Job yet (its create is on the way): Preparing too.
    assert observe(finetune(), None)["phase"] == "Preparing"
    # A retry says which attempt it is.
    assert "(attempt 2)" in observe(finetune(), job(failed=1), [prepare_pod()])["message"]


def test_an_unschedulable_prepare_pod_says_what_it_needs() -> None:
    pending = prepare_pod("Pending")
    pending["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes: Insufficient cpu",
        }
    ]
    status = observe(finetune(), job(), [pending])
    assert status["phase"] == "Preparing"
    assert "spec.prepare.resources" in status["message"] and "Insufficient cpu" in status["message"]


def test_a_prepared_set_gives_its_figures_and_the_steps_an_epoch_takes() -> None:
    status = observe(
        finetune(), job("Complete"), [prepare_pod("Succeeded", exit_code=0, message=SUMMARY.to_message())]
    )
    assert status["phase"] == "Pending"  # the JobSet comes next
    prepared = cond(status, "DataPrepared")
    assert (prepared["status"], prepared["reason"]) == ("True", "Prepared")
    assert "640 rows of 1000 documents" in prepared["message"]
    # global batch = 2 a chip x 4 chips = 8: 640 // 8 = 80 steps an epoch, maxSteps 25 covers 0.31 of one.
    assert status["data"] == {
        "settingsHash": HASH,
        "fingerprint": "a1b2c3",
        "reused": False,
        "documents": 1000,
        "droppedDocuments": 3,
        "rows": 640,
        "positions": 655360,
        "lossTokenShare": 0.5,
        "evalRows": 20,
        "preparedSeconds": 42.4,
        "stepsPerEpoch": 80,
        "epochsCovered": 0.31,
    }


def test_figures_once_written_stay_when_the_job_and_its_pod_are_gone() -> None:
    first = observe(
        finetune(), job("Complete"), [prepare_pod("Succeeded", exit_code=0, message=SUMMARY.to_message())]
    )
    later = observe(finetune(first), None, [], js=jobset())
    assert "data" not in later  # not in the patch: what was written stays
    assert cond(later, "DataPrepared")["status"] == "True"


def test_a_job_that_succeeded_without_figures_still_lets_the_run_start() -> None:
    """A pod that wrote no termination message (kwok's simulated pods, a lost message): prepared."""
    status = observe(finetune(), job("Complete"), [prepare_pod("Succeeded", exit_code=0)])
    assert status["phase"] == "Pending"
    assert status["data"] == {"settingsHash": HASH}


def test_a_user_error_fails_the_run_with_the_trainers_words_and_no_jobset() -> None:
    said = "spec.dataset.messagesField: row 7 has no field 'messages'"
    pods = [prepare_pod("Failed", exit_code=65, message=error_message(said, 65))]
    status = observe(
        finetune(), job("Failed", reason="PodFailurePolicy", message="matching FailJob rule"), pods
    )
    assert status["phase"] == "Failed"
    assert said in status["message"] and "exit code 65 (DATA_ERROR)" in status["message"]
    assert "no TPU was requested" in status["message"]
    for type_ in ("DataPrepared", "Failed"):
        assert cond(status, type_)["reason"] == "DataError"
    assert cond(status, "DataPrepared")["status"] == "False"
    assert "jobSetName" not in status and status["completionTime"]


def test_exhausted_retries_fail_the_run_saying_what_the_last_attempt_did() -> None:
    pods = [prepare_pod("Failed", exit_code=137, name=f"run-prepare-{i}") for i in range(3)]
    status = observe(
        finetune(),
        job("Failed", reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit"),
        pods,
    )
    assert status["phase"] == "Failed"
    assert cond(status, "Failed")["reason"] == "PrepareFailed"
    assert "BackoffLimitExceeded" in status["message"] and "exit code 137" in status["message"]
    assert "spec.prepare.resources" in status["message"]


def test_a_job_of_other_data_settings_is_being_replaced_and_its_figures_go() -> None:
    before = finetune({"phase": "Preparing", "data": {"settingsHash": "old", "rows": 9}})
    status = observe(before, job("Complete", settings_hash="old"))
    assert status["phase"] == "Preparing" and "replacing it" in status["message"]
    assert status["data"] is None  # merge patch null: figures of other settings must not stay


def test_prepare_disabled_says_the_tpu_hosts_prepare() -> None:
    status = derive_status(
        Observed(finetune=status_finetune(prepare={"enabled": False}), jobset=None, chips=4, hosts=1, now=NOW)
    )
    assert status["phase"] == "Pending"
    prepared = cond(status, "DataPrepared")
    assert (prepared["status"], prepared["reason"]) == ("False", "OnTpuHosts")


def test_the_trainer_pods_never_count_a_prepare_pod_as_a_running_host() -> None:
    # A succeeded prepare pod next to one running TPU host of two: still Pending, not Running.
    tpu = {
        "metadata": {"name": "run-slice-0-0-a"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    status = derive_status(
        Observed(
            finetune=finetune(),
            jobset=jobset(),
            pods=[tpu, prepare_pod("Succeeded", exit_code=0)],
            chips=8,
            hosts=2,
            now=NOW,
        )
    )
    assert status["phase"] == "Pending"


# ------------------------------------------------------------------------------ the decision


PREPARED = {
    "data": {"settingsHash": HASH},
    "conditions": [
        {
            "type": "DataPrepared",
            "status": "True",
            "reason": "Prepared",
            "message": "",
            "lastTransitionTime": "x",
        }
    ],
}


def seen(prepare_job: dict[str, Any] | None, pods: list[dict[str, Any]] = ()) -> preparing.PrepareSeen:  # type: ignore[assignment]
    return preparing.PrepareSeen(HASH, prepare_job, pods)


def test_no_jobset_before_the_data_is_prepared() -> None:
    assert decide(finetune(), True, None, prepare=seen(None)) == Decision(create_prepare_job=True)
    assert decide(finetune(), True, None, prepare=seen(job(), [prepare_pod()])) == Decision()
    failed = job("Failed", reason="PodFailurePolicy")
    assert decide(finetune(), True, None, prepare=seen(failed)) == Decision()
    done = job("Complete")
    assert decide(finetune(), True, None, prepare=seen(done)) == Decision(create=True)


def test_a_job_of_other_settings_is_deleted_before_a_new_one_is_made() -> None:
    assert decide(finetune(), True, None, prepare=seen(job(settings_hash="old"))) == Decision(
        delete_prepare_job=True
    )
    # Even when the status holds figures: they are of the old settings.
    old = finetune({**PREPARED, "data": {"settingsHash": "old"}})
    assert decide(old, True, None, prepare=seen(job("Complete", settings_hash="old"))).delete_prepare_job


def test_a_restart_resume_or_recreated_jobset_reuses_what_was_prepared() -> None:
    # The Job may be gone (deleted by hand); the status says the data of these settings is prepared.
    ready = finetune({**PREPARED, "jobSetName": "run"})
    assert decide(ready, True, None, prepare=seen(None)) == Decision(create=True, recreated=True)
    # With a JobSet, the prepare Job is never looked at again.
    assert decide(finetune(), True, jobset(), prepare=seen(None)) == Decision()


def test_prepare_disabled_goes_straight_to_the_jobset() -> None:
    assert decide(finetune(), True, None, prepare=None) == Decision(create=True)


# --------------------------------------------------------------------------- the Reconciler


class JobApi(RecordingApi):
    def __init__(self, run: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.deleted: list[tuple[str, str | None]] = []
        self.run = run  # the run the apiserver holds (None: new_run())

    def delete_job(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        self.calls.append(("delete", "Job"))
        self.deleted.append((name, uid))

    def patch_finetune_status(self, namespace: str, name: str, status: Any) -> dict[str, Any]:
        """The run (of BASE, prepare enabled) as the apiserver answers a status patch."""
        super().patch_finetune_status(namespace, name, status)
        body = copy.deepcopy(self.run) if self.run is not None else new_run()
        body["metadata"]["resourceVersion"] = str(self.resource_version)
        body["status"] = copy.deepcopy(self.last_status)
        return body


class ReasonsAndMessages(Events):
    def __init__(self) -> None:
        super().__init__()
        self.messages: dict[str, str] = {}

    def __call__(self, type_: str, reason: str, message: str) -> None:
        super().__call__(type_, reason, message)
        self.messages[reason] = message


def new_run() -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    body["metadata"].update(uid="u-1", name="run", generation=1, resourceVersion="1")
    return body


def test_the_reconciler_prepares_then_creates_the_jobset_with_the_figures() -> None:
    api, events = JobApi(), ReasonsAndMessages()
    r, _ = reconciler(api)
    run = new_run()
    r.reconcile(run, None, [], event=events)
    assert [c for c in api.calls if c[0] != "ensure"] == [("create", "Job"), ("status", "Preparing")]
    assert events.posted == ["PrepareJobCreated"]  # the first Preparing says nothing more
    assert "before requesting 4 TPU chips" in events.messages["PrepareJobCreated"]
    created = api.bodies[-1]
    assert created["kind"] == "Job" and created["metadata"]["labels"][DATA_SETTINGS_LABEL]
    settings_hash = created["metadata"]["labels"][DATA_SETTINGS_LABEL]
    live = preparing.slim_job({**created, "metadata": {**created["metadata"], "uid": "job-1"}})
    live["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    summary_pod = prepare_pod("Succeeded", exit_code=0, message=SUMMARY.to_message())
    running = {**run, "status": api.last_status}
    r.reconcile(running, None, [summary_pod], event=events, prepare_job=live)
    assert ("create", "JobSet") in api.calls
    assert api.last_status["data"]["settingsHash"] == settings_hash
    assert api.last_status["data"]["rows"] == 640
    # (DataPrepared comes with the status write, after the JobSet it made possible.)
    assert events.posted == ["PrepareJobCreated", "JobSetCreated", "DataPrepared"]


def test_the_reconciler_replaces_a_job_of_other_settings() -> None:
    api, events = JobApi(), ReasonsAndMessages()
    r, _ = reconciler(api)
    stale = job(settings_hash="old")
    r.reconcile(new_run(), None, [], event=events, prepare_job=stale)
    assert api.deleted == [("run-prepare", "job-1")]
    assert ("create", "Job") not in api.calls  # the new one once the old one's DELETED event comes
    assert "PrepareJobReplaced" in events.posted


def test_another_runs_job_under_this_runs_label_is_never_acted_on() -> None:
    api = JobApi()
    r, _ = reconciler(api)
    theirs = job(settings_hash="old")
    theirs["metadata"]["ownerReferences"][0]["uid"] = "u-2"
    r.reconcile(new_run(), None, [], event=Events(), prepare_job=theirs)
    assert api.deleted == [] and ("create", "Job") in api.calls


def test_settings_of_the_reconciler_render_the_job_too() -> None:
    settings = RenderSettings(trainer_image="registry.example/trainer:9", run_as_user=0)
    job = render_run(copy.deepcopy(BASE), settings).prepare_job
    assert job is not None
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/trainer:9"
    assert pod["securityContext"]["runAsUser"] == 0


def test_a_prepare_job_the_apiserver_refuses_is_said_in_its_words_and_tried_again() -> None:
    from tpuft_operator.k8s import ApiError

    refusal = 'creating Job ns/run-prepare: HTTP 403: jobs.batch "run-prepare" is forbidden: exceeded quota: no-jobs'

    class QuotaApi(JobApi):
        def create_or_adopt(self, obj: Any) -> tuple[dict[str, Any], bool]:
            self.calls.append(("refused", obj["kind"]))
            raise ApiError(refusal, status=403, retryable=False)

    api, events = QuotaApi(), Events()
    r, _ = reconciler(api)
    r.reconcile(new_run(), None, [], event=events)  # not raised: the status says it, the resync retries
    status = api.last_status
    assert status["phase"] == "Preparing" and refusal in status["message"]
    failure = cond(status, "ReplicaFailure")
    assert (failure["status"], failure["reason"]) == ("True", "FailedCreate")
    assert "ReplicaFailure" in events.posted
    r.reconcile(new_run(), None, [], event=events)
    assert api.calls.count(("refused", "Job")) == 2


def test_a_prepare_pod_the_apiserver_refuses_is_said_in_its_words() -> None:
    refusal = 'Error creating: pods "run-prepare-x" is forbidden: violates PodSecurity "restricted:latest"'

    class RefusingApi(JobApi):
        def creation_failures(self, namespace: str) -> list[dict[str, Any]]:
            self.calls.append(("events", namespace))
            return [
                {
                    "message": refusal,
                    "lastTimestamp": "2099-01-01T00:00:00Z",
                    "involvedObject": {"kind": "Job", "name": "run-prepare"},
                }
            ]

    api, events = RefusingApi(), Events()
    r, _ = reconciler(api)
    old = job()
    old["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    r.reconcile(new_run(), None, [], event=events, prepare_job=old)  # no pod of it exists
    status = api.last_status
    assert status["phase"] == "Preparing"
    assert status["message"] == f"the Job controller cannot create the run's prepare pod: {refusal}"
    assert cond(status, "ReplicaFailure")["status"] == "True"


def test_the_figures_reach_the_status_when_its_first_write_after_the_jobset_waits() -> None:
    """Found by the e2e run: the first status after the JobSet's creation waits for its pods (status
    settling), and by then only the render's shape is kept; the Job's figures must still come."""
    api, events = JobApi(), Events()
    r, _ = reconciler(api, settle=0.05)
    run = new_run()
    run["status"] = {"phase": "Preparing"}
    done = job("Complete")
    summary_pod = prepare_pod("Succeeded", exit_code=0, message=SUMMARY.to_message())
    r.reconcile(run, None, [summary_pod], event=events, prepare_job=done)
    assert ("create", "JobSet") in api.calls and not [c for c in api.calls if c[0] == "status"]
    time.sleep(0.06)
    live = {"metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS}, "spec": {}, "status": {}}
    r.reconcile(run, live, [summary_pod], event=events, prepare_job=done)
    assert api.last_status["phase"] == "Pending"
    assert api.last_status["data"]["rows"] == 640
    assert cond(api.last_status, "DataPrepared")["status"] == "True"


# ------------------------------------------------- the plan's verdict with the model's real dimensions
# A 70B-class model outside the plan's catalog (validation cannot judge it), as the prepare Job reads it:
# its config's dimensions, its parameters counted from its safetensors headers.
PRIVATE_70B = ModelFigures(
    hidden_size=8192,
    num_layers=80,
    intermediate_size=28672,
    num_heads=64,
    num_kv_heads=8,
    vocab_size=128256,
    params=70_553_706_496,
)
# A v5e host (192 GiB) staging its share of a float32 full fine-tune's adamw checkpoint on 4x4: ~209 GiB.
SMALL_HOSTS: dict[str, Any] = {
    "model": {"name": "org/private-70b", "dtype": "float32"},
    "tpu": {"type": "v5e", "topology": "4x4"},
    "training": {"maxSteps": 25, "method": "full", "optimizer": "adamw"},
}


def reported(model: ModelFigures | None) -> list[dict[str, Any]]:
    """The pod of a Job that prepared the data and read ``model``."""
    return [prepare_pod("Succeeded", exit_code=0, message=replace(SUMMARY, model=model).to_message())]


def test_a_model_outside_the_catalog_no_host_can_hold_fails_before_any_tpu_naming_the_topology() -> None:
    ft = status_finetune(None, **SMALL_HOSTS)
    parse(ft)  # validation lets it through: it cannot read the model
    pods = reported(PRIVATE_70B)
    status = observe(ft, job("Complete"), pods)
    assert status["phase"] == "Failed" and "jobSetName" not in status
    assert status["message"].startswith(
        "spec.tpu.topology: org/private-70b full fine-tune with adamw in float32 needs ~209 GiB of host RAM "
        "per host to save a checkpoint"
    ), status["message"]
    assert "a ct5lp-hightpu-4t host has 192 GiB: use a larger topology" in status["message"]
    expected = {
        "Valid": ("False", "InvalidSpec"),  # as validation says it of the catalog's models
        "Failed": ("True", "HostRamExceeded"),
        "MemoryFits": ("False", "HostRamExceeded"),
        "DataPrepared": ("True", "Prepared"),
    }
    assert {t: (cond(status, t)["status"], cond(status, t)["reason"]) for t in expected} == expected
    figures = status["data"]["plan"]
    assert figures["params"] == PRIVATE_70B.params and figures["hostFits"] is False
    assert figures["hostPeakGiB"] > figures["hostRamGiB"] == 192
    # No JobSet, so no TPU, is ever asked for; on twice the hosts the same model runs.
    assert decide(ft, True, None, prepare=seen(job("Complete"), pods)) == Decision()
    larger = status_finetune(None, **{**SMALL_HOSTS, "tpu": {"type": "v5e", "topology": "4x8"}})
    assert decide(larger, True, None, prepare=seen(job("Complete"), pods)) == Decision(create=True)
    assert observe(larger, job("Complete"), pods)["data"]["plan"]["hostFits"] is True


def test_a_model_that_fits_goes_on_with_its_verdict_in_the_status() -> None:
    # A bucket model whose weights are .bin files: no count, the plan computes it from the dimensions.
    one_b = ModelFigures(2048, 16, 8192, 32, 8, 128256, tied_embeddings=True)
    ft = status_finetune(
        None,
        model={"name": "gs://bucket/models/private-1b"},
        tpu={"type": "v5e", "topology": "2x2"},
        training={"maxSteps": 25, "method": "lora", "perDeviceBatchSize": 2},
    )
    status = observe(ft, job("Complete"), reported(one_b))
    assert status["phase"] == "Pending"
    fits = cond(status, "MemoryFits")
    assert (fits["status"], fits["reason"]) == ("True", "Fits")
    assert "1.24 B parameters" in fits["message"] and "of its 192 GiB (ct5lp-hightpu-4t)" in fits["message"]
    figures = status["data"]["plan"]
    assert figures["params"] == plan.dims_from_figures(one_b, "").params
    assert figures["hbmFits"] is figures["hostFits"] is True
    assert figures["hbmEstimateGiB"] < figures["hbmUsableGiB"] == 14.4
    assert decide(ft, True, None, prepare=seen(job("Complete"), reported(one_b))) == Decision(create=True)


def test_an_hbm_estimate_over_the_chips_is_said_with_what_to_change_but_never_refused() -> None:
    eight_b = ModelFigures(4096, 32, 14336, 32, 8, 128256, params=8_030_261_248)
    ft = status_finetune(
        None,
        model={"name": "org/private-8b"},
        tpu={"type": "v5e", "topology": "2x2"},
        training={"maxSteps": 25, "method": "full", "optimizer": "adamw"},
    )
    status = observe(ft, job("Complete"), reported(eight_b))
    assert status["phase"] == "Pending"  # the JobSet comes next
    over = cond(status, "MemoryFits")
    assert (over["status"], over["reason"]) == ("False", "HbmEstimateExceeded")
    assert "GiB per chip, exceeds 90% of HBM (14.40 GiB of 16 GiB)" in over["message"]
    assert "Try: " in over["message"] and "training.method: lora" in over["message"]
    assert "The run goes on" in over["message"]
    figures = status["data"]["plan"]
    assert figures["hbmFits"] is False and figures["hostFits"] is True
    assert figures["hbmEstimateGiB"] > figures["hbmUsableGiB"]
    assert decide(ft, True, None, prepare=seen(job("Complete"), reported(eight_b))) == Decision(create=True)


def test_without_the_models_figures_there_is_no_verdict_and_the_run_goes_on() -> None:
    """An older trainer's summary, or a config it read no dimensions from: validation's word stands."""
    ft = status_finetune(None, **SMALL_HOSTS)
    status = observe(ft, job("Complete"), reported(None))
    assert status["phase"] == "Pending" and "plan" not in status["data"]
    assert all(c["type"] != "MemoryFits" for c in status["conditions"])


def test_the_summary_carries_the_models_figures_and_an_older_summary_still_parses() -> None:
    new = replace(SUMMARY, model=PRIVATE_70B)
    assert PrepareSummary.from_message(new.to_message()) == new
    # What a trainer before the figures wrote: parsed as it was, with no model.
    old = (
        '{"documents":1000,"dropped":3,"evalRows":20,"fingerprint":"a1b2c3","lossTokens":327680,'
        '"positions":655360,"reused":false,"rows":640,"seconds":42.4,"tokensPerSecond":15000.0}'
    )
    assert PrepareSummary.from_message(old) == SUMMARY
    # A malformed model leaves the data's figures standing.
    body = json.loads(new.to_message())
    for broken in (
        {**body["model"], "numLayers": "80"},
        {"hiddenSize": 8192},
        [1, 2],
        {**body["model"], "gatedMlp": 1},
    ):
        assert PrepareSummary.from_message(json.dumps({**body, "model": broken})) == SUMMARY, broken
    # The largest figures stay far within the termination message's limit.
    huge = PrepareSummary(
        fingerprint="f" * 128,
        reused=False,
        documents=10**12,
        dropped=10**12,
        rows=10**12,
        positions=10**15,
        loss_tokens=10**15,
        eval_rows=10**12,
        seconds=1e6 / 7,
        tokens_per_second=1e9 / 7,
        model=replace(PRIVATE_70B, head_dim=256, experts=256, experts_per_token=16, params=10**13),
    )
    assert len(huge.to_message().encode()) < SUMMARY_LIMIT // 4


def test_the_reconciler_fails_a_run_no_host_can_hold_without_a_jobset_and_says_why() -> None:
    run = new_run()
    run["spec"].update(copy.deepcopy(SMALL_HOSTS))
    api, events = JobApi(run), ReasonsAndMessages()
    r, _ = reconciler(api)
    r.reconcile(run, None, [], event=events)
    created = api.bodies[-1]
    assert created["kind"] == "Job"
    live = preparing.slim_job({**created, "metadata": {**created["metadata"], "uid": "job-1"}})
    live["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    r.reconcile(
        {**run, "status": api.last_status}, None, reported(PRIVATE_70B), event=events, prepare_job=live
    )
    assert ("create", "JobSet") not in api.calls
    assert api.last_status["phase"] == "Failed"
    assert events.posted[-2:] == ["Failed", "DataPrepared"]
    assert events.messages["Failed"].startswith("spec.tpu.topology: org/private-70b full fine-tune")


def test_the_reconciler_warns_once_of_an_hbm_estimate_over_the_chips_and_starts_the_run() -> None:
    run = new_run()
    run["spec"]["training"] = {"maxSteps": 25, "method": "full", "optimizer": "adamw"}
    run["spec"]["model"] = {"name": "org/private-8b"}
    api, events = JobApi(run), ReasonsAndMessages()
    r, _ = reconciler(api)
    r.reconcile(run, None, [], event=events)
    created = api.bodies[-1]
    live = preparing.slim_job({**created, "metadata": {**created["metadata"], "uid": "job-1"}})
    live["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    pods = reported(ModelFigures(4096, 32, 14336, 32, 8, 128256))
    r.reconcile({**run, "status": api.last_status}, None, pods, event=events, prepare_job=live)
    assert ("create", "JobSet") in api.calls
    assert events.posted.count("HbmEstimateExceeded") == 1
    assert "Try: " in events.messages["HbmEstimateExceeded"]
    js = {"metadata": {"name": "run", "namespace": "ns", "ownerReferences": OURS}, "spec": {}, "status": {}}
    r.reconcile({**run, "status": api.last_status}, js, pods, event=events, prepare_job=live)
    assert events.posted.count("HbmEstimateExceeded") == 1
