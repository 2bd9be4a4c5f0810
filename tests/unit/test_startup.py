"""Start-up settings handed to kopf (main.configure_kopf) and the log filter."""

from __future__ import annotations

import logging

import kopf
from kopf._cogs.structs.references import Resource

from tpuft_operator.main import QuietHandlerSuccess, configure_kopf
from tpuft_operator.settings import OperatorSettings

POD = Resource("", "v1", "pods", kind="Pod", namespaced=True)
JOBSET = Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", kind="JobSet", namespaced=True)
FINETUNE = Resource("tpuft.dev", "v1alpha1", "tpufinetunes", kind="TPUFineTune", namespaced=True)
SECRET = Resource("", "v1", "secrets", kind="Secret", namespaced=True)


def configured(**values: object) -> kopf.OperatorSettings:
    kopf_settings = kopf.OperatorSettings()
    configure_kopf(kopf_settings, OperatorSettings(**values))  # type: ignore[arg-type]
    return kopf_settings


def test_only_the_pods_and_jobsets_of_runs_are_watched() -> None:
    selectors = configured().watching.label_selectors
    assert list(selectors.collect(POD)) == ["tpuft.dev/finetune"]
    assert list(selectors.collect(JOBSET)) == ["tpuft.dev/finetune"]
    assert list(selectors.collect(FINETUNE)) == []  # every TPUFineTune is ours
    assert list(selectors.collect(SECRET)) == []


def test_kopf_writes_nothing_on_our_objects_and_posts_only_errors_itself() -> None:
    kopf_settings = configured()
    assert kopf_settings.posting.level == logging.ERROR
    assert kopf_settings.persistence.diffbase_storage.build(body={"spec": {"a": 1}}) == {}  # type: ignore[arg-type]


def test_the_per_event_handler_success_line_is_dropped_and_nothing_else() -> None:
    quiet = QuietHandlerSuccess()

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)

    assert not quiet.filter(record(logging.INFO, "Handler 'build_registry.<locals>.pod_event' succeeded."))
    assert quiet.filter(record(logging.ERROR, "Handler 'build_registry.<locals>.pod_event' failed."))
    assert quiet.filter(record(logging.INFO, "created JobSet run-1"))
