"""Rank-0 progress: a bar in the logs and ``status.progress`` of the TPUFineTune.

The channel: the process with global rank 0 merge-patches the ``status`` subresource of the one
TPUFineTune named in ``config.progress`` with ``{"status": {"progress": {...}}}``, authenticated as the
pod's own token (in-cluster config; ``$KUBECONFIG`` outside a cluster). That token is bound to the pod, and
the operator's admission policy lets it change only ``status.progress`` of the pod's own run (see
docs/operator.md, "Progress channel"). Updates are throttled to one per
``min_interval_seconds`` (the final one always goes out). Reporting NEVER raises into training: a
missing client, an absent resource or a denied patch logs one warning and the run goes on.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from tpuft_trainer.config import ProgressConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    step: int
    total_steps: int
    loss: float | None
    tokens_per_second: float | None
    eta_seconds: float | None
    eval_loss: float | None = None
    # The step whose logging closed `loss` (the mean of the `logging_steps` steps up to it); None: this one.
    loss_step: int | None = None
    # objective dpo: the share of pairs rewarded right, and the mean reward margin, over loss's steps.
    reward_accuracy: float | None = None
    reward_margin: float | None = None
    # More status.progress fields, already in the API's camelCase (the attempt and its last save).
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        """The ``status.progress`` object (camelCase, as in the API)."""
        body: dict[str, Any] = {"step": self.step, "totalSteps": self.total_steps}
        if self.loss is not None and math.isfinite(self.loss):
            body["loss"] = round(self.loss, 6)
        if self.eta_seconds is not None:
            body["etaSeconds"] = round(self.eta_seconds)
        if self.tokens_per_second is not None:
            body["tokensPerSecond"] = round(self.tokens_per_second, 1)
        if self.eval_loss is not None and math.isfinite(self.eval_loss):
            body["evalLoss"] = round(self.eval_loss, 6)
        if self.reward_accuracy is not None and math.isfinite(self.reward_accuracy):
            body["rewardAccuracy"] = round(self.reward_accuracy, 4)
        if self.reward_margin is not None and math.isfinite(self.reward_margin):
            body["rewardMargin"] = round(self.reward_margin, 6)
        percent = 100 * self.step // self.total_steps if self.total_steps else 0
        body["summary"] = f"{self.step}/{self.total_steps} ({percent}%)"
        body["updateTime"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body.update(self.details)
        return body

    def to_line(self) -> str:
        parts = [f"step {self.step}/{self.total_steps}"]
        # A step between two logging steps has no loss of its own: the line leaves the last one out.
        if self.loss is not None and self.loss_step in (None, self.step):
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval loss {self.eval_loss:.4f}")
        if self.reward_accuracy is not None and self.reward_margin is not None:
            parts.append(f"reward accuracy {self.reward_accuracy:.2f} margin {self.reward_margin:.4f}")
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:,.0f} tokens/s")
        if self.eta_seconds is not None:
            parts.append(f"ETA {format_duration(self.eta_seconds)}")
        return " | ".join(parts)


def format_duration(seconds: float) -> str:
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Meter:
    """Step rate, tokens/s and ETA from the median time per step over the last `WINDOW` reports
    (each weighted by the steps it covers). A median, not a mean: the steps that compile (the first
    two after every start or resume, the first evaluation), save or evaluate take seconds to minutes
    where the others take milliseconds; a mean since the start put "ETA 1:26:22" on a resumed run
    with a minute to go. The ETA leaves out the cost of the saves and evaluations still to come."""

    WINDOW = 64

    def __init__(self, total_steps: int, tokens_per_step: int, clock: Callable[[], float] = time.monotonic):
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self._clock = clock
        self._last: tuple[int, float] | None = None
        # (steps covered, seconds per step) of the last reports.
        self._samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    def update(
        self, step: int, loss: float | None, eval_loss: float | None = None, loss_step: int | None = None
    ) -> Snapshot:
        now = self._clock()
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            steps = step - self._last[0]
            self._samples.append((steps, (now - self._last[1]) / steps))
        if self._last is None or step > self._last[0]:
            self._last = (step, now)
        tokens_per_second = eta = None
        if self._samples:
            seconds_per_step = _weighted_median(self._samples)
            tokens_per_second = self.tokens_per_step / seconds_per_step
            eta = max(0, self.total_steps - step) * seconds_per_step
        return Snapshot(step, self.total_steps, loss, tokens_per_second, eta, eval_loss, loss_step=loss_step)


def _weighted_median(samples: Iterable[tuple[int, float]]) -> float:
    ordered = sorted(samples, key=lambda s: s[1])
    half, seen = sum(w for w, _ in ordered) / 2, 0
    for weight, value in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][1]


# trl's DPOTrainer's logged names -> Snapshot fields.
REWARD_LOGS = {"rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin"}


class Sink(Protocol):
    def report(self, snapshot: Snapshot, *, final: bool = False) -> None: ...


class StatusReporter:
    """Merge-patches ``status.progress`` of ``namespace/name``; see the module docstring."""

    def __init__(self, config: ProgressConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._last_sent: float | None = None
        self._api: Any = None
        self._warned = False
        self.sent = 0  # patches that the API accepted (tests and logs)
        self.enabled = bool(config.namespace and config.name)

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()  # honours $KUBECONFIG
            self._api = client.CustomObjectsApi()
        return self._api

    def report(self, snapshot: Snapshot, *, final: bool = False) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if (
            not final
            and self._last_sent is not None
            and now - self._last_sent < self.config.min_interval_seconds
        ):
            return
        self._last_sent = now
        try:
            self._client().patch_namespaced_custom_object_status(
                group=self.config.group,
                version=self.config.version,
                namespace=self.config.namespace,
                plural=self.config.plural,
                name=self.config.name,
                body={"status": {"progress": snapshot.to_status()}},
                _content_type="application/merge-patch+json",
            )
            self.sent += 1
        except Exception as error:  # the channel must never fail the training
            if not self._warned:
                self._warned = True
                log.warning(
                    "progress reporting to %s/%s is not working (%s: %s); training continues, "
                    "further reporting errors are not logged",
                    self.config.namespace,
                    self.config.name,
                    type(error).__name__,
                    error,
                )


class LogBar:
    """A tqdm bar written to the log stream (stderr), one line per update when stderr is not a
    terminal, so ``kubectl logs`` shows progress without carriage-return noise."""

    def __init__(self, total_steps: int, initial: int = 0) -> None:
        import sys

        from tqdm import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0 if not sys.stderr.isatty() else 0.5,
            ascii=not sys.stderr.isatty(),
        )
        self._step = initial

    def report(self, snapshot: Snapshot, *, final: bool = False) -> None:
        try:
            self._bar.update(max(0, snapshot.step - self._step))
            self._step = snapshot.step
            postfix = {}
            if snapshot.loss is not None:
                postfix["loss"] = f"{snapshot.loss:.4f}"
            if snapshot.tokens_per_second is not None:
                postfix["tok/s"] = f"{snapshot.tokens_per_second:,.0f}"
            self._bar.set_postfix(postfix, refresh=True)
            if final:
                self._bar.close()
        except Exception:  # a broken stderr must not end the run either
            pass


def make_callback(
    sinks: list[Sink],
    meter: Meter,
    *,
    is_rank_zero: bool,
    details: Callable[[], Mapping[str, Any]] = dict,
    logger: logging.Logger = log,
) -> Any:
    """A transformers TrainerCallback feeding ``sinks`` from rank 0 only (one report per run, not
    one per host). ``details`` gives the extra status fields of each report (attempt.py).

    It also makes the Trainer log the last step (on every rank: logging gathers the loss from all of
    them), so the run's final loss is reported whatever ``logging_steps`` is."""
    from transformers import TrainerCallback

    class ProgressCallback(TrainerCallback):
        # Progress goes out at every step: from on_step_end (step, throughput, ETA and the last loss
        # logged: reading the loss is a host-device sync, made only at a logging step), or, at a
        # logging step, from on_log (the Trainer logs after on_step_end), with the loss of the
        # `logging_steps` steps it closes; and once more when training ends.
        def __init__(self) -> None:
            self.last_loss: float | None = None
            self.last_loss_step: int | None = None
            self.last_eval_loss: float | None = None
            self.last_rewards: dict[str, float] = {}
            self.ended = False

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            if logs and "loss" in logs:
                self.last_loss = float(logs["loss"])
                self.last_loss_step = int(state.global_step)
                # trl's DPOTrainer logs these beside its loss (dpo.py)
                for key, name in REWARD_LOGS.items():
                    if key in logs:
                        self.last_rewards[name] = float(logs[key])
                self._emit(state, final=False)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # The Trainer's own flow callback ran first: should_training_stop is set at the last step.
            if control.should_training_stop:
                control.should_log = True
            if not control.should_log:  # else on_log reports this step, with its loss
                self._emit(state, final=False)

        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            if metrics and "eval_loss" in metrics:
                self.last_eval_loss = float(metrics["eval_loss"])
                # The evaluation at the end comes after on_train_end: it is the last report then.
                self._emit(state, final=self.ended)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ended = True
            self._emit(state, final=True)

        def _emit(self, state: Any, *, final: bool) -> None:
            if not is_rank_zero:
                return
            snapshot = meter.update(
                int(state.global_step), self.last_loss, self.last_eval_loss, loss_step=self.last_loss_step
            )
            snapshot = replace(
                snapshot,
                details=details(),
                reward_accuracy=self.last_rewards.get("reward_accuracy"),
                reward_margin=self.last_rewards.get("reward_margin"),
            )
            logger.info("progress: %s", snapshot.to_line())
            for sink in sinks:
                try:
                    sink.report(snapshot, final=final)
                except Exception as error:  # belt and braces: sinks already swallow their errors
                    logger.warning("progress sink %s failed: %s", type(sink).__name__, error)

    return ProgressCallback()
