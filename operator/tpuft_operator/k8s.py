"""The one place the operator talks to the Kubernetes API.

Thin and idempotent: create-or-adopt by deterministic name, merge patches of only the fields the
operator owns, and one error type that says whether a retry can help. Handlers call these; nothing
else imports the client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException

from tpuft_operator.api.resources import (
    EVENT,
    FINETUNE,
    JOB,
    JOBSET,
    NETWORK_POLICY,
    POD,
    ROLE,
    ROLE_BINDING,
    SERVICE_ACCOUNT,
    WORKLOAD,
)

log = logging.getLogger("tpuft.k8s")
# Who the operator's Events say posted them (source.component, reportingComponent).
EVENT_COMPONENT = "tpuft-operator"

Obj = Mapping[str, Any]


class ApiError(RuntimeError):
    """An API call failed. ``retryable`` is False for errors a retry cannot fix (403, 422)."""

    def __init__(self, message: str, *, status: int, retryable: bool) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class NameTaken(Exception):
    """The name an object of this run needs belongs to an object another run (or no run) controls."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str) -> None:
        super().__init__(f"{kind} {namespace}/{name} already exists and belongs to {owner}")
        self.kind, self.name, self.owner = kind, name, owner


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (its controller ownerReference), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def describe_controller(obj: Mapping[str, Any]) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"
    return "no TPUFineTune (it has no controller)"


def _wrap(error: ApiException, what: str) -> ApiError:
    status = int(error.status or 0)
    reason = error.reason or ""
    with contextlib.suppress(ValueError, AttributeError):
        reason = json.loads(error.body or "{}").get("message") or reason
    retryable = status not in (400, 403, 404, 422) or status == 0
    if status == 0:  # no answer at all (see Api._call)
        return ApiError(f"{what}: {reason}", status=0, retryable=True)
    return ApiError(f"{what}: HTTP {status}: {reason}", status=status, retryable=retryable)


# Every kind the operator creates, and nothing else.
KINDS = {r.kind: r for r in (JOBSET, JOB, SERVICE_ACCOUNT, ROLE, ROLE_BINDING, NETWORK_POLICY)}
MERGE_PATCH = "application/merge-patch+json"
_TIMEOUT = urllib3.Timeout(total=60)


def load_client(kubeconfig: str | None = None, *, connections: int = 10) -> client.ApiClient:
    """In a pod: its ServiceAccount; elsewhere: the kubeconfig (or $KUBECONFIG).

    ``connections`` must cover every thread that calls at once: the client's default pool (5 per
    CPU) is smaller than the workers, and urllib3 then opens a connection for each extra call and
    throws it away afterwards, so every such call paid a new TLS handshake (280 "Connection pool is
    full" warnings per 300 runs in the benchmark)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connections
    throttle_credential_refresh(configuration)
    return client.ApiClient(configuration)


# How often the client may look whether its credentials need a reload (a rotated ServiceAccount token
# file, an expiring kubeconfig token). Both loaders reload well before the old token stops working
# (a projected token rotates at 80% of its life; kubeconfig tokens 5 minutes before expiry), so a
# second's delay costs nothing.
CREDENTIAL_CHECK_SECONDS = 1.0


class ThrottledRefresh:
    """The client's refresh hook, run at most once a ``period``.

    The client runs its hook on every call, and both loaders' hooks copy their whole config onto the
    Configuration each time (~40 us a call, ~5 calls a run: 0.06-0.16 s of the operator's CPU in the
    N=1000 profile). Each run of such a hook also installs a fresh copy of itself as the hook, so the
    copy it leaves becomes the one this wraps, and this goes back in front."""

    def __init__(self, hook: Callable[[client.Configuration], None], period: float) -> None:
        self._hook, self._period = hook, period
        self._next = 0.0
        self._lock = threading.Lock()

    def __call__(self, configuration: client.Configuration) -> None:
        if time.monotonic() < self._next:
            return
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return
            self._hook(configuration)
            self._next = now + self._period
            installed: Callable[[client.Configuration], None] | None = configuration.refresh_api_key_hook
            if installed is not None and installed is not self:
                self._hook = installed
                configuration.refresh_api_key_hook = self  # type: ignore[assignment]  # stubs say None


def throttle_credential_refresh(
    configuration: client.Configuration, period: float = CREDENTIAL_CHECK_SECONDS
) -> None:
    hook: Callable[[client.Configuration], None] | None = configuration.refresh_api_key_hook
    if hook is not None and not isinstance(hook, ThrottledRefresh):
        configuration.refresh_api_key_hook = ThrottledRefresh(hook, period)  # type: ignore[assignment]


class Api:
    """Create, read and merge-patch namespaced objects by kind, over the client's REST layer."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.client = api_client

    def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        # The client's own path walks every body through sanitize_for_serialization, a recursive copy
        # that cost more than the whole JSON encoding of a JobSet (0.28 s of the operator's 3.4 s of CPU
        # in the N=1000 profile). The operator's bodies are JSON already: encode them once here and
        # send them on the client's connection pool, with the headers and credentials it computes.
        method, url, headers, _, _ = self.client.param_serialize(
            method=method,
            resource_path=path,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        payload = None if body is None else json.dumps(body, separators=(",", ":"))
        try:
            response = rest.RESTResponse(
                self.client.rest_client.pool_manager.request(
                    method, url, body=payload, headers=headers, timeout=_TIMEOUT, preload_content=False
                )
            )
        except urllib3.exceptions.HTTPError as error:
            # No HTTP answer (connection refused, reset or timed out: an API server restarting). Found
            # by the fault suite: these escaped as plain exceptions, logged with a traceback per run.
            cause = getattr(error, "reason", None) or error
            raise ApiException(status=0, reason=f"cannot reach the API server: {cause}") from error
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        result: dict[str, Any] = json.loads(response.data or b"{}")
        return result

    def create_or_adopt(self, obj: Obj) -> tuple[dict[str, Any], bool]:
        """Creates ``obj``; when it already exists and has the same controller (the run that owns
        ``obj``), returns the live one (created=False); when another controls it, raises NameTaken
        and leaves it alone.

        Deterministic names make this idempotent: a retry, a second event or a restarted operator
        finds the object its earlier attempt made instead of creating a twin. The controller check
        keeps one run from claiming another's object by naming itself after it.
        """
        kind = obj["kind"]
        namespace = obj["metadata"]["namespace"]
        name = obj["metadata"]["name"]
        resource = KINDS[kind]
        try:
            return self._call("POST", resource.path(namespace), dict(obj)), True
        except ApiException as error:
            if error.status != 409:
                raise _wrap(error, f"creating {kind} {namespace}/{name}") from error
        try:
            live = self._call("GET", resource.path(namespace, name))
        except ApiException as error:
            raise _wrap(error, f"reading existing {kind} {namespace}/{name}") from error
        if controller_uid(live) != controller_uid(obj):
            raise NameTaken(kind, namespace, name, describe_controller(live))
        return live, False

    def ensure(self, obj: Obj) -> bool:
        """Creates ``obj`` unless it exists (True if this call created it). Never reads or changes an
        existing one: for shared objects that anyone may have made first."""
        kind, namespace, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        try:
            self._call("POST", KINDS[kind].path(namespace), dict(obj))
        except ApiException as error:
            if error.status == 409:
                return False
            raise _wrap(error, f"creating {kind} {namespace}/{name}") from error
        return True

    def patch_jobset_suspend(self, namespace: str, name: str, suspend: bool) -> None:
        """Suspend or resume with a merge patch of one field: replicatedJobs is immutable, so a
        full re-apply of the JobSet would be rejected."""
        try:
            self._call("PATCH", JOBSET.path(namespace, name), {"spec": {"suspend": suspend}}, MERGE_PATCH)
        except ApiException as error:
            raise _wrap(
                error, f"{'suspending' if suspend else 'resuming'} JobSet {namespace}/{name}"
            ) from error

    def delete_job(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        """Deletes a Job and (in the background) its pods; only the one of ``uid`` when given, so a
        newer Job of the same name is never hit. Gone already (404) or another (409): nothing to do."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", JOB.path(namespace, name), body)
        except ApiException as error:
            if error.status in (404, 409):
                return
            raise _wrap(error, f"deleting Job {namespace}/{name}") from error

    def patch_workload_active(self, namespace: str, name: str, active: bool) -> None:
        """Kueue's own way to hold a queued job: a Workload with spec.active=false is never admitted
        (an admitted one is evicted), and Kueue would unsuspend a JobSet whose Workload is admitted."""
        try:
            self._call("PATCH", WORKLOAD.path(namespace, name), {"spec": {"active": active}}, MERGE_PATCH)
        except ApiException as error:
            verb = "activating" if active else "deactivating"
            raise _wrap(error, f"{verb} Kueue Workload {namespace}/{name}") from error

    def patch_finetune_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches the operator's fields of the status; returns the updated object."""
        try:
            return self._call(
                "PATCH", FINETUNE.path(namespace, name, "status"), {"status": dict(status)}, MERGE_PATCH
            )
        except ApiException as error:
            raise _wrap(error, f"updating the status of TPUFineTune {namespace}/{name}") from error

    def may(self, verb: str, resource: str, group: str = "", namespace: str | None = None) -> bool:
        """Whether this identity may ``verb`` ``resource`` cluster-wide, or in ``namespace`` (a
        SelfSubjectAccessReview, which every authenticated identity may create). An API that cannot
        answer raises: at start-up that is a failed start, retried by the Deployment, not a guess."""
        attributes = {"verb": verb, "resource": resource, "group": group}
        if namespace is not None:
            attributes["namespace"] = namespace
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        try:
            answer = self._call("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body)
        except ApiException as error:
            raise _wrap(error, f"asking whether this identity may {verb} {resource}") from error
        return bool((answer.get("status") or {}).get("allowed"))

    def read_crd(self, name: str) -> dict[str, Any] | None:
        """The CustomResourceDefinition ``name``, None when there is none (the API it defines is not
        installed). Read once at start-up (jobset_crd.py), again only while it falls short."""
        try:
            return self._call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise _wrap(error, f"reading CustomResourceDefinition {name}") from error

    def creation_failures(self, namespace: str) -> list[dict[str, Any]]:
        """Why the apiserver refused what JobSets need, where nothing's status says it: the namespace's
        FailedCreate Events of Jobs (the Job controller's only record of a refused pod: PodSecurity,
        ResourceQuota, a webhook) and JobCreationFailed Events of JobSets (a refused Job: a quota on
        Jobs, a webhook). Two lists, each filtered by the apiserver; the caller picks its run's."""
        found: list[dict[str, Any]] = []
        for kind, reason in (("Job", "FailedCreate"), ("JobSet", "JobCreationFailed")):
            path = EVENT.path(namespace) + f"?fieldSelector=involvedObject.kind%3D{kind}%2Creason%3D{reason}"
            try:
                found += self._call("GET", path).get("items") or []
            except ApiException as error:
                raise _wrap(error, f"listing the {reason} events of namespace {namespace}") from error
        return found

    def warm_up(self, connections: int) -> None:
        """Opens ``connections`` connections to the apiserver now (a GET /version each, at once), so
        that the first burst of work does not pay a TLS handshake per worker: 18% of the workers' busy
        time in a profile of the benchmark's first burst. urllib3 keeps them in the client's pool."""
        with ThreadPoolExecutor(max_workers=connections) as pool:
            for future in [pool.submit(self._call, "GET", "/version") for _ in range(connections)]:
                with contextlib.suppress(ApiException):
                    future.result()

    def post_event(
        self, involved: Obj, type_: str, reason: str, message: str, at: datetime | None = None
    ) -> None:
        """Posts a core/v1 Event on ``involved`` (a run) that happened ``at`` (default: now). Best
        effort: an Event that cannot be posted is logged and dropped, never a reason to fail or retry
        a reconcile."""
        meta = involved["metadata"]
        now = (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": meta["namespace"], "generateName": f"{meta['name']}."},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call("POST", EVENT.path(str(meta["namespace"])), body)
        except ApiException as error:
            log.warning(
                "cannot post the %s Event of %s/%s: %s",
                reason,
                meta["namespace"],
                meta["name"],
                _wrap(error, "posting an Event"),
            )

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Merge-patches annotations of a pod (the operator's checkpoint requests, maintenance.py).
        A pod deleted meanwhile (404) needs none."""
        try:
            self._call(
                "PATCH",
                POD.path(namespace, name),
                {"metadata": {"annotations": dict(annotations)}},
                MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 404:
                return
            raise _wrap(error, f"annotating pod {namespace}/{name}") from error
