"""The prepare Job, as the reconcile and the status see it: pure functions of what was observed.

A run with spec.prepare.enabled (the default) gets no JobSet until its data is prepared: the Job of
render/prepare_job.py runs `tpuft prepare` on CPU, and its pod's termination message carries the
figures (tpuft_trainer/prepare_contract.py) or the trainer's error. What the reconcile needs to know:

- `is_prepared`: the status already says the data of these settings is prepared (condition
  DataPrepared True and status.data.settingsHash equal): never prepare again (restart, resume, a
  deleted JobSet recreated);
- `job_state`: where the current Job stands (`JobState`), from the Job and its pods;
- `data_status`: status.data from a summary and the spec (steps per epoch, epochs covered);
- `memory_verdict`: the plan's HBM and host-RAM verdict (plan.py) recomputed with the model's real
  dimensions, which the prepare pod read from its config.json and weight files' headers: for any
  model, not only those of the plan's catalog that validation can judge. A host that cannot hold the
  run fails it before the JobSet (on spec.tpu.topology, as validation does for the catalog's models);
  an HBM estimate over capacity is said (condition MemoryFits=False, a Warning Event) but never
  refused: that estimate is too rough to block a run (plan.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tpuft_operator import plan
from tpuft_operator.api.validation import SpecError, parse_run
from tpuft_operator.render.jobset import FINETUNE_LABEL, FINETUNE_UID_LABEL
from tpuft_operator.render.prepare_job import (
    COMPONENT_LABEL,
    DATA_SETTINGS_LABEL,
    JOB_UID_LABEL,
    PREPARE_COMPONENT,
)
from tpuft_trainer.exit_codes import ExitCode, is_user_error
from tpuft_trainer.prepare_contract import PrepareSummary, parse_error

Obj = Mapping[str, Any]
DATA_PREPARED = "DataPrepared"
MEMORY_FITS = "MemoryFits"  # the plan's verdict with the model's real dimensions
HOST_RAM_EXCEEDED = "HostRamExceeded"  # a host cannot hold the run: it fails before the JobSet
HBM_ESTIMATE_EXCEEDED = "HbmEstimateExceeded"  # said, with what to change; the run goes on


class Stage(StrEnum):
    ABSENT = "Absent"  # no Job (yet, or any more)
    STALE = "Stale"  # a Job of other data settings: to be replaced
    RUNNING = "Running"  # pending, running, or retrying
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class JobState:
    stage: Stage
    summary: PrepareSummary | None = None  # SUCCEEDED: the figures (None: the pod said nothing)
    reason: str = ""  # FAILED: a CamelCase reason
    message: str = ""  # what the status says
    user_error: bool = False  # FAILED by the trainer's exit codes 64-78


@dataclass(frozen=True)
class PrepareSeen:
    """What derive_status and decide look at of a run's preparation."""

    settings_hash: str  # of the spec's data settings (render/prepare_job.py data_settings_hash)
    job: Obj | None = None  # the run's prepare Job (slim_job)
    pods: Sequence[Obj] = ()  # that Job's pods

    def state(self) -> JobState:
        return job_state(self.job, self.pods, self.settings_hash)


def is_prepare_pod(pod: Obj) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL) == PREPARE_COMPONENT


def split_pods(pods: Sequence[Obj]) -> tuple[list[Obj], list[Obj]]:
    """(the TPU pods, the prepare pods) of a run's pods (both carry the run's label)."""
    tpu: list[Obj] = []
    prepare: list[Obj] = []
    for pod in pods:
        (prepare if is_prepare_pod(pod) else tpu).append(pod)
    return tpu, prepare


def slim_job(body: Obj) -> dict[str, Any]:
    """What the reconcile reads of a prepare Job (its watch keeps only this)."""
    meta = body.get("metadata") or {}
    labels = {
        k: v
        for k, v in (meta.get("labels") or {}).items()
        if k in (FINETUNE_LABEL, FINETUNE_UID_LABEL, COMPONENT_LABEL, DATA_SETTINGS_LABEL)
    }
    owners = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    status = body.get("status") or {}
    kept = ("conditions", "active", "ready", "failed", "succeeded", "startTime", "completionTime")
    return {
        "metadata": {
            **{
                k: meta[k]
                for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp")
                if k in meta
            },
            "labels": labels,
            **({"ownerReferences": owners} if owners else {}),
        },
        "status": {k: status[k] for k in kept if k in status},
    }


def settings_hash_of(job: Obj) -> str | None:
    return ((job.get("metadata") or {}).get("labels") or {}).get(DATA_SETTINGS_LABEL)


def _condition(obj: Obj | None, type_: str) -> Obj | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return dict(cond)
    return None


def is_prepared(finetune: Obj, settings_hash: str) -> bool:
    """Whether the run's status says the data of ``settings_hash`` is prepared already."""
    status = finetune.get("status") or {}
    data = status.get("data") or {}
    return data.get("settingsHash") == settings_hash and _condition(finetune, DATA_PREPARED) is not None


def _terminations(pods: Sequence[Obj]) -> list[tuple[str, Obj]]:
    """(pod name, the container's terminated state) of every finished prepare container, newest pod first."""
    found: list[tuple[str, Obj]] = []
    ordered = sorted(pods, key=lambda p: str((p.get("status") or {}).get("startTime") or ""), reverse=True)
    for pod in ordered:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated")
            if terminated:
                found.append((str((pod.get("metadata") or {}).get("name")), dict(terminated)))
    return found


def exit_reason(code: int) -> str:
    """A condition reason for a trainer exit code: its name in CamelCase (DATA_ERROR -> DataError)."""
    try:
        name = ExitCode(code).name
    except ValueError:
        return "PrepareFailed"
    return "".join(part.title() for part in name.split("_"))


def _describe(code: int) -> str:
    try:
        return f"exit code {code} ({ExitCode(code).name})"
    except ValueError:
        return f"exit code {code}"


def job_state(job: Obj | None, pods: Sequence[Obj], settings_hash: str) -> JobState:
    """Where the run's prepare Job stands, from the Job and its pods (the prepare pods only)."""
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        return JobState(Stage.ABSENT, message="creating the prepare Job")
    name = str(job["metadata"].get("name"))
    if settings_hash_of(job) != settings_hash:
        return JobState(
            Stage.STALE,
            message=f"the data settings changed since Job {name} was made: replacing it to prepare again",
        )
    uid = job["metadata"].get("uid")
    own = [p for p in pods if not uid or _job_uid(p) in (None, uid)]
    finished = _terminations(own)
    if _condition(job, "Complete") is not None:
        summary = next(
            (s for _, t in finished if (s := PrepareSummary.from_message(str(t.get("message") or "")))), None
        )
        return JobState(Stage.SUCCEEDED, summary=summary, message=prepared_message(summary))
    failed = _condition(job, "Failed")
    if failed is not None:
        return _failure(name, failed, finished)
    return JobState(Stage.RUNNING, message=_running_message(name, job, own))


def _job_uid(pod: Obj) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_UID_LABEL)


def _failure(name: str, failed: Obj, finished: list[tuple[str, Obj]]) -> JobState:
    """The run's failure: the trainer's own words when its pod said them (the user error first)."""
    errors = []
    for pod, terminated in finished:
        code = int(terminated.get("exitCode") or 0)
        if code == 0:
            continue
        parsed = parse_error(str(terminated.get("message") or ""))
        errors.append((pod, code, parsed[0] if parsed else None))
    errors.sort(key=lambda e: not is_user_error(e[1]))
    if errors and is_user_error(errors[0][1]):
        pod, code, said = errors[0]
        words = said or "the trainer gave no message (see the pod's log)"
        message = (
            f"preparing the data failed with a user error, {_describe(code)} on pod {pod}: {words}; no TPU "
            "was requested (fix the spec or the data and recreate the TPUFineTune)"
        )
        return JobState(Stage.FAILED, reason=exit_reason(code), message=message, user_error=True)
    why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or 'the Job failed'}"
    last = ""
    if errors:
        pod, code, said = errors[0]
        last = f"; the last attempt ended with {_describe(code)} on pod {pod}" + (f": {said}" if said else "")
    message = (
        f"preparing the data failed (Job {name}, {why}){last}; no TPU was requested. An infrastructure "
        "failure was retried by the Job; raise spec.prepare.resources or deadlineSeconds if it ran out of "
        "memory or time, and recreate the TPUFineTune"
    )
    return JobState(Stage.FAILED, reason="PrepareFailed", message=message)


def _running_message(name: str, job: Obj, pods: Sequence[Obj]) -> str:
    status = job.get("status") or {}
    retries = int(status.get("failed") or 0)
    again = f" (attempt {retries + 1})" if retries else ""
    for pod in pods:
        cond = next(
            (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"),
            None,
        )
        if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return (
                f"preparing the data: the prepare pod of Job {name} cannot be scheduled{again} (a CPU node with "
                "the requests of spec.prepare.resources, matching spec.prepare.nodeSelector and "
                f"tolerations); the scheduler says: {cond.get('message') or 'unschedulable'}"
            )
    if any((p.get("status") or {}).get("phase") == "Running" for p in pods):
        return f"preparing the data on CPU (Job {name}){again}; no TPU is requested until it is done"
    return f"preparing the data: waiting for the pod of Job {name} to start{again}"


def prepared_message(summary: PrepareSummary | None) -> str:
    if summary is None:
        return "the data is prepared (the prepare pod reported no figures)"
    how = "found prepared already (reused)" if summary.reused else f"prepared in {summary.seconds:.0f} s"
    return (
        f"{summary.rows} rows of {summary.documents} documents ({summary.dropped} dropped), "
        f"{summary.eval_rows} evaluation rows, {how}: {summary.fingerprint}"
    )


def memory_verdict(finetune: Obj, summary: PrepareSummary | None) -> plan.MemoryVerdict | None:
    """The plan's verdict on run ``finetune`` with the model's dimensions in ``summary``; None when the
    prepare pod reported none (an older trainer, a config it could not read them from) or the spec
    does not validate (its condition Valid says why). Parsed from the object itself, so the status
    derived from the same observations is the same whichever operator process derives it."""
    if summary is None or summary.model is None:
        return None
    try:
        run = parse_run(
            {k: finetune[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in finetune},
            check_host_ram=False,  # judged here, with the real dimensions
        )
    except SpecError:
        return None
    source = f"{run.finetune.spec.model.name} as the prepare Job read it"
    return plan.memory_verdict(run.finetune, plan.dims_from_figures(summary.model, source))


def host_refusal_message(verdict: plan.MemoryVerdict) -> str:
    """Why the run fails before its JobSet: the field, then the reason with its figures."""
    return (
        f"spec.tpu.topology: {verdict.host_refusal}; found with the model's dimensions as the prepare Job "
        "read them, before any TPU was requested (change the spec and recreate the TPUFineTune)"
    )


def memory_condition(verdict: plan.MemoryVerdict) -> tuple[str, str, str]:
    """Condition MemoryFits: (status, reason, message)."""
    if verdict.host_refusal is not None:
        return "False", HOST_RAM_EXCEEDED, host_refusal_message(verdict)
    if verdict.hbm_warning is not None:
        return (
            "False",
            HBM_ESTIMATE_EXCEEDED,
            f"with the model's real dimensions (as the prepare Job read them) {verdict.hbm_warning} The run "
            "goes on: the HBM estimate is too rough to refuse a run on (docs/plan.md); the trainer exits with "
            "OUT_OF_MEMORY (78) if the chips run out",
        )
    return "True", "Fits", f"the plan with the model's real dimensions fits: {verdict.summary()}"


def data_status(
    summary: PrepareSummary | None,
    settings_hash: str,
    *,
    global_batch: int | None,
    max_steps: int | None,
    verdict: plan.MemoryVerdict | None = None,
) -> dict[str, Any]:
    """status.data for ``summary`` (camelCase, as the API's DataStatus), with the plan's ``verdict``
    recomputed from it (status.data.plan)."""
    data: dict[str, Any] = {"settingsHash": settings_hash}
    if summary is None:
        return data
    data.update(
        fingerprint=summary.fingerprint,
        reused=summary.reused,
        documents=summary.documents,
        droppedDocuments=summary.dropped,
        rows=summary.rows,
        positions=summary.positions,
        lossTokenShare=round(summary.loss_tokens / summary.positions, 4) if summary.positions else 0.0,
        evalRows=summary.eval_rows,
        preparedSeconds=round(summary.seconds, 1),
    )
    if global_batch:
        # The trainer drops the last partial batch (dataloader_drop_last: one compiled shape).
        steps = summary.rows // global_batch
        data["stepsPerEpoch"] = steps
        if max_steps and steps:
            data["epochsCovered"] = round(max_steps / steps, 2)
    if verdict is not None:
        gib = float(plan.GIB)
        data["plan"] = {
            "params": verdict.params,
            "hbmEstimateGiB": round(verdict.hbm_estimate_bytes / gib, 2),
            "hbmUsableGiB": round(verdict.hbm_usable_bytes / gib, 2),
            "hbmFits": verdict.hbm_fits,
            "hostPeakGiB": round(verdict.host_peak_bytes / gib, 2),
            "hostRamGiB": verdict.host_ram_bytes // plan.GIB,
            "hostFits": verdict.host_fits,
        }
    return data
