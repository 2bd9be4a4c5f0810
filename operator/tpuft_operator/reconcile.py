"""The reconcile step: from one TPUFineTune and what exists for it, to API calls. Level-triggered.

Every event (of the TPUFineTune, its JobSet, or one of its pods) and a periodic resync lead here with
the latest observed objects, taken from the operator's in-memory stores (no list calls per event).
What to do is decided by the pure `decide`; `Reconciler.reconcile` only carries it out. Running it
twice does no harm: objects are created by deterministic name (adopted if they exist) and the
status is patched only when it differs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tpuft_operator import maintenance, metrics, preparing, queueing, trainer_stack
from tpuft_operator.api.models import Phase, TPUFineTune
from tpuft_operator.api.policy import AdminPolicy, policy_errors
from tpuft_operator.api.validation import FieldError, SpecError, parse_run
from tpuft_operator.goodput import parse_time
from tpuft_operator.jobset_crd import NOT_INSTALLED, TOO_OLD, Shortfall
from tpuft_operator.k8s import Api, ApiError, NameTaken, controller_uid
from tpuft_operator.pacing import WritePace
from tpuft_operator.preparing import PrepareSeen, Stage
from tpuft_operator.render import RenderedRun, RenderSettings, naming, render_run
from tpuft_operator.render.identity import namespace_objects
from tpuft_operator.render.prepare_job import PREPARE_SUFFIX
from tpuft_operator.runs import RefusalCheck, Render, RunBook, RunState
from tpuft_operator.slim import slim_jobset
from tpuft_operator.status import (
    EARLIER_RESTARTS_ANNOTATION,
    TERMINAL_PHASES,
    Observed,
    current_pods,
    derive_status,
    is_final,
    status_patch,
)
from tpuft_operator.topology import SliceShape
from tpuft_trainer.pod_contract import CHECKPOINT_REQUEST_ANNOTATION

Obj = Mapping[str, Any]
K = TypeVar("K")
# How often the shared per-namespace progress identity is re-checked (it is created once).
NAMESPACE_IDENTITY_RECHECK = 600.0
# (type "Normal"/"Warning", reason, message) -> posted on the TPUFineTune
EventSink = Callable[[str, str, str], None]
Log = logging.Logger | logging.LoggerAdapter[logging.Logger]
# Conditions that post a Warning Event (reason = the condition type) when they become True.
WARNING_CONDITIONS = ("MaintenanceScheduled", "CheckpointSlow", "CheckpointSkipped", "ReplicaFailure")
# A JobSet's pods missing this long after it was created: ask whether the apiserver refused them
# (the Job's FailedCreate events), then again after twice the wait, up to REFUSAL_CHECK_MAX.
REFUSAL_CHECK_AFTER = 2.0
REFUSAL_CHECK_MAX = 30.0
# The namespace's refusal Events, once listed, serve every run that looks within this many seconds:
# under a burst, 300 runs whose pods were slow to appear listed them ~9 times each (2766 lists at
# N=300 in the benchmark, each of a namespace holding thousands of Events).
REFUSAL_LIST_TTL = 2.0
# Not refusals: with exclusive placement the JobSet pod webhook refuses a slice's followers until
# its leader is scheduled, by design (sigs.k8s.io/jobset pkg/webhooks/pod_webhook.go, "an expected,
# transient error"); the leader's own condition (Unschedulable) says why then.
JOBSET_FOLLOWER_WAIT = ("follower pod node selector", "leader pod not yet scheduled")


@dataclass(frozen=True)
class Decision:
    """What the reconciler should do for one run, decided from observations alone."""

    create: bool = False  # create (or adopt) the identity and the JobSet
    recreated: bool = False  # the JobSet existed before and someone deleted it
    set_suspend: bool | None = None  # merge-patch JobSet spec.suspend to this value
    # merge-patch the Kueue Workload's spec.active to this value (a queued run's spec.suspend)
    set_workload_active: bool | None = None
    create_prepare_job: bool = False  # create (or adopt) the prepare Job (render/prepare_job.py)
    delete_prepare_job: bool = False  # delete the prepare Job: it prepares for other data settings


def decide(
    finetune: Obj,
    valid: bool,
    jobset: Obj | None,
    workload: Obj | None = None,
    prepare: PrepareSeen | None = None,
) -> Decision:
    """``valid``: the spec renders (else nothing is created; the status says why). ``workload``:
    Kueue's Workload of the JobSet, for a run with spec.queueName. ``prepare``: the run's data
    preparation (None: spec.prepare.enabled is false): no JobSet before the data is prepared."""
    if not valid:
        return Decision()
    status = finetune.get("status") or {}
    if is_final(finetune, jobset):
        return Decision()  # finished runs are never restarted or recreated
    if jobset is None:
        if prepare is not None and not preparing.is_prepared(finetune, prepare.settings_hash):
            state = prepare.state()
            stage = state.stage
            if stage is Stage.ABSENT:
                return Decision(create_prepare_job=True)
            if stage is Stage.STALE:
                return Decision(delete_prepare_job=True)
            if stage is not Stage.SUCCEEDED:
                return Decision()  # preparing; or failed, which the status says (and then is final)
            verdict = preparing.memory_verdict(finetune, state.summary)
            if verdict is not None and verdict.host_refusal is not None:
                return Decision()  # a host cannot hold the run: the status fails it, no TPU is asked for
        return Decision(create=True, recreated=bool(status.get("jobSetName")))
    spec = finetune.get("spec") or {}
    want_suspended = bool(spec.get("suspend"))
    is_suspended = bool((jobset.get("spec") or {}).get("suspend"))
    # A queued run is held through Kueue: Kueue unsuspends a JobSet whose Workload it admits (even
    # one we suspended), and admits nothing of an inactive Workload (an admitted one it evicts).
    active = None
    held = workload is not None and not bool((workload.get("spec") or {}).get("active", True))
    # Never undo Kueue's own deactivation (a requeuing limit): the Queued condition says so.
    kueues = workload is not None and queueing.deactivated_by_kueue(workload)
    if (
        spec.get("queueName")
        and workload is not None
        and held != want_suspended
        and (want_suspended or not kueues)
    ):
        active = not want_suspended
    if want_suspended and not is_suspended:
        return Decision(set_suspend=True, set_workload_active=active)
    if active is not None:
        return Decision(set_workload_active=active)
    if not want_suspended and is_suspended and not spec.get("queueName"):
        # With a queue, Kueue decides when to unsuspend; we never race it.
        return Decision(set_suspend=False)
    return Decision()


_EVENT_FOR_PHASE = {
    Phase.PREPARING: ("Normal", "Preparing"),
    Phase.PENDING: ("Normal", "Pending"),
    Phase.QUEUED: ("Normal", "Queued"),
    Phase.SUSPENDED: ("Normal", "Suspended"),
    Phase.RUNNING: ("Normal", "Running"),
    Phase.SUCCEEDED: ("Normal", "Succeeded"),
    Phase.FAILED: ("Warning", "Failed"),
}


@dataclass
class Desired:
    """What the spec asks for: the objects to create (only when they are needed), the slice's shape, or
    why it cannot be had (the field and the reason)."""

    rendered: RenderedRun | None = None
    shape: SliceShape | None = None
    spec_error: tuple[str, str] | None = None


@dataclass
class Created:
    """What creating (or adopting) a run's objects came to."""

    jobset: Obj | None = None
    prepare_job: Obj | None = None  # the prepare Job created (or adopted)
    prepare_refused: str | None = None  # why the apiserver did not create it (retried)
    name_taken: str | None = None  # another's object holds one of the run's names: the run fails
    error: ApiError | None = None  # retryable: the status says so and the resync retries
    # Nothing was tried: the cluster's JobSet is missing or too old (jobset_crd.py); the resync retries.
    shortfall: Shortfall | None = None


@dataclass(frozen=True)
class Seen:
    """What a reconcile knows of a run besides its TPUFineTune: what the watches showed, updated by the
    reconcile's own writes (the JobSet it created, the Workload it released) before the status is derived."""

    jobset: Obj | None
    pods: Sequence[Obj]
    nodes: Mapping[str, Obj]  # the nodes its pods run on, by name
    workload: Obj | None  # Kueue's Workload of its JobSet
    prepare_job: Obj | None = None  # its prepare Job (preparing.slim_job)
    prepare_pods: Sequence[Obj] = ()  # that Job's pods (not in ``pods``)


class KeyedLocks(Generic[K]):
    """One lock per key (a namespace, say), made on first use. Safe from any thread."""

    def __init__(self) -> None:
        self._locks: dict[K, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, key: K) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())


class RefusalEvents:
    """Each namespace's refusal Events (k8s.Api.creation_failures), listed at most once every
    REFUSAL_LIST_TTL seconds whatever the number of runs that look meanwhile."""

    def __init__(self) -> None:
        self._listed: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._locks: KeyedLocks[str] = KeyedLocks()

    def of(self, api: Api, namespace: str) -> list[dict[str, Any]]:
        lock = self._locks.of(namespace)
        with lock:  # the runs that look at once wait for one list
            listed = self._listed.get(namespace)
            if listed is not None and time.monotonic() - listed[0] < REFUSAL_LIST_TTL:
                return listed[1]
            events = api.creation_failures(namespace)
            self._listed[namespace] = (time.monotonic(), events)
            return events


class NamespaceIdentities:
    """Each namespace's shared trainer identity (render/identity.py), created once by this process and
    checked again every NAMESPACE_IDENTITY_RECHECK seconds, so that a deleted one comes back.

    In two parts, because neither needs to be on the path of a run's JobSet:

    - The ServiceAccount (`send_account`) must exist before the JobSet's *pods* are created (the
      apiserver refuses a pod of a missing account), and those come at least two controller hops
      after the JobSet is stored (the JobSet controller creates its Jobs, the Job controller their
      pods). So its create is sent, on a thread of its own, and the JobSets of the namespace's first
      runs are sent right behind it instead of after its answer: under a burst, waiting for that
      answer held the first wave of a new namespace ~0.1-0.2 s (docs/benchmarks.md). Should the
      account lose the race anyway, the Job controller's retry of the pod creates it (~1 s later).
    - The progress Role and RoleBinding (`ensure_progress`) only serve the trainer's first progress
      report, many seconds later. A RoleBinding create is slow (~100 ms on an idle apiserver, the
      escalation check), and nobody waits for another reconcile's."""

    def __init__(self) -> None:
        self._checked: dict[tuple[str, str], float] = {}  # (namespace, part) -> when it was made sure of
        self._accounts: dict[str, Future[None]] = {}  # each namespace's account create in flight
        self._guard = threading.Lock()
        self._locks: KeyedLocks[str] = KeyedLocks()

    def _fresh(self, namespace: str, part: str) -> bool:
        checked = self._checked.get((namespace, part))
        return checked is not None and time.monotonic() - checked < NAMESPACE_IDENTITY_RECHECK

    def send_account(self, api: Api, namespace: str, log: Log) -> Future[None] | None:
        """Sends the create of the namespace's trainer ServiceAccount unless this process made sure
        of it lately; returns its answer to come (None when there is nothing to wait for). One create
        per namespace at a time: the runs that arrive meanwhile get the same one (each racer would
        get a 409). A failure is logged and forgotten, so the next call tries again."""
        if self._fresh(namespace, "account"):
            return None
        with self._guard:
            if self._fresh(namespace, "account"):
                return None
            sent = self._accounts.get(namespace)
            if sent is not None:
                return sent
            sent = self._accounts[namespace] = Future()
        account = next(obj for obj in namespace_objects(namespace) if obj["kind"] == "ServiceAccount")

        def create() -> None:
            try:
                if api.ensure(account):
                    log.info("created ServiceAccount %s/%s", namespace, account["metadata"]["name"])
                self._checked[(namespace, "account")] = time.monotonic()
                sent.set_result(None)
            except BaseException as error:  # handed to whoever waits; logged here for the others
                log.warning("cannot create the namespace's trainer ServiceAccount yet: %s", error)
                sent.set_exception(error)
            finally:
                with self._guard:
                    self._accounts.pop(namespace, None)

        threading.Thread(target=create, name=f"tpuft-account-{namespace}", daemon=True).start()
        return sent

    def ensure_progress(self, api: Api, namespace: str, log: Log, *, wait: bool = False) -> None:
        """Creates what is missing of the namespace's progress Role and RoleBinding. ``wait``: while
        another reconcile creates them, wait for it (a run's own progress RoleBinding binds the
        namespace's Role, which must exist first: the apiserver's escalation check reads it, 404
        otherwise); else return at once: another reconcile is on it, and the next one retries if that
        one fails (waiting there held every worker behind two slow RBAC creates)."""
        if self._fresh(namespace, "progress"):
            return
        lock = self._locks.of(namespace)
        if not lock.acquire(blocking=wait):
            return
        try:
            if self._fresh(namespace, "progress"):
                return
            for obj in namespace_objects(namespace):
                if obj["kind"] != "ServiceAccount" and api.ensure(obj):
                    log.info("created %s %s/%s", obj["kind"], namespace, obj["metadata"]["name"])
            self._checked[(namespace, "progress")] = time.monotonic()
        finally:
            lock.release()


@dataclass
class Reconciler:
    """Carries out `decide` for one run at a time, as a short sequence of steps (`_reconcile`)."""

    api: Api
    render_settings: RenderSettings
    # What runs may ask for (api/policy.py): checked before anything is created for a run.
    policy: AdminPolicy = field(default_factory=AdminPolicy)
    # Asks for another reconcile of a run after a delay: the worker runtime's `defer` (runtime.py).
    defer: Callable[[tuple[str, str], float], None] = lambda key, delay: None
    # A run's first status waits this long after its JobSet is created (see `_settling`).
    status_settle_seconds: float = 0.0
    # The pace of status patches, shared with the Events (pacing.py); by default no limit.
    pace: WritePace = field(default_factory=lambda: WritePace(0, 1))
    # Least report time between two refreshes of a running run's status.goodput (goodput.py).
    goodput_interval_seconds: float = 60.0
    # Why no JobSet may be created now, else None: the cluster's JobSet CRD is missing or lacks a
    # field tpuft renders (jobset_crd.InstalledJobSet.shortfall, which main.py wires in).
    jobset_shortfall: Callable[[], Shortfall | None] = lambda: None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tpuft.reconcile"))
    # Everything this process knows about each run beyond its watches (runs.py).
    runs: RunBook = field(default_factory=RunBook)
    identities: NamespaceIdentities = field(default_factory=NamespaceIdentities)
    refusals: RefusalEvents = field(default_factory=RefusalEvents)

    def forget(self, finetune: Obj) -> None:
        """The run's TPUFineTune is gone: drop what this process knew of it."""
        meta = finetune["metadata"]
        self.runs.drop(str(meta.get("uid")))
        metrics.forget_run((str(meta["namespace"]), str(meta["name"])))

    def forget_all_but(self, uids: Collection[str], *, seen_before: float) -> None:
        """Drops the state of every run not in ``uids``, the runs the watch held at monotonic time
        ``seen_before`` (a deletion whose watch event was missed)."""
        for state in self.runs.retain(uids, seen_before=seen_before):
            metrics.forget_run(state.key)

    def has_jobset(self, finetune: Obj) -> bool:
        """Whether this process created or adopted the run's JobSet and has not seen it deleted (its
        watch may not show it yet: `_jobset_of_record`)."""
        state = self.runs.get(str(finetune["metadata"].get("uid")))
        return state is not None and state.jobset is not None

    def jobset_deleted(self, finetune: Obj) -> None:
        """The run's JobSet is gone (its watch says so): stop standing in for it."""
        state = self.runs.get(str(finetune["metadata"].get("uid")))
        if state is not None:
            state.jobset = None

    def reconcile(
        self,
        finetune: Obj,
        jobset: Obj | None,
        pods: Sequence[Obj],
        *,
        event: EventSink,
        nodes: Mapping[str, Obj] | None = None,
        workload: Obj | None = None,
        prepare_job: Obj | None = None,
        logger: Log | None = None,
    ) -> None:
        """One reconcile of run ``finetune`` from what the watches show of it: its ``jobset`` (None if
        there is none), its ``pods`` (the TPU pods and its prepare Job's, told apart here), the
        ``nodes`` they run on by name (for maintenance signals), Kueue's ``workload`` of its JobSet
        (queueing.py), if any, and its ``prepare_job`` (render/prepare_job.py), if any."""
        log = logger or self.log
        if finetune["metadata"].get("deletionTimestamp"):
            return  # garbage collection removes what we made; nothing to do
        run = self.runs.of(finetune)
        started = time.perf_counter()
        tpu_pods, prepare_pods = preparing.split_pods(pods)
        if prepare_job is not None and controller_uid(prepare_job) != finetune["metadata"].get("uid"):
            prepare_job = None  # another run's (a label collision): never acted on
        seen = Seen(jobset, tpu_pods, nodes or {}, workload, prepare_job, prepare_pods)
        with run.lock:
            try:
                self._reconcile(run, finetune, seen, event, log)
                metrics.RECONCILES.labels(result="ok").inc()
            except Exception:
                metrics.RECONCILES.labels(result="error").inc()
                raise
            finally:
                log.debug("reconciled in %.3fs", time.perf_counter() - started)

    def _reconcile(self, run: RunState, finetune: Obj, seen: Seen, event: EventSink, log: Log) -> None:
        finetune = run.freshest(finetune)
        jobset = self._jobset_of_record(run, finetune, seen.jobset)
        desired = self._desired(run, finetune, objects_needed=jobset is None)
        workload = queueing.workload_of([seen.workload], jobset) if seen.workload is not None else None
        prepare = self._prepare_seen(run, desired, seen)
        decision = decide(finetune, desired.spec_error is None, jobset, workload, prepare)
        created = Created(jobset=jobset)
        if decision.delete_prepare_job and prepare is not None and prepare.job is not None:
            self._replace_prepare_job(finetune, prepare.job, event, log)
            prepare = PrepareSeen(prepare.settings_hash)
        if decision.create_prepare_job and desired.rendered is not None and prepare is not None:
            created = self._create_prepare_job(run, finetune, desired, event, log)
            if created.prepare_job is not None:
                prepare = PrepareSeen(prepare.settings_hash, created.prepare_job, seen.prepare_pods)
        if decision.create and desired.rendered is not None:
            shortfall = self.jobset_shortfall()
            if shortfall is None:
                created = self._create(run, finetune, desired, decision.recreated, event, log)
            else:
                created = Created(shortfall=shortfall)
            jobset = created.jobset
        elif jobset is not None:
            self._adopt_unrecorded(run, finetune, jobset, log)
        if jobset is not None:
            self._ensure_progress_identity(run.key[0], log)
        workload = self._hold_or_release(finetune, workload, decision, log)
        jobset = self._suspend_or_resume(finetune, jobset, decision, event, log)
        if jobset is not None:
            run.keep_only_shape()
        seen = Seen(jobset, seen.pods, seen.nodes, workload)
        self._write_status(run, finetune, seen, desired, created, event, log, prepare)
        if created.error is not None:
            raise created.error  # logged by the runtime; the resync retries

    def _jobset_of_record(self, run: RunState, finetune: Obj, jobset: Obj | None) -> Obj | None:
        """The run's own JobSet: the indexed one, else the one this process created or adopted.

        Under load the JobSet index lags the API by many seconds, so a reconcile can see no JobSet for
        a run whose JobSet exists: the remembered one stands in until the JobSet's own DELETED event
        (`jobset_deleted`) or the end of the run. Another run's JobSet under this run's label (a
        hand-made one, or a label collision of two long names) is never acted on: creating our own
        then says whose the name is."""
        jobset = jobset if jobset is not None else run.jobset
        if jobset is not None and controller_uid(jobset) != finetune["metadata"].get("uid"):
            return None
        return jobset

    def _desired(self, run: RunState, finetune: Obj, *, objects_needed: bool) -> Desired:
        """The run's render (cached per spec generation; only the shape once its JobSet exists), and
        the admin policy's verdict when its objects are about to be created."""
        result = self._render(run, finetune, full=objects_needed)
        if isinstance(result, SpecError):
            return Desired(spec_error=(result.field, result.reason))
        if isinstance(result, RenderedRun):
            return Desired(rendered=result, shape=result.shape)
        return Desired(shape=result)

    def _render(self, run: RunState, finetune: Obj, *, full: bool) -> Render:
        """The run's render, or only its shape when a cached one will do (``full``: the objects are
        needed, to create them; then the admin policy judges the spec too). The spec is parsed and
        validated once (`parse_run`: its shape resolved), and rendered from that."""
        generation = int(finetune["metadata"].get("generation") or 0)
        cached = run.render
        fresh = cached is not None and run.render_generation == generation
        if fresh and cached is not None and not full:
            return cached
        result: Render
        try:
            # The desired state depends on the spec alone; status and server-set metadata stay out.
            validated = parse_run(_desired_part(finetune))
            result = (
                cached
                if fresh and isinstance(cached, RenderedRun)
                else render_run(validated, self.render_settings)
            )
        except SpecError as error:
            run.render, run.render_generation = error, generation
            return error
        run.render, run.render_generation = result, generation
        if full:  # not kept: the verdict is asked again whenever objects are to be created
            return self._check_policy(validated.finetune) or result
        return result

    def _check_policy(self, finetune: TPUFineTune) -> SpecError | None:
        """The admin policy's verdict on a run about to get its JobSet (api/policy.py), as the
        admission policy gives it at creation: a run admitted before the policy was tightened keeps
        running (and is judged again only if its JobSet has to be recreated)."""
        broken = policy_errors(finetune, self.policy, self.render_settings.trainer_image)
        if not broken:
            return None
        return SpecError.of([FieldError(path, reason) for path, reason in broken])

    def _create(
        self, run: RunState, finetune: Obj, desired: Desired, recreated: bool, event: EventSink, log: Log
    ) -> Created:
        """Creates (or adopts) the run's objects: the namespace's trainer account (sent, its answer
        awaited after the JobSet's: see NamespaceIdentities), then its own objects and the JobSet."""
        rendered = desired.rendered
        assert rendered is not None
        jobset: Obj | None = None
        account = self.identities.send_account(self.api, run.key[0], self.log)
        try:
            if rendered.identity:  # the run's own RoleBinding (spec.serviceAccountName) binds the Role
                self.identities.ensure_progress(self.api, run.key[0], self.log, wait=True)
            for rendered_obj in rendered.objects:
                obj: Obj = rendered_obj
                if obj["kind"] == "JobSet" and recreated:
                    restarts_so_far = int((finetune.get("status") or {}).get("restarts") or 0)
                    obj = _with_earlier_restarts(obj, restarts_so_far)
                live, created = self.api.create_or_adopt(obj)
                if obj["kind"] != "JobSet":
                    continue
                jobset = run.jobset = slim_jobset(live)
                if created:
                    run.created_at = time.monotonic()
                _say_created(rendered, created=created, recreated=recreated, event=event, log=log)
        except NameTaken as taken:
            log.warning("cannot create the run's objects: %s; the run fails, the other is left alone", taken)
            event("Warning", "NameTaken", f"{taken}; rename this TPUFineTune")
            return Created(jobset=jobset, name_taken=str(taken))
        except ApiError as error:
            if error.status in (400, 422):
                # The apiserver refused an object rendered from a spec that passed our validation (a
                # pod rule we do not check): no retry can fix it, so the run fails saying why.
                log.warning("the spec renders to an object the apiserver refuses: %s", error)
                desired.rendered, desired.shape = None, None
                desired.spec_error = (
                    "spec",
                    f"the apiserver refused an object rendered from this spec: {error}",
                )
                return Created(jobset=jobset)
            if not error.retryable:
                raise
            # Said in the status (a webhook or the apiserver is down); logged, and the resync retries.
            return Created(jobset=jobset, error=error)
        try:
            if account is not None:
                account.result()  # the run's pods need it: a failure is raised, and the resync retries
        except ApiError as error:
            if not error.retryable:
                raise
            return Created(jobset=jobset, error=error)
        return Created(jobset=jobset)

    @staticmethod
    def _prepare_seen(run: RunState, desired: Desired, seen: Seen) -> PrepareSeen | None:
        """The run's preparation (None with spec.prepare.enabled false, or a spec that does not
        render). Once the JobSet exists only the shape of the render is kept, and its data settings'
        hash (RunState): the Job's figures are still read if the status does not have them yet (its
        first status after the JobSet's creation waits for the pods: status settling)."""
        rendered = desired.rendered
        if rendered is not None:
            return (
                PrepareSeen(rendered.data_settings_hash, seen.prepare_job, seen.prepare_pods)
                if rendered.prepare_job is not None
                else None
            )
        if desired.spec_error is None and run.data_settings_hash is not None:
            return PrepareSeen(run.data_settings_hash, seen.prepare_job, seen.prepare_pods)
        return None

    def _create_prepare_job(
        self, run: RunState, finetune: Obj, desired: Desired, event: EventSink, log: Log
    ) -> Created:
        """Creates (or adopts) the run's prepare Job, after sending the create of the namespace's
        trainer account its pod runs as (as for the JobSet: NamespaceIdentities)."""
        rendered = desired.rendered
        assert rendered is not None and rendered.prepare_job is not None
        job = rendered.prepare_job
        account = self.identities.send_account(self.api, run.key[0], self.log)
        try:
            live, created = self.api.create_or_adopt(job)
            if account is not None:
                account.result()  # its pod needs it: a failure is raised, and the resync retries
        except NameTaken as taken:
            log.warning("cannot create the prepare Job: %s; the run fails, the other is left alone", taken)
            event("Warning", "NameTaken", f"{taken}; rename this TPUFineTune")
            return Created(name_taken=str(taken))
        except ApiError as error:
            if error.status in (400, 422):
                log.warning("the spec renders to a prepare Job the apiserver refuses: %s", error)
                desired.rendered, desired.shape = None, None
                # Rendered from the spec's volumes, env and resources as much as from spec.prepare.
                desired.spec_error = (
                    "spec",
                    f"the apiserver refused an object rendered from this spec: {error}",
                )
                return Created()
            # A quota on Jobs, a webhook, RBAC, the apiserver down: said in the status (ReplicaFailure,
            # in the apiserver's words), and tried again at each reconcile until it is cured.
            log.warning("cannot create the prepare Job yet: %s", error)
            return Created(prepare_refused=str(error))
        name = job["metadata"]["name"]
        if created:
            container = job["spec"]["template"]["spec"]["containers"][0]
            requests = container["resources"]["requests"]
            message = (
                f"created Job {name} to prepare the data on CPU (cpu {requests['cpu']}, memory "
                f"{requests['memory']}) before requesting {rendered.shape.chips} TPU chips"
            )
            log.info("%s", message)
            event("Normal", "PrepareJobCreated", message)
        else:
            log.info("adopted existing prepare Job %s", name)
        return Created(prepare_job=preparing.slim_job(live))

    def _replace_prepare_job(self, finetune: Obj, job: Obj, event: EventSink, log: Log) -> None:
        """Deletes a prepare Job of other data settings; its DELETED event brings the reconcile that
        creates the new one (a create now could meet the old one still there, 409, and adopt it)."""
        meta = job["metadata"]
        self.api.delete_job(str(meta["namespace"]), str(meta["name"]), uid=meta.get("uid"))
        message = f"the data settings changed: deleted prepare Job {meta['name']} to prepare again"
        log.info("%s", message)
        event("Normal", "PrepareJobReplaced", message)

    def _ensure_progress_identity(self, namespace: str, log: Log) -> None:
        """The namespace's progress Role and RoleBinding, once its run has a JobSet (see
        NamespaceIdentities), and its trainer account again if an earlier create failed (its pods
        wait for it: nothing else would retry it once the JobSets exist). A failure is logged, and
        the next reconcile of any run of the namespace tries again."""
        self.identities.send_account(self.api, namespace, self.log)
        try:
            self.identities.ensure_progress(self.api, namespace, self.log)
        except ApiError as error:
            log.warning("cannot create the namespace's progress Role and RoleBinding yet: %s", error)

    def _adopt_unrecorded(self, run: RunState, finetune: Obj, jobset: Obj, log: Log) -> None:
        """Says so when this process takes over a JobSet that no status records.

        That is a JobSet an earlier life of the operator created and died (or was killed) before
        writing the run's status: without this line the log would never mention the JobSet."""
        if run.jobset is not None or (finetune.get("status") or {}).get("jobSetName"):
            return
        run.jobset = slim_jobset(jobset)
        log.info("adopted existing JobSet %s", jobset["metadata"]["name"])

    def _hold_or_release(
        self, finetune: Obj, workload: Obj | None, decision: Decision, log: Log
    ) -> Obj | None:
        """A queued run's spec.suspend, carried out on its Kueue Workload (spec.active)."""
        if decision.set_workload_active is None or workload is None:
            return workload
        # First: Kueue must stop admitting it before the JobSet is suspended (or it unsuspends it).
        name = workload["metadata"]["name"]
        self.api.patch_workload_active(finetune["metadata"]["namespace"], name, decision.set_workload_active)
        log.info(
            "%s Kueue Workload %s (spec.suspend)",
            "released" if decision.set_workload_active else "held",
            name,
        )
        return {**workload, "spec": {**(workload.get("spec") or {}), "active": decision.set_workload_active}}

    def _suspend_or_resume(
        self, finetune: Obj, jobset: Obj | None, decision: Decision, event: EventSink, log: Log
    ) -> Obj | None:
        if decision.set_suspend is None or jobset is None:
            return jobset
        name = jobset["metadata"]["name"]
        self.api.patch_jobset_suspend(finetune["metadata"]["namespace"], name, decision.set_suspend)
        verb = "suspended" if decision.set_suspend else "resumed"
        log.info("%s JobSet %s", verb, name)
        event(
            "Normal",
            verb.capitalize(),
            f"{verb} JobSet {name} (spec.suspend={str(decision.set_suspend).lower()})",
        )
        return {**jobset, "spec": {**(jobset.get("spec") or {}), "suspend": decision.set_suspend}}

    def _write_status(
        self,
        run: RunState,
        finetune: Obj,
        seen: Seen,
        desired: Desired,
        created: Created,
        event: EventSink,
        log: Log,
        prepare: PrepareSeen | None = None,
    ) -> None:
        """Derives the status from what was observed and done, patches it when it differs (unless the
        first status is settling, or its turn under the write pace has not come: pacing.py), posts
        the Events of its transitions, and asks a checkpoint of the pods on a node that announces
        maintenance."""
        shape, jobset, pods, nodes = desired.shape, seen.jobset, seen.pods, seen.nodes
        derived = derive_status(
            Observed(
                finetune=finetune,
                jobset=jobset,
                pods=pods,
                spec_error=desired.spec_error,
                creation_error=str(created.error) if created.error else None,
                jobset_shortfall=(
                    (created.shortfall.reason, created.shortfall.message) if created.shortfall else None
                ),
                name_taken=created.name_taken,
                pods_refused=self._pods_refused(run, finetune, jobset, pods, shape, log, prepare),
                prepare_refused=created.prepare_refused,
                workload=seen.workload,
                prepare=prepare,
                chips=shape.chips if shape else None,
                hosts=shape.hosts if shape else None,
                accelerator=shape.family.accelerator if shape else None,
                topology=shape.topology if shape else None,
                nodes=nodes,
                goodput_interval=self.goodput_interval_seconds,
            )
        )
        metrics.observe_phase(run.key, derived["phase"])
        metrics.observe_goodput(run.key, (derived.get("goodput") or {}).get("ratio"))
        if derived["phase"] not in TERMINAL_PHASES:
            self._request_checkpoints(finetune, current_pods(pods, jobset), nodes, log)
        current: Obj = finetune.get("status") or {}
        patch = status_patch(current, derived)
        if patch is None:
            run.write_turn = None
        elif (wait := self._settling(run, derived, current) or self._turn(run)) > 0:
            self._defer(run, wait)  # the reconcile then writes whatever is true by then
            return
        else:
            max_restarts = (finetune.get("spec") or {}).get("maxRestarts")
            restart = self._announce_restart(current, derived, patch, log, max_restarts=max_restarts)
            namespace, name = run.key
            run.status_written(self.api.patch_finetune_status(namespace, name, patch))
            self._post_transition_events(current, derived, patch, event, log)
            if restart is not None:
                event(restart[0], "JobSetRestarted", restart[1])
        if derived["phase"] in TERMINAL_PHASES:
            run.finished()

    def _turn(self, run: RunState) -> float:
        """Seconds until the run's turn to patch its status comes (pacing.py); 0: write now."""
        if run.write_turn is None:
            run.write_turn = self.pace.reserve()
            metrics.observe_write_pace("status", self.pace.due_in(run.write_turn))
        wait = self.pace.due_in(run.write_turn)
        if wait <= 0:
            run.write_turn = None
        return wait

    def _defer(self, run: RunState, delay: float) -> None:
        if run.wants_wakeup(delay):
            self.defer(run.key, delay)

    def _settling(self, run: RunState, derived: Mapping[str, Any], current: Obj) -> float:
        """Seconds to hold back this run's first status after creating its JobSet, else 0.

        Pods usually start within a second or two of their JobSet; writing `Pending` and then
        `Running` would cost two writes (and two events) where one says the same. Only a plain
        Pending first status waits; errors and any later change are written at once."""
        first = current.get("phase") in (None, Phase.PREPARING)  # the first since the JobSet's creation
        if run.created_at is None or not first or derived.get("phase") != Phase.PENDING:
            return 0.0
        return max(0.0, run.created_at + self.status_settle_seconds - time.monotonic())

    def _pods_refused(
        self,
        run: RunState,
        finetune: Obj,
        jobset: Obj | None,
        pods: Sequence[Obj],
        shape: SliceShape | None,
        log: Log,
        prepare: PrepareSeen | None = None,
    ) -> str | None:
        """The apiserver's words for the run's pods it refused, while some are missing, else None: the
        JobSet's, or before it the prepare Job's pod (``prepare``).

        The Job controller records a refused pod only as a FailedCreate Event on its Job (its status
        has no condition for it, pkg/controller/job), and retries with a backoff; the JobSet
        controller records a refused Job only as a JobCreationFailed Event on the JobSet. Nothing the
        operator watches changes then, so while pods are missing it looks, once the JobSet (or the
        prepare Job) is REFUSAL_CHECK_AFTER seconds old and then at doubling intervals, and asks for
        the reconcile that does (two Event lists of the namespace, filtered by the apiserver, per look)."""
        target = self._missing_pods(finetune, jobset, pods, shape, prepare)
        if target is None:
            run.refusal = None
            return None
        owner, refuses = target
        now = time.monotonic()
        created = parse_time((owner.get("metadata") or {}).get("creationTimestamp"))
        age = time.time() - created.timestamp() if created is not None else 0.0
        check = run.refusal or RefusalCheck(
            due=now + max(0.0, REFUSAL_CHECK_AFTER - age), wait=0.0, found=None
        )
        if now < check.due:
            run.refusal = check
            self._defer(run, check.due - now)
            return check.found
        namespace = str(finetune["metadata"]["namespace"])
        try:
            listed = self.refusals.of(self.api, namespace)
        except ApiError as error:
            log.warning("cannot tell why the run's pods are missing: %s", error)
            listed = []
        events = [e for e in listed if refuses(e)]
        since = created.timestamp() if created is not None else 0.0
        recent = []
        for event in events:
            if any(wait in str(event.get("message") or "") for wait in JOBSET_FOLLOWER_WAIT):
                continue
            when = parse_time(
                event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
            )
            if when is None or when.timestamp() >= since - 1:  # not of an earlier JobSet of this name
                recent.append(event)
        recent.sort(key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
        wait = min(REFUSAL_CHECK_MAX, max(REFUSAL_CHECK_AFTER, check.wait * 2))
        run.refusal = RefusalCheck(
            due=now + wait, wait=wait, found=_refusal_message(recent[-1]) if recent else None
        )
        self._defer(run, wait)
        return run.refusal.found

    @staticmethod
    def _missing_pods(
        finetune: Obj,
        jobset: Obj | None,
        pods: Sequence[Obj],
        shape: SliceShape | None,
        prepare: PrepareSeen | None,
    ) -> tuple[Obj, Callable[[Obj], bool]] | None:
        """(the object whose pods are missing, which refusal Events are of it), or None when no pod
        is missing: the JobSet's pods, or while there is no JobSet the prepare Job's pod."""
        if is_final(finetune, jobset):
            return None
        if jobset is None:
            job = prepare.job if prepare is not None else None
            if job is None or prepare is None or prepare.state().stage is not Stage.RUNNING:
                return None
            if any(_alive(p) for p in prepare.pods):
                return None
            name = str(job["metadata"]["name"])
            return job, lambda e: _refuses_prepare(e, job=name)
        if shape is None or (jobset.get("spec") or {}).get("suspend"):
            return None
        if len(current_pods(pods, jobset)) >= shape.hosts:
            return None
        name = str(jobset["metadata"]["name"])
        prefix = f"{name}-{naming.REPLICATED_JOB}-"
        return jobset, lambda e: _refuses(e, jobset=name, job_prefix=prefix)

    def _request_checkpoints(
        self,
        finetune: Obj,
        pods: Sequence[Obj],
        nodes: Mapping[str, Obj],
        log: Log,
    ) -> None:
        """With spec.maintenance `checkpoint`: when a node of the run announces maintenance, every pod
        of the run gets the request (its time) in an annotation its trainer sees (maintenance.py)."""
        if (finetune.get("spec") or {}).get("maintenance", "checkpoint") != "checkpoint":
            return
        found = maintenance.for_run(pods, nodes)
        if found is None or found.request is None:
            return
        namespace = finetune["metadata"]["namespace"]
        for pod in maintenance.pods_to_ask(pods, found.request):
            self.api.annotate_pod(namespace, pod, {CHECKPOINT_REQUEST_ANNOTATION: str(found.request)})
            log.info(
                "asked pod %s to checkpoint now (request %d): %s",
                pod,
                found.request,
                found.message("checkpoint"),
            )

    @staticmethod
    def _post_transition_events(
        current: Obj,
        derived: Mapping[str, Any],
        patch: Mapping[str, Any],
        event: EventSink,
        log: Log,
    ) -> None:
        unschedulable = _became_unschedulable(current, derived)
        if patch.get("phase") and patch["phase"] != current.get("phase") and not unschedulable:
            kind, reason = _EVENT_FOR_PHASE[derived["phase"]]
            log.info(
                "phase %s -> %s: %s", current.get("phase") or "(new)", derived["phase"], derived["message"]
            )
            # A new run's first Pending says nothing the JobSetCreated event did not, nor its first
            # Preparing what PrepareJobCreated did: no Event (each is one more write to the API server
            # per run; the benchmark showed those writes cost latency).
            before = current.get("phase")
            first = (before is None and derived["phase"] == Phase.PREPARING) or (
                before in (None, Phase.PREPARING) and derived["phase"] == Phase.PENDING
            )
            if not first:
                event(kind, reason, derived["message"])
        elif unschedulable:  # also a first status that is already unschedulable (status settling)
            log.warning("unschedulable: %s", derived["message"])
            event("Warning", "Unschedulable", derived["message"])
        _post_queue_events(current, derived, event, log)
        prepared = _condition_of(derived, preparing.DATA_PREPARED)
        if (
            prepared is not None
            and prepared["status"] == "True"
            and _condition_status(current, preparing.DATA_PREPARED) != "True"
        ):
            log.info("data prepared: %s", prepared["message"])
            event("Normal", preparing.DATA_PREPARED, str(prepared["message"]))
        memory = _condition_of(derived, preparing.MEMORY_FITS)
        if (
            memory is not None
            and memory["reason"] == preparing.HBM_ESTIMATE_EXCEEDED
            and (_condition_of(current, preparing.MEMORY_FITS) or {}).get("reason") != memory["reason"]
        ):
            # Once, when the verdict is first written; a host that cannot hold the run fails it instead,
            # which the phase's own Event says.
            log.warning("%s: %s", memory["reason"], memory["message"])
            event("Warning", str(memory["reason"]), str(memory["message"]))
        waits = _condition_of(derived, "Created")
        if (
            waits is not None
            and waits.get("reason") in (NOT_INSTALLED, TOO_OLD)
            and (_condition_of(current, "Created") or {}).get("reason") != waits["reason"]
        ):
            log.warning("no JobSet yet: %s", waits["message"])
            event("Warning", str(waits["reason"]), str(waits["message"]))
        for type_ in WARNING_CONDITIONS:
            now_true = _condition_status(derived, type_) == "True"
            if now_true and _condition_status(current, type_) != "True":
                message = next(c["message"] for c in derived["conditions"] if c["type"] == type_)
                log.warning("%s: %s", type_, message)
                event("Warning", type_, message)

    @staticmethod
    def _announce_restart(
        current: Obj,
        derived: Mapping[str, Any],
        patch: Mapping[str, Any],
        log: Log,
        *,
        max_restarts: int | None = None,
    ) -> tuple[str, str] | None:
        """Logs a rise of status.restarts, before the status write; returns the Event to post after it.

        Otherwise a preemption or crash shows in the log only as Running -> Pending -> Running. Logged
        first because the restart happened whether or not our write lands: found by the fault suite,
        an operator SIGKILLed between the write and the line left a restart nobody explained (its
        next life finds the count already written), where now a crash or a failed write can only
        repeat the line."""
        if int(patch.get("restarts") or 0) <= int(current.get("restarts") or 0):
            return None
        kind, message = restart_message(current, derived, max_restarts)
        log.log(logging.WARNING if kind == "Warning" else logging.INFO, "%s", message)
        return kind, message


def restart_message(current: Obj, derived: Obj, max_restarts: int | None) -> tuple[str, str]:
    """(Event type, message) for a rise of status.restarts from ``current`` to ``derived``.

    A restart that left the JobSet's counted restarts (restartsCounted) where they were followed a
    checkpointed stop (exit 75: every host saved the step it reached, on preemption, a drain or
    maintenance): nothing was lost, hence Normal. Any other restart is a Warning."""
    before, now = int(current.get("restarts") or 0), int(derived.get("restarts") or 0)
    which = f"restart {now}" if now == before + 1 else f"restarts {before + 1}-{now}"
    head = f"JobSet {derived.get('jobSetName')} restarted all its slices ({which})"
    failure = "a TPU host failed, was preempted or lost its node (not a user error)"
    counted_now = derived.get("restartsCounted")
    # A status written before restartsCounted existed tells nothing of the earlier ones (except that
    # a run that never restarted has none).
    counted_before = current.get("restartsCounted", 0 if before == 0 else None)
    if counted_now is None or counted_before is None:
        return "Warning", f"{head}: {failure}"
    used = f"{counted_now} of {max_restarts} used" if max_restarts is not None else f"{counted_now} used"
    # Fewer than before: a new JobSet (someone deleted the old one), which counts from 0.
    counted = counted_now - counted_before if counted_now >= counted_before else counted_now
    if counted == 0:
        return "Normal", (
            f"{head} after a checkpointed stop: every host saved the step it reached (exit 75), so it "
            f"does not count against maxRestarts ({used})"
        )
    free = now - before - counted
    also = f"; {free} of them after a checkpointed stop, not counted" if free > 0 else ""
    return "Warning", f"{head}: {failure}; counted against maxRestarts ({used}){also}"


def _desired_part(finetune: Obj) -> dict[str, Any]:
    """The part of a TPUFineTune its objects are rendered from: status and server-set fields stay out."""
    return {k: finetune[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in finetune}


def _say_created(
    rendered: RenderedRun, *, created: bool, recreated: bool, event: EventSink, log: Log
) -> None:
    name = rendered.jobset_name
    if created and recreated:
        log.warning("JobSet %s was deleted while the run was active; recreated it", name)
        event(
            "Warning", "JobSetRecreated", f"JobSet {name} was deleted while the run was active; recreated it"
        )
    elif created:
        log.info("created JobSet %s", name)
        shape = rendered.shape
        event(
            "Normal", "JobSetCreated", f"created JobSet {name} ({shape.hosts} TPU hosts, {shape.chips} chips)"
        )
        if rendered.spot_stop_warning:  # once, with the run's start: what a reclaim will cost
            log.warning("%s", rendered.spot_stop_warning)
            event("Warning", "SpotStopTooShort", rendered.spot_stop_warning)
        if rendered.trainer_stack_caveat:  # once, with the run's start; the condition stays in status
            log.warning("%s", rendered.trainer_stack_caveat)
            event("Warning", trainer_stack.EVENT_REASON, rendered.trainer_stack_caveat)
    else:
        log.info("adopted existing JobSet %s", name)


def _with_earlier_restarts(jobset: Obj, restarts: int) -> Obj:
    """The JobSet to recreate, carrying the run's restarts so far (status.EARLIER_RESTARTS_ANNOTATION):
    the new JobSet counts from 0, and the run's count must go on from where it was."""
    meta = dict(jobset["metadata"])
    meta["annotations"] = {**(meta.get("annotations") or {}), EARLIER_RESTARTS_ANNOTATION: str(restarts)}
    return {**jobset, "metadata": meta}


def _condition_status(status: Obj, type_: str) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def _became_unschedulable(current: Obj, derived: Obj) -> bool:
    return (
        _condition_status(derived, "Scheduled") == "False"
        and _condition_status(current, "Scheduled") != "False"
    )


def _refuses(event: Obj, *, jobset: str, job_prefix: str) -> bool:
    """Whether a refusal Event is of this JobSet or one of its Jobs."""
    involved = event.get("involvedObject") or {}
    name = str(involved.get("name") or "")
    return name == jobset if involved.get("kind") == "JobSet" else name.startswith(job_prefix)


def _alive(pod: Obj) -> bool:
    """Not being deleted and not finished (a retry's pod is what may be missing)."""
    phase = (pod.get("status") or {}).get("phase")
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


def _refuses_prepare(event: Obj, *, job: str) -> bool:
    """Whether a refusal Event is of the run's prepare Job."""
    involved = event.get("involvedObject") or {}
    return involved.get("kind") == "Job" and involved.get("name") == job


def _refusal_message(event: Obj) -> str:
    involved = event.get("involvedObject") or {}
    if involved.get("kind") == "JobSet":
        what = "the JobSet controller cannot create the run's Jobs"
    elif str(involved.get("name") or "").endswith(PREPARE_SUFFIX):
        what = "the Job controller cannot create the run's prepare pod"
    else:
        what = "the Job controller cannot create the run's pods"
    return f"{what}: {event.get('message') or ''}"


def _condition_of(status: Obj, type_: str) -> Obj | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def _post_queue_events(
    current: Obj,
    derived: Mapping[str, Any],
    event: EventSink,
    log: Log,
) -> None:
    """Kueue's decisions as Events: Admitted when the `Queued` condition turns False (admitted),
    Evicted (Warning, Kueue's reason and message: Preempted by a higher-priority workload, ...)
    when an admitted run is sent back to the queue."""
    before, after = _condition_of(current, "Queued"), _condition_of(derived, "Queued")
    if after is None:
        return
    was = (before or {}).get("status")
    if after["status"] == "False" and after.get("reason") == "Admitted" and was != "False":
        log.info("admitted by Kueue: %s", after.get("message"))
        event("Normal", "Admitted", str(after.get("message")))
    elif after["status"] == "True" and _evicted(after) and not (was == "True" and _evicted(before or {})):
        log.warning("evicted by Kueue: %s", after.get("message"))
        event("Warning", "Evicted", str(after.get("message")))


def _evicted(condition: Obj) -> bool:
    return str(condition.get("message") or "").startswith(queueing.EVICTED_PREFIX)
