"""Sharded checkpoints, sliced loading and the streamed export at three model sizes (issue 38, item 8):
`python -m bench scale [--sizes 46M 168M 340M] [--compare-ref REF]`, part of `make bench`.

Three Llama-style models built here (nothing downloaded; float32, untied embeddings, vocab 32000):
46M (hidden 512, 4 layers), 168M (hidden 1024, 8 layers: the issue's model) and 340M (hidden 1280,
13 layers). Each is fine-tuned in full by `tpuft train` on 4 PJRT CPU devices (AdamW, rows of 128
packed from made-up documents, one row per device and step, 8 steps: the first three compile, the
step times are read after them), every run a process of its own, one at a time (SPMD is
process-global; the machine has two cores):

1. plain: no saveSteps. Peak RSS (the process, and the trainer's `train` part), the median step.
2. periodic: saveSteps 2 (the saves at steps 2, 4 and 6 write in the background, the last step's is
   synchronous). Peak RSS against plain's; for each periodic save, the seconds training waited for it
   (`blocked_seconds`: the staging copy) against the median step, apart from them its wait for the
   device to finish the steps dispatched ahead (`device_wait_seconds`: the device computes meanwhile,
   so it is not lost), and its write seconds.
3. SIGTERM, saveSteps 2: (a) `sigterm_in_save`: the trainer signals itself as checkpoint-4's
   background write begins (TPUFT_FAULT_SIGTERM_IN_SAVE_AT_STEP=4): it must finish that save and exit
   75 without another one; (b) `sigterm_between_saves`: the harness sends SIGTERM a third of a step
   into step 5, once checkpoint-4 is complete (no save in flight): the trainer saves the step it
   reaches and exits 75. Signal -> exit seconds (the harness's clock, and the trainer's own), steps
   lost, saves after the signal.
4. resume_export: a new process on what 3(a) left (its newest checkpoint; TPUFT_RESTART_ATTEMPT=1)
   resumes from it, trains to the end and exports the model: peak RSS (process; load/train/export),
   the model load seconds and the time to its first step.

Measured by the harness for any trainer version: the child's peak RSS (`peak_rss`: os.wait4's
ru_maxrss, the harness's samples of VmRSS every 0.25 s, and the trainer's own per-part peaks), wall
times, the exit status, an RSS timeline (VmRSS, RssAnon, RssFile), and the CPU the rest of the
machine used meanwhile (a run is re-run when others took more than DISTURBED of it). From the
trainer's `<output>/tpuft-metrics.json`: `peak_rss` of each part (VmHWM reset between parts, as the
trainer of 768b6be did; the trainers between them reported the peak so far at the end of each part),
`step_seconds`, `compiles_after_step`, `attempt.checkpoints`, `stopped`, `model_load`, `export`.

Against what: issue 38's targets on the 168M model (TARGET_*), and with `--compare-ref REF` the same
runs of an earlier trainer from git (e.g. 768b6be: full-file checkpoints gathered on every host,
synchronous saves) in a `git worktree` under /tmp, removed afterwards, the two trainers alternating
run by run. Its metrics lack the new fields: a save's blocked time there is the gap it left in the
step times (the step that included the save minus the median of the others). A process that dies
(OOM) is a result, not a failure of the benchmark. The training state is 16 bytes per parameter
(fp32 weights, gradients, two AdamW moments). Results: bench/results/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import plot_file, results_file

REPO = Path(__file__).resolve().parent.parent
RESULTS = results_file("scale")
PNG = plot_file("scale")
DEVICES, VOCAB, SEQ_LEN, STEPS, SAVE_STEPS = 4, 32000, 128, 8, 2
# The first three steps of a process compile XLA graphs (each a few times a step's time here: see
# `compiled_late`); the step times are read after them.
WARMUP_STEPS = 3
IN_SAVE_STEP = 4  # 3(a): SIGTERM as this step's periodic save writes
BETWEEN_STEP = 4  # 3(b): SIGTERM during the step after this one, once its save is complete
STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients and AdamW's two moments
STAGED_BYTES_PER_PARAM = 12  # what a checkpoint holds: the weights and both moments
SIZES: dict[str, dict[str, Any]] = {
    "46M": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1408, num_attention_heads=8),
    "168M": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=16),
    "340M": dict(hidden_size=1280, num_hidden_layers=13, intermediate_size=3456, num_attention_heads=20),
}
TARGET_SIZE = "168M"
TARGET_BLOCKED_TO_STEP = 0.25  # a periodic save blocks at most this share of a median step
TARGET_PERIODIC_RSS = 1.15  # peak RSS with periodic checkpoints, as a multiple of without
TARGET_PLAIN_RSS_TO_STATE = 2.0  # peak RSS without checkpoints, as a multiple of the training state
TARGET_SIGTERM_EXIT_S, TARGET_STEPS_LOST = 30.0, 1
TARGET_RESUME_RSS = 1.15  # resume + export peak RSS, as a multiple of plain's
RUNS = ("plain", "periodic", "sigterm_in_save", "resume_export", "sigterm_between_saves")
EXPECTED_EXIT = {
    "plain": 0,
    "periodic": 0,
    "sigterm_in_save": 75,
    "sigterm_between_saves": 75,
    "resume_export": 0,
}
DISTURBED = 0.25  # the share of the machine's CPU others may take during a run before it is re-run
RERUNS = 2
RUN_TIMEOUT_S = 3600
SAMPLE_S = 0.25
GB = 1e9
_PROGRESS = re.compile(r"progress: step (\d+)/")
_FAULT = re.compile(r"fault injection: SIGTERM while checkpoint-(\d+)")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_COMPLETE = ".tpuft-complete"  # both formats mark a complete checkpoint so
_SAVES = tuple(range(SAVE_STEPS, STEPS, SAVE_STEPS))  # the periodic saves (the last step's is not one)
# Where a save's blocked time is the trainer's own but also counts the wait for the device (a trainer
# before issue 46 timed the two as one): an upper bound of the staging copy.
DEVICE_WAIT_INCLUDED = "trainer, device wait included"
SPLIT_NOT_MEASURED = "device wait and staging not yet measured apart"


# ---- the figures (pure functions) ---------------------------------------------------------------------


def median_step(
    step_seconds: Sequence[float],
    first_step: int = 1,
    saves: Iterable[int] = (),
    warmup: int = WARMUP_STEPS,
) -> float | None:
    """The median of ``step_seconds`` (the wall time between the ends of consecutive steps of a process
    whose first step was ``first_step``: entry i is the step first_step + i + 1) without the first
    ``warmup`` steps of the process (compilation) and the steps that included a save (a save's step + 1)."""
    skip = {s + 1 for s in saves}
    clean = [
        t
        for i, t in enumerate(step_seconds)
        if (step := first_step + i + 1) not in skip and step >= first_step + warmup
    ]
    return statistics.median(clean) if clean else None


def save_gaps(
    step_seconds: Sequence[float], first_step: int, saves: Iterable[int], warmup: int = WARMUP_STEPS
) -> dict[int, float]:
    """What each save at step s added to the step after it: that step's time minus the median of the
    steps without a save (a synchronous save's blocked time, from the step times alone); only for
    saves after the warm-up, whose next step compiles nothing."""
    saves = list(saves)
    median = median_step(step_seconds, first_step, saves, warmup)
    gaps = {}
    for s in saves:
        index = s - first_step  # the step s + 1
        if median is not None and 0 <= index < len(step_seconds) and s + 1 >= first_step + warmup:
            gaps[s] = round(step_seconds[index] - median, 3)
    return gaps


def compiled_late(
    compiles_after_step: dict[str, int] | None, first_step: int = 1, warmup: int = WARMUP_STEPS
) -> list[int]:
    """The steps after the warm-up at whose end XLA had compiled more graphs than a step before (their
    times are not a trained step's alone): none, on a set-up whose warm-up is long enough."""
    counts = {int(k): v for k, v in (compiles_after_step or {}).items()}
    return [
        k
        for k in sorted(counts)
        if k >= first_step + warmup and k - 1 in counts and counts[k] > counts[k - 1]
    ]


def linear_fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """Peak bytes = intercept + slope x parameters, least squares over the sizes: the runtime's share
    (intercept, GB) and the bytes each parameter costs (slope)."""
    if len(points) < 2:
        return None
    slope, intercept = statistics.linear_regression([p for p, _ in points], [b for _, b in points])
    return {"intercept_gb": round(intercept / GB, 2), "bytes_per_param": round(slope, 1)}


def _ratio(value: float | None, to: float | None) -> float | None:
    return round(value / to, 3) if value is not None and to else None


def _metrics(run: dict[str, Any] | None) -> dict[str, Any]:
    return (run or {}).get("metrics") or {}


def _peak(run: dict[str, Any] | None) -> int | None:
    """A run's peak RSS (bytes), as the harness took it (`peak_rss`)."""
    return (run or {}).get("peak_rss_bytes")


def peak_rss(ru_maxrss: int, sampled: int, trainer_parts: dict[str, int] | None) -> int:
    """The process's peak RSS: the largest of the kernel's ru_maxrss (os.wait4), the harness's samples
    and the trainer's own per-part peaks. ru_maxrss alone is not enough for a trainer that resets
    VmHWM between parts (/proc/self/clear_refs, as 768b6be's did): that resets the high-water mark
    ru_maxrss is taken from too, which then holds the peak since the last reset only."""
    return max(ru_maxrss, sampled, *(trainer_parts or {}).values())


def run_ok(run: dict[str, Any] | None, kind: str) -> bool:
    return run is not None and run.get("exit_code") == EXPECTED_EXIT[kind]


def periodic_saves(run: dict[str, Any], plain_median: float | None = None) -> list[dict[str, Any]]:
    """Each periodic save of a `periodic` run: what training waited for, against the median step of
    the plain run (``plain_median``: steps with no save anywhere; else the median of this run's steps
    after the warm-up and without the steps that included a save), and its write seconds.
    What it waited for: the trainer's `blocked_seconds` where it says (the staging copy); else (an
    earlier trainer, whose saves blocked) the gap the save left in the step times, or for a save in
    the warm-up, whose next step also compiles, the trainer's own seconds of that synchronous save.
    Apart from it, the trainer's `device_wait_seconds` (the device finishing the steps the loop had
    dispatched before the save: computed meanwhile, not lost) and `staging_seconds` (the copy alone);
    None where the trainer did not time them apart (before issue 46 its `blocked_seconds` counted the
    device wait too: `blocked_from` says so)."""
    metrics = _metrics(run)
    steps = metrics.get("step_seconds") or []
    saves = list(_SAVES)
    own = median_step(steps, 1, saves)
    median = plain_median if plain_median else own
    gaps = save_gaps(steps, 1, saves)
    recorded = {c["step"]: c for c in (metrics.get("attempt") or {}).get("checkpoints") or []}
    out = []
    for step in saves:
        save = recorded.get(step, {})
        blocked, source = save.get("blocked_seconds"), "trainer"
        device_wait = save.get("device_wait_seconds")
        if blocked is not None and device_wait is None:
            source = DEVICE_WAIT_INCLUDED
        elif blocked is None and step in gaps:
            blocked, source = gaps[step], "step gap"
        elif blocked is None and save.get("seconds") is not None:
            blocked, source = save["seconds"], "synchronous save seconds"
        out.append(
            {
                "step": step,
                "blocked_seconds": blocked,
                "blocked_from": source if blocked is not None else None,
                "device_wait_seconds": device_wait,
                "staging_seconds": save.get("staging_seconds"),
                "gap_seconds": gaps.get(step),
                "write_seconds": save.get("write_seconds"),
                "save_seconds": save.get("seconds"),
                "median_step_seconds": _round(median),
                "median_step_of": "plain" if plain_median else "periodic",
                "blocked_to_median_step": _ratio(blocked, median),
                "device_wait_to_median_step": _ratio(device_wait, median),
            }
        )
    return out


def stop_figures(run: dict[str, Any]) -> dict[str, Any]:
    """A SIGTERM run: signal -> exit (harness; the trainer's own where it says), steps lost (the
    trainer's, else the last step logged minus the newest complete checkpoint), saves after the signal
    (complete checkpoints newer than the step the run had logged when the signal came)."""
    stopped = _metrics(run).get("stopped") or {}
    sig = run.get("signal") or {}
    checkpoints = run.get("checkpoints") or []
    trained_to = max(run.get("steps_logged") or [0])
    lost = stopped.get("steps_lost")
    if lost is None and checkpoints and run.get("exit_code") == 75:  # (a process that died lost its stop)
        lost = trained_to - max(checkpoints)
    at = sig.get("step_at_signal")
    return {
        "exit_code": run.get("exit_code"),
        "signal_to_exit_seconds": sig.get("to_exit_seconds"),
        "trainer_signal_to_exit_seconds": stopped.get("signal_to_exit_seconds"),
        "steps_lost": lost,
        "trained_to": stopped.get("trained_to", trained_to),
        "saves_after_signal": sum(1 for c in checkpoints if at is not None and c > at),
        "checkpoints": checkpoints,
        "step_at_signal": at,
        "save_in_flight_at_signal": sig.get("save_in_flight"),
        "stop_save_seconds": stopped.get("save_seconds"),
    }


def train_peak(run: dict[str, Any] | None) -> int | None:
    """The peak RSS of a run's training (bytes): the trainer's own `train` part where it says, else
    the harness's samples from the data being ready to the last step logged."""
    if run is None:
        return None
    train = (_metrics(run).get("peak_rss") or {}).get("train")
    return train if train is not None else (run.get("phase_peaks_sampled") or {}).get("train")


def size_figures(runs: dict[str, dict[str, Any]], params: int) -> dict[str, Any]:
    """One size's figures from its runs (harness records with the trainer's metrics in ``metrics``)."""
    state = STATE_BYTES_PER_PARAM * params
    plain, periodic, resume = runs.get("plain"), runs.get("periodic"), runs.get("resume_export")
    figures: dict[str, Any] = {"params": params, "training_state_bytes": state}
    plain_peak = _peak(plain) if run_ok(plain, "plain") else None
    plain_train = train_peak(plain) if run_ok(plain, "plain") else None
    if plain is not None:
        figures["plain"] = {
            "exit_code": plain.get("exit_code"),
            "peak_rss_bytes": _peak(plain),
            "train_peak_bytes": train_peak(plain),
            "peak_rss_parts": _metrics(plain).get("peak_rss"),
            "peak_rss_to_state": _ratio(_peak(plain), state),
            "median_step_seconds": _round(median_step(_metrics(plain).get("step_seconds") or [])),
            "compiled_late": compiled_late(_metrics(plain).get("compiles_after_step")),
        }
    if periodic is not None:
        periodic_peak = _peak(periodic)
        figures["periodic"] = {
            "exit_code": periodic.get("exit_code"),
            "peak_rss_bytes": periodic_peak,
            "train_peak_bytes": train_peak(periodic),
            "peak_rss_parts": _metrics(periodic).get("peak_rss"),
            "peak_rss_to_plain": _ratio(periodic_peak, plain_peak),
            "train_peak_to_plain": _ratio(train_peak(periodic), plain_train),
            # what the periodic run held beyond plain's peak, per parameter (the staging copy)
            "extra_bytes_per_param": _round((periodic_peak - plain_peak) / params, 1)
            if periodic_peak is not None and plain_peak
            else None,
            "saves": periodic_saves(periodic, figures.get("plain", {}).get("median_step_seconds"))
            if run_ok(periodic, "periodic")
            else [],
            # Its steps without a save of their own (each ran while the previous save was writing, for
            # a trainer that writes in the background), against plain's steps.
            "median_step_seconds": _round(
                median_step(_metrics(periodic).get("step_seconds") or [], 1, _SAVES)
            ),
            "median_step_to_plain": _ratio(
                median_step(_metrics(periodic).get("step_seconds") or [], 1, _SAVES),
                figures.get("plain", {}).get("median_step_seconds"),
            ),
            "compiled_late": compiled_late(_metrics(periodic).get("compiles_after_step")),
        }
    for kind in ("sigterm_in_save", "sigterm_between_saves"):
        if (run := runs.get(kind)) is not None:
            figures[kind] = stop_figures(run)
    if resume is not None:
        metrics = _metrics(resume)
        figures["resume_export"] = {
            "exit_code": resume.get("exit_code"),
            "peak_rss_bytes": _peak(resume),
            "peak_rss_parts": metrics.get("peak_rss"),
            "peak_rss_to_plain": _ratio(_peak(resume), plain_peak),
            # against the training peak of the plain run: what resuming and exporting add to training
            "peak_rss_to_plain_train": _ratio(_peak(resume), plain_train),
            "resumed_from": metrics.get("resumed_from"),
            "phase_peaks_sampled": resume.get("phase_peaks_sampled"),
            "model_load_seconds": (metrics.get("model_load") or {}).get("seconds"),
            "startup_seconds": (metrics.get("attempt") or {}).get("startup_seconds"),
            "export": metrics.get("export") or None,
        }
    return figures


def _round(value: float | None, digits: int = 3) -> float | None:
    return round(value, digits) if value is not None else None


def fits(by_size: dict[str, dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """`linear_fit` of each run's peak RSS over the sizes that ran (successful runs only)."""
    out = {}
    for name, kind, key in (
        ("plain", "plain", "peak_rss_bytes"),
        ("plain_train", "plain", "train_peak_bytes"),
        ("periodic", "periodic", "peak_rss_bytes"),
        ("periodic_train", "periodic", "train_peak_bytes"),
        ("resume_export", "resume_export", "peak_rss_bytes"),
    ):
        points = [
            (f["params"], f[kind][key])
            for f in by_size.values()
            if kind in f and f[kind]["exit_code"] == EXPECTED_EXIT[kind] and f[kind].get(key)
        ]
        out[name] = linear_fit(points)
    return out


@dataclass
class Verdict:
    name: str
    value: str
    target: str
    met: bool | None  # None: not measured
    limited_by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v != ""}


def verdicts(
    figures: dict[str, Any], fit: dict[str, Any] | None = None, *, sharded: bool = True
) -> list[Verdict]:
    """Issue 38's targets against one size's figures (TARGET_SIZE's); where one is not met, what limits
    it, in this benchmark's numbers. ``sharded``: the figures are of a trainer with sharded,
    asynchronous checkpoints (else of an earlier one: full-file checkpoints, synchronous saves)."""
    return [
        blocked_verdict(figures, sharded=sharded),
        *periodic_rss_verdicts(figures, sharded=sharded),
        plain_rss_verdict(figures, fit),
        sigterm_verdict(figures, "sigterm_in_save", sharded=sharded),
        sigterm_verdict(figures, "sigterm_between_saves", sharded=sharded),
        resume_verdict(figures, sharded=sharded),
    ]


def _staged_gb(figures: dict[str, Any]) -> float:
    """What a checkpoint of this size holds (GB): the weights and both AdamW moments."""
    return STAGED_BYTES_PER_PARAM * figures["params"] / GB


# -- a periodic save against the median step


def blocked_verdict(figures: dict[str, Any], *, sharded: bool) -> Verdict:
    """The worst periodic save's blocked time against the median step."""
    target = f"<= {TARGET_BLOCKED_TO_STEP} x median step"
    periodic = figures.get("periodic") or {}
    saves = periodic.get("saves") or []
    ratios = [s["blocked_to_median_step"] for s in saves if s["blocked_to_median_step"] is not None]
    if not ratios:
        return Verdict("periodic save blocks training", "-", target, None)
    worst = max(saves, key=lambda s: s["blocked_to_median_step"] or 0)
    met = max(ratios) <= TARGET_BLOCKED_TO_STEP
    return Verdict(
        "periodic save blocks training",
        _blocked_value(saves, worst, periodic, sharded=sharded),
        target,
        met,
        "" if met else _blocked_limit(figures, worst, sharded=sharded),
    )


def _blocked_value(
    saves: list[dict[str, Any]], worst: dict[str, Any], periodic: dict[str, Any], *, sharded: bool
) -> str:
    each = ", ".join(
        f"{s['blocked_seconds']:.2f} s at step {s['step']} ({s['blocked_to_median_step']:.2f}x"
        + ("" if s["blocked_from"] == "trainer" else f", {s['blocked_from']}")
        + ")"
        for s in saves
        if s["blocked_seconds"] is not None and s["blocked_to_median_step"] is not None
    )
    value = each + f" of a {worst['median_step_seconds']:.2f} s median step ({worst['median_step_of']} run)"
    if sharded:
        value += _device_wait_note(saves)
    if periodic.get("median_step_to_plain"):
        value += (
            f"; the periodic run's own steps {periodic['median_step_seconds']:.2f} s"
            f" ({periodic['median_step_to_plain']:.2f}x plain's"
            + (": each ran beside a save's background write)" if sharded else ")")
        )
    return value


def _device_wait_note(saves: list[dict[str, Any]]) -> str:
    """What the saves waited for the device before their staging (not lost: it computed meanwhile)."""
    waits = [s["device_wait_seconds"] for s in saves if s.get("device_wait_seconds") is not None]
    if not waits:
        return f"; {SPLIT_NOT_MEASURED}"
    low, high = f"{min(waits):.2f}", f"{max(waits):.2f}"
    return (
        f"; before its staging each waited {low if low == high else f'{low}-{high}'} s for the device to"
        " finish the steps dispatched ahead (not lost: the device computed them)"
    )


def _blocked_limit(figures: dict[str, Any], worst: dict[str, Any], *, sharded: bool) -> str:
    if not sharded:
        return (
            "the whole save blocks: the state gathered to the host and written (model.safetensors,"
            " optimizer.pt) before training goes on; the first save also compiles its gathers"
        )
    staged_gb = _staged_gb(figures)
    blocked = worst["blocked_seconds"]
    rate = staged_gb / blocked if blocked and blocked > 0 else None
    return (
        f"the staging copy of {staged_gb:.1f} GB (weights + both AdamW moments of all {DEVICES} CPU"
        " devices, held by one process)"
        + (f" at {rate:.1f} GB/s" if rate else "")
        + f" against a {worst['median_step_seconds']:.2f} s step"
    )


# -- peak RSS


def _staging_cost(figures: dict[str, Any], *, sharded: bool) -> str:
    """What a save adds to the peak RSS, in words."""
    if not sharded:
        return (
            "the full-file save: the whole state gathered to the host, and copied again as it is serialised"
            " (model.safetensors, optimizer.pt), on every host of a slice alike"
        )
    return (
        f"the staging copy: about the {STAGED_BYTES_PER_PARAM} B/param of the weights and both AdamW moments"
        f" ({_staged_gb(figures):.1f} GB), which one process stages for all {DEVICES} devices on PJRT CPU; on a"
        " slice of H hosts each host stages its own shards, state / H"
    )


def periodic_rss_verdicts(figures: dict[str, Any], *, sharded: bool) -> list[Verdict]:
    """The periodic run's peak RSS against plain's: the process's (the target's), and the training
    parts' alone (where the export is plain's peak, the process's hides what the saves cost training)."""
    return [
        _periodic_rss_verdict(figures, name, key, ratio_key, sharded=sharded)
        for name, key, ratio_key in (
            ("peak RSS with periodic checkpoints / without", "peak_rss_bytes", "peak_rss_to_plain"),
            ("  the same, training parts only", "train_peak_bytes", "train_peak_to_plain"),
        )
    ]


def _periodic_rss_verdict(
    figures: dict[str, Any], name: str, key: str, ratio_key: str, *, sharded: bool
) -> Verdict:
    plain, periodic = figures.get("plain") or {}, figures.get("periodic") or {}
    ratio = periodic.get(ratio_key)
    met = ratio is not None and ratio <= TARGET_PERIODIC_RSS
    extra = (
        (periodic[key] - plain[key]) / figures["params"]
        if periodic.get(key) is not None and plain.get(key) is not None
        else None
    )
    return Verdict(
        name,
        f"{_gb(periodic.get(key))} / {_gb(plain.get(key))} = {_x(ratio)}",
        f"<= {TARGET_PERIODIC_RSS}x",
        met if ratio is not None else None,
        ""
        if met or ratio is None or extra is None
        else f"+{extra:.1f} B/param: {_staging_cost(figures, sharded=sharded)}",
    )


def plain_rss_verdict(figures: dict[str, Any], fit: dict[str, Any] | None) -> Verdict:
    """The plain run's peak RSS against the training state; what it holds, from the fits over the sizes."""
    plain, state = figures.get("plain") or {}, figures["training_state_bytes"]
    ratio = plain.get("peak_rss_to_state")
    met = ratio is not None and ratio <= TARGET_PLAIN_RSS_TO_STATE
    return Verdict(
        "peak RSS without checkpoints / training state",
        f"{_gb(plain.get('peak_rss_bytes'))} / {_gb(state)} = {_x(ratio)}",
        f"<= {TARGET_PLAIN_RSS_TO_STATE}x",
        met if ratio is not None else None,
        ""
        if met or ratio is None
        else (
            "device memory is host memory on PJRT CPU: RSS holds the training state itself"
            f" ({STATE_BYTES_PER_PARAM} B/param) plus activations, XLA's buffers and the runtime (Python, torch,"
            f" torch_xla){_runtime_share(fit)}"
        ),
    )


def _runtime_share(fit: dict[str, Any] | None) -> str:
    if not fit or not fit.get("plain"):
        return ""
    share = f"; over the sizes, plain's peak is {fit['plain']['intercept_gb']} GB + {fit['plain']['bytes_per_param']} B/param"
    if fit.get("plain_train"):
        share += (
            f" (its training part {fit['plain_train']['intercept_gb']} GB"
            f" + {fit['plain_train']['bytes_per_param']} B/param)"
        )
    return share


# -- SIGTERM

_SIGTERM_LABELS = {"sigterm_in_save": "(a) in a save", "sigterm_between_saves": "(b) between saves"}


def sigterm_verdict(figures: dict[str, Any], kind: str, *, sharded: bool) -> Verdict:
    """A SIGTERM run: signal -> exit and the steps lost."""
    stop = figures.get(kind) or {}
    seconds, lost = stop.get("signal_to_exit_seconds"), stop.get("steps_lost")
    met = (
        stop.get("exit_code") == 75
        and seconds is not None
        and lost is not None
        and seconds <= TARGET_SIGTERM_EXIT_S
        and lost <= TARGET_STEPS_LOST
    )
    return Verdict(
        f"SIGTERM -> exit {_SIGTERM_LABELS[kind]}",
        f"{_s(seconds)} s, {lost} step(s) lost, {stop.get('saves_after_signal')} save(s) after the signal,"
        f" exit {stop.get('exit_code')}"
        if stop
        else "-",
        f"<= {TARGET_SIGTERM_EXIT_S:.0f} s, <= {TARGET_STEPS_LOST} step lost",
        met if stop else None,
        "" if met or not stop else _sigterm_limit(stop, kind, sharded=sharded),
    )


def _sigterm_limit(stop: dict[str, Any], kind: str, *, sharded: bool) -> str:
    when = (
        f"as checkpoint-{stop.get('step_at_signal')} was being saved"
        if kind == "sigterm_in_save"
        else f"during step {(stop.get('step_at_signal') or 0) + 1}"
    )
    return (
        f"exit {stop.get('exit_code')}; the signal came {when}, the run trained to step {stop.get('trained_to')}"
        " (a step boundary is where the Trainer has traced a step, before XLA runs it, and Python handles a"
        f" signal only once that run returns), then its stop's save took {_s(stop.get('stop_save_seconds'))} s"
        + ("" if sharded else " (synchronous, full-file, after the periodic save it interrupted)")
    )


# -- resume + export


def resume_verdict(figures: dict[str, Any], *, sharded: bool) -> Verdict:
    """The resume + export run's peak RSS against plain's training peak; where it is over, the part
    that peaked and why."""
    plain, resume = figures.get("plain") or {}, figures.get("resume_export") or {}
    ratio = resume.get("peak_rss_to_plain_train")
    met = ratio is not None and ratio <= TARGET_RESUME_RSS
    return Verdict(
        "resume + export peak RSS / training peak (plain's)",
        f"{_gb(resume.get('peak_rss_bytes'))} / {_gb(plain.get('train_peak_bytes'))} = {_x(ratio)}"
        f" (against plain's whole process, {_gb(plain.get('peak_rss_bytes'))}:"
        f" {_x(resume.get('peak_rss_to_plain'))})",
        f"<= {TARGET_RESUME_RSS}x",
        met if ratio is not None else None,
        "" if met or ratio is None else _resume_limit(figures, sharded=sharded),
    )


def _resume_limit(figures: dict[str, Any], *, sharded: bool) -> str:
    resume = figures.get("resume_export") or {}
    parts = {k: v for k, v in (resume.get("peak_rss_parts") or {}).items() if k != "process"}
    sampled = resume.get("phase_peaks_sampled") or {}
    limit = (
        "its parts: " + ", ".join(f"{k} {_gb(v)}" for k, v in parts.items())
        if parts
        else "its phases (sampled): " + ", ".join(f"{k} {_gb(v)}" for k, v in sampled.items())
    )
    if not sharded:
        limit += (
            "; it loads the whole model on the host (from_pretrained) and the full-file checkpoint"
            " (optimizer.pt), and saves full-file checkpoints and the model gathered"
        )
    return limit + _resume_peak_part(figures, parts)


def _resume_peak_part(figures: dict[str, Any], parts: dict[str, int]) -> str:
    """Why the part in which the resume's peak was reached peaked: the first, in run order, at the
    highest value (some trainers' parts were cumulative peaks: the first at the highest is where it
    was reached)."""
    resume = figures.get("resume_export") or {}
    in_order = [k for k in ("load", "train", "export") if k in parts]
    peak_part = next((k for k in in_order if parts[k] == max(parts.values())), None)
    group = (resume.get("export") or {}).get("largest_group_bytes")
    if peak_part == "export" and group:
        return (
            f"; the export's largest gather group is {_gb(group)}: gathered on the devices (host memory"
            " on PJRT CPU), copied to a host tensor and serialised, on top of the training state the"
            " process still holds"
        )
    if peak_part == "train":
        periodic_peak = (figures.get("periodic") or {}).get("peak_rss_bytes")
        return (
            f"; the peak is in its training, which saves every {SAVE_STEPS} steps as the periodic run"
            f" does (peak {_gb(periodic_peak)}; resume + export / periodic"
            f" {_x(_ratio(resume.get('peak_rss_bytes'), periodic_peak))}): the saves' staging copy,"
            " not the resume or the export"
        )
    return ""


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.2f} GB"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def phase_peaks(
    timeline: Sequence[Sequence[float]], marks: dict[str, float | None], end: float
) -> dict[str, int]:
    """Sampled peak RSS (bytes) of the harness's phases: load (until the dataset is ready), train (to
    the last step logged), after (the final save and the export, to the exit)."""
    bounds = [
        ("load", 0.0, marks.get("data_ready")),
        ("train", marks.get("data_ready"), marks.get("last_step")),
    ]
    bounds.append(("after", marks.get("last_step"), end))
    out = {}
    for name, start, stop in bounds:
        if start is None or stop is None:
            continue
        values = [int(s[1]) for s in timeline if start <= s[0] <= stop]
        if values:
            out[name] = max(values)
    return out


# ---- the harness ---------------------------------------------------------------------------------------


@dataclass
class Child:
    """One `tpuft train` process: its stderr read line by line, its RSS sampled, reaped with wait4."""

    argv: list[str]
    env: dict[str, str]
    on_line: Callable[[Child, float, str], None] | None = None
    timeout: float = RUN_TIMEOUT_S
    lines: list[tuple[float, str]] = field(default_factory=list)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    pid: int = 0
    started: float = 0.0
    _exited: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def signal(self, sig: int) -> bool:
        """Sends ``sig`` unless the process has exited (never to a reaped, maybe reused, pid)."""
        with self._lock:
            if self._exited:
                return False
            os.kill(self.pid, sig)
            return True

    def since(self) -> float:
        return time.monotonic() - self.started

    def run(self) -> dict[str, Any]:
        stat_before, self_before = _cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        self.started = time.monotonic()
        proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=_first_to_be_oom_killed,
        )
        self.pid = proc.pid
        assert proc.stderr is not None
        reader = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        sampler = threading.Thread(target=self._sample, daemon=True)
        reader.start()
        sampler.start()
        timer = threading.Timer(self.timeout, self.signal, args=(signal.SIGKILL,))
        timer.start()
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        ended = time.monotonic()
        with self._lock:
            self._exited = True
        timer.cancel()
        _, status, usage = os.wait4(self.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait)
        reader.join(timeout=10)
        sampler.join(timeout=10)
        wall = ended - self.started
        busy = _cpu_jiffies()[0] - stat_before[0]
        mine = resource.getrusage(resource.RUSAGE_SELF)
        own = mine.ru_utime + mine.ru_stime - self_before.ru_utime - self_before.ru_stime
        cpu = usage.ru_utime + usage.ru_stime
        others = busy / os.sysconf("SC_CLK_TCK") - cpu - own
        return {
            "exit_code": proc.returncode,
            "ru_maxrss_bytes": usage.ru_maxrss * 1024,
            "wall_seconds": round(wall, 2),
            "cpu_seconds": round(cpu, 1),
            "others_cpu_share": round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3),
            "timed_out": wall >= self.timeout,
        }

    def _read(self, stream: Any) -> None:
        for line in stream:
            t = self.since()
            self.lines.append((t, line.rstrip("\n")))
            if self.on_line is not None:
                try:
                    self.on_line(self, t, line)
                except Exception as error:  # a watcher's bug must not hang the run
                    print(f"   [scale] watcher failed: {error!r}", flush=True)

    def _sample(self) -> None:
        while not self._exited:
            try:
                fields = _status_fields(Path(f"/proc/{self.pid}/status"), ("VmRSS", "RssAnon", "RssFile"))
            except OSError:
                break
            if fields.get("VmRSS"):
                self.timeline.append(
                    (round(self.since(), 2), fields["VmRSS"], fields["RssAnon"], fields["RssFile"])
                )
            time.sleep(SAMPLE_S)


def _first_to_be_oom_killed() -> None:
    """In the child: the kernel's OOM killer takes it before anything else on the machine."""
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")


def _status_fields(path: Path, names: Sequence[str]) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[key] = int(value.split()[0]) * 1024
    return out


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def wait_for_quiet(max_wait: float = 900.0) -> float:
    """Waits (up to ``max_wait``) until the rest of the machine uses under DISTURBED of its CPU over
    5 s; returns the last share seen."""
    deadline = time.monotonic() + max_wait
    while True:
        before = _cpu_jiffies()
        time.sleep(5)
        after = _cpu_jiffies()
        share = (after[0] - before[0]) / max(1, after[1] - before[1])
        if share < DISTURBED or time.monotonic() > deadline:
            return round(share, 3)
        print(f"   [scale] the machine is busy ({share:.0%} CPU): waiting", flush=True)
        time.sleep(25)


@dataclass
class Trainer:
    """A trainer version: its import path and label (the working tree's, or a git ref's worktree)."""

    label: str
    pythonpath: str
    current: bool  # the working tree's: an unexpected failure ends the benchmark


def _env(trainer: Trainer, cache: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TPUFT_FAULT_") and k != "TPUFT_RESTART_ATTEMPT"
    }
    env.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(DEVICES),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        KUBECONFIG="/nonexistent",
        TPUFT_CACHE_DIR=str(cache),
        PYTHONPATH=trainer.pythonpath,
    )
    env.update(extra)
    return env


def config(model: Path, rows: Path, output: Path, *, save_steps: int | None) -> dict[str, Any]:
    """The trainer config of every run (the YAML contract, trainer_image/tpuft_trainer/config.py)."""
    training: dict[str, Any] = {
        "max_steps": STEPS,
        "learning_rate": 1e-4,
        "per_device_batch_size": 1,
        "max_seq_length": SEQ_LEN,
        "optimizer": "adamw",
    }
    if save_steps:
        training["save_steps"] = save_steps
    return {
        "model": {"name": str(model), "dtype": "float32"},
        "dataset": {"name": str(rows), "packing": True},
        "training": training,
        "output": {"uri": str(output)},
        "world": {"chips_per_host": DEVICES},
        # Reporting fails once (no cluster: KUBECONFIG=/nonexistent) and training goes on, as in a pod.
        "progress": {"namespace": "bench", "name": "scale", "min_interval_seconds": 0},
    }


def complete_checkpoints(output: Path) -> list[int]:
    return sorted(
        int(m.group(1))
        for p in output.glob("checkpoint-*")
        if (m := _CHECKPOINT.match(p.name)) and (p / _COMPLETE).is_file()
    )


class Watch:
    """Reads a run's stderr: the steps logged, when the data was ready, and (for the SIGTERM runs)
    when to signal and when the signal came."""

    def __init__(self, kind: str, output: Path, trainer: Trainer) -> None:
        self.kind, self.output, self.trainer = kind, output, trainer
        self.steps: dict[int, float] = {}
        self.data_ready: float | None = None
        self.signal: dict[str, Any] = {}
        self._started = False

    def __call__(self, child: Child, t: float, line: str) -> None:
        if self.data_ready is None and "training rows of" in line:
            self.data_ready = t
        if (match := _PROGRESS.search(line)) is not None:
            self.steps.setdefault(int(match.group(1)), t)
            step = int(match.group(1))
        else:
            step = None
        if self.kind == "sigterm_in_save":
            if self.trainer.current and (fault := _FAULT.search(line)) and not self.signal:
                self.signal = {"sent_by": "trainer (fault injection)", "at_seconds": t}
                self._finish_signal(child, int(fault.group(1)), in_flight=True)
            elif not self.trainer.current and step == IN_SAVE_STEP and not self._started:
                self._started = True  # the earlier trainer has no fault injection: the harness signals
                threading.Thread(target=self._signal_in_save, args=(child,), daemon=True).start()
        if self.kind == "sigterm_between_saves" and step == BETWEEN_STEP and not self._started:
            self._started = True
            threading.Thread(target=self._signal_between_saves, args=(child,), daemon=True).start()

    def _step_at(self) -> int:
        return max(self.steps, default=0)

    def _finish_signal(self, child: Child, step: int, *, in_flight: bool) -> None:
        self.signal.update(step_at_signal=step, save_in_flight=in_flight)

    def _signal_in_save(self, child: Child) -> None:
        """SIGTERM as soon as the synchronous save of step IN_SAVE_STEP has begun (its directory)."""
        name = self.output / f"checkpoint-{IN_SAVE_STEP}"
        deadline = time.monotonic() + 120
        while not name.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        complete = (name / _COMPLETE).exists()
        if child.signal(signal.SIGTERM):
            self.signal = {
                "sent_by": "harness, as checkpoint-4's directory appeared",
                "at_seconds": round(child.since(), 3),
                "step_at_signal": self._step_at(),
                "save_in_flight": not complete,
            }

    def _signal_between_saves(self, child: Child) -> None:
        """SIGTERM a third of a step into the step after BETWEEN_STEP, once that step's save is complete
        (on storage: no save in flight). A third of a step: that of step BETWEEN_STEP, after the warm-up."""
        last, before = self.steps.get(BETWEEN_STEP), self.steps.get(BETWEEN_STEP - 1)
        step = (last - before) if last is not None and before is not None else 1.0
        saved = self.output / f"checkpoint-{BETWEEN_STEP}" / _COMPLETE
        deadline = time.monotonic() + 600
        while not saved.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(step / 3)
        writing = [
            p.name for p in self.output.glob("checkpoint-*") if p.is_dir() and not (p / _COMPLETE).exists()
        ]
        if child.signal(signal.SIGTERM):
            self.signal = {
                "sent_by": f"harness, {step / 3:.2f} s after checkpoint-{BETWEEN_STEP} was complete",
                "at_seconds": round(child.since(), 3),
                "step_at_signal": self._step_at(),
                "save_in_flight": bool(writing),
            }


METRICS_KEYS = (
    "compiles_after_step",
    "step_seconds",
    "peak_rss",
    "attempt",
    "stopped",
    "export",
    "model_load",
    "resumed_from",
    "final_step",
    "seconds",
)


def measure(
    trainer: Trainer,
    kind: str,
    model: Path,
    rows: Path,
    output: Path,
    work: Path,
    resume_from: Path | None = None,
) -> dict[str, Any]:
    """One run of ``kind`` at a fresh ``output`` (holding a copy of ``resume_from``, a checkpoint
    directory, when given); re-run (up to RERUNS times) when the rest of the machine took more than
    DISTURBED of its CPU meanwhile. The record of the least disturbed attempt, with the others' shares."""
    tries: list[dict[str, Any]] = []
    for _ in range(RERUNS + 1):
        shutil.rmtree(output, ignore_errors=True)
        output.mkdir(parents=True)
        if resume_from is not None:
            shutil.copytree(resume_from, output / resume_from.name)
        before = wait_for_quiet()
        record = _run_once(trainer, kind, model, rows, output, work)
        record["machine_busy_before"] = before
        tries.append(record)
        if record["others_cpu_share"] <= DISTURBED or record["exit_code"] != EXPECTED_EXIT[kind]:
            break
        print(
            f"   [scale] {kind}: others took {record['others_cpu_share']:.0%} of the CPU: again", flush=True
        )
    return _best(tries)


def _best(tries: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(tries, key=lambda r: r["others_cpu_share"])
    best["attempts_others_cpu_share"] = [r["others_cpu_share"] for r in tries]
    return best


def _run_once(
    trainer: Trainer, kind: str, model: Path, rows: Path, output: Path, work: Path
) -> dict[str, Any]:
    import yaml

    body = config(model, rows, output, save_steps=None if kind == "plain" else SAVE_STEPS)
    path = work / f"{trainer.label}-{kind}.yaml"
    path.write_text(yaml.safe_dump(body))
    extra = {}
    if kind == "sigterm_in_save" and trainer.current:
        extra["TPUFT_FAULT_SIGTERM_IN_SAVE_AT_STEP"] = str(IN_SAVE_STEP)
    if kind == "resume_export":
        extra["TPUFT_RESTART_ATTEMPT"] = "1"
    watch = Watch(kind, output, trainer)
    argv = [str(Path(sys.executable).with_name("tpuft")), "train", "--config", str(path)]
    child = Child(argv, _env(trainer, work / "cache", **extra), on_line=watch)
    print(f"   [scale] {trainer.label} {kind}: {model.parent.name}", flush=True)
    record = child.run()
    end = record["wall_seconds"]
    metrics_file = output / "tpuft-metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    record["metrics"] = {k: metrics.get(k) for k in METRICS_KEYS if k in metrics} if metrics else None
    parts = (metrics or {}).get("peak_rss") or {}
    sampled = max((sample[1] for sample in child.timeline), default=0)
    record["peak_rss_bytes"] = peak_rss(record["ru_maxrss_bytes"], sampled, parts)
    record["peak_rss_sources"] = {
        "ru_maxrss": record["ru_maxrss_bytes"],
        "sampled": sampled,
        "trainer": max(parts.values(), default=None),
    }
    record["steps_logged"] = sorted(watch.steps)
    record["first_step_logged_seconds"] = watch.steps.get(min(watch.steps)) if watch.steps else None
    record["checkpoints"] = complete_checkpoints(output)
    if watch.signal:
        sig = dict(watch.signal)
        sig["to_exit_seconds"] = round(end - sig["at_seconds"], 2)
        record["signal"] = sig
    marks = {
        "data_ready": watch.data_ready,
        "last_step": watch.steps.get(max(watch.steps)) if watch.steps else None,
    }
    record["phase_peaks_sampled"] = phase_peaks(child.timeline, marks, end)
    record["rss_timeline"] = _thin(child.timeline)
    record["events"] = [[round(t, 2), f"step {s}"] for s, t in sorted(watch.steps.items())]
    if watch.data_ready is not None:
        record["events"].insert(0, [round(watch.data_ready, 2), "data ready"])
    if watch.signal:
        record["events"].append([watch.signal["at_seconds"], "SIGTERM"])
    if record["exit_code"] != EXPECTED_EXIT[kind]:
        record["stderr_tail"] = [line for _, line in child.lines[-40:]]
        failure = (
            f"{trainer.label} {kind} ({model.parent.name}): exit {record['exit_code']}"
            f" (expected {EXPECTED_EXIT[kind]}), peak RSS {record['peak_rss_bytes'] / GB:.2f} GB;"
            f" command: {' '.join(argv)}\n" + "\n".join(record["stderr_tail"])
        )
        print(f"   [scale] {failure}", flush=True)
        # Dying of memory (SIGKILL by the OOM killer, or the trainer's OUT_OF_MEMORY) is a result;
        # anything else the current trainer does wrong ends the benchmark with its log.
        if trainer.current and record["exit_code"] not in (-signal.SIGKILL, 78):
            raise SystemExit(f"the current trainer failed: {failure}")
    gb = record["peak_rss_bytes"] / GB
    print(
        f"   [scale]   exit {record['exit_code']}, peak RSS {gb:.2f} GB, {record['wall_seconds']:.0f} s,"
        f" others' CPU {record['others_cpu_share']:.0%}",
        flush=True,
    )
    return record


def _thin(timeline: Sequence[tuple[float, int, int, int]], every: float = 1.0) -> list[list[float]]:
    """One sample a second (the second's largest RSS), in MB: [seconds, rss, anon, file]."""
    out: dict[int, tuple[float, int, int, int]] = {}
    for sample in timeline:
        key = int(sample[0] / every)
        if key not in out or sample[1] > out[key][1]:
            out[key] = sample
    return [[s[0], round(s[1] / 1e6), round(s[2] / 1e6), round(s[3] / 1e6)] for _, s in sorted(out.items())]


# ---- the materials (in a process of their own: torch stays out of the harness) ------------------------


def materials_worker(root: Path, size: str) -> dict[str, Any]:
    """A model of ``size`` (float32, untied embeddings), a word-level tokenizer with a pad token, and
    made-up documents (log-normal lengths, median 60 words) for well over STEPS packed steps."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dims = SIZES[size]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            **dims,
            num_key_value_heads=dims["num_attention_heads"],
            vocab_size=VOCAB,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            use_cache=False,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=2,
        )
    )
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(root / "model")
    del model
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(root / "model")
    rng = random.Random(38)
    with (root / "documents.jsonl").open("w") as out:
        for _ in range(400):
            words = max(8, min(400, round(rng.lognormvariate(4.1, 0.7))))
            out.write(
                json.dumps({"text": " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(words))}) + "\n"
            )
    return {"params": params, "model": dims}


def build_materials(root: Path, size: str, trainer: Trainer) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "bench.scale", "materials", str(root), size],
        env=_env(trainer, root / "cache"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        raise SystemExit(f"building the {size} model failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---- the earlier trainer --------------------------------------------------------------------------------


def add_worktree(ref: str) -> tuple[Path, str]:
    """``ref`` checked out in a detached git worktree under /tmp (the working tree is not touched)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = Path(tempfile.mkdtemp(prefix=f"tpuft-scale-{ref}-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True, capture_output=True
    )
    return path, commit


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)
    shutil.rmtree(path.parent, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def _check_imports(trainer: Trainer, root: Path) -> str:
    """Where the trainer's package comes from under ``trainer``'s PYTHONPATH (it must be its tree)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tpuft_trainer, tpuft_operator; print(tpuft_trainer.__file__, tpuft_operator.__file__)",
        ],
        env=_env(trainer, Path(tempfile.gettempdir())),
        capture_output=True,
        text=True,
        check=True,
    )
    where = done.stdout.strip()
    if not all(path.startswith(str(root)) for path in where.split()):
        raise SystemExit(f"{trainer.label}: tpuft_trainer is imported from {where}, not from {root}")
    return where


def _source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted((root / "trainer_image" / "tpuft_trainer").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


# ---- the benchmark ------------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    memory = _status_fields(Path("/proc/meminfo"), ("MemTotal",)).get("MemTotal", 0)
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model, "memory_gib": round(memory / 2**30, 1)}


def _load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(sizes: Sequence[str] = tuple(SIZES), compare_ref: str | None = None) -> dict[str, Any]:
    started = datetime.now(UTC)
    work = Path(tempfile.mkdtemp(prefix="tpuft-bench-scale-"))
    current = Trainer(
        "current", os.pathsep.join(str(REPO / d) for d in ("operator", "trainer_image", "devtools")), True
    )
    trainers = [current]
    worktree: Path | None = None
    results: dict[str, Any] = {
        "what": (
            f"Llama-style models ({', '.join(sizes)}), float32 full fine-tunes with AdamW on {DEVICES} PJRT CPU"
            f" devices: rows of {SEQ_LEN} packed from made-up documents, 1 row per device and step, {STEPS} steps;"
            f" plain, saveSteps {SAVE_STEPS}, SIGTERM in a save and between saves, resume + export; each run a"
            " `tpuft train` process of its own, one at a time"
        ),
        "machine": _machine(),
        "load_average_before": _load_average(),
        "config": {
            "steps": STEPS,
            "save_steps": SAVE_STEPS,
            "seq_len": SEQ_LEN,
            "devices": DEVICES,
            "per_device_batch_size": 1,
            "optimizer": "adamw",
            "dtype": "float32",
            "gradient_checkpointing": True,
            "state_bytes_per_param": STATE_BYTES_PER_PARAM,
        },
        "trainer": {
            "head": _git("rev-parse", "--short", "HEAD"),
            "changed_files": _git("status", "--porcelain", "--", "trainer_image").splitlines(),
            "source_sha256": _source_digest(REPO),
        },
        "targets": {
            "size": TARGET_SIZE,
            "blocked_to_median_step": TARGET_BLOCKED_TO_STEP,
            "periodic_rss_to_plain": TARGET_PERIODIC_RSS,
            "plain_rss_to_state": TARGET_PLAIN_RSS_TO_STATE,
            "sigterm_to_exit_seconds": TARGET_SIGTERM_EXIT_S,
            "steps_lost": TARGET_STEPS_LOST,
            "resume_export_rss_to_plain": TARGET_RESUME_RSS,
        },
    }
    try:
        results["trainer"]["imports"] = _check_imports(current, REPO)
        if compare_ref:
            worktree, commit = add_worktree(compare_ref)
            ref = Trainer(
                compare_ref,
                os.pathsep.join(str(worktree / d) for d in ("operator", "trainer_image", "devtools")),
                False,
            )
            results["compare_ref"] = {
                "ref": compare_ref,
                "commit": commit,
                "imports": _check_imports(ref, worktree),
            }
            trainers.append(ref)
        runs: dict[str, dict[str, dict[str, Any]]] = {t.label: {} for t in trainers}
        params: dict[str, int] = {}
        models: dict[str, Any] = {}
        for size in sizes:
            root = work / size
            print(f">> scale: {size}", flush=True)
            made = build_materials(root, size, current)
            params[size], models[size] = made["params"], made["model"]
            for trainer in trainers:
                runs[trainer.label][size] = {}
            # The versions alternate run by run: whatever else loads the machine loads both alike.
            for kind in RUNS:
                for trainer in trainers:
                    done = runs[trainer.label][size]
                    here = work / trainer.label / size
                    resume_from = None
                    if kind == "resume_export":
                        if not run_ok(done.get("sigterm_in_save"), "sigterm_in_save"):
                            continue  # nothing to resume from
                        resume_from = next(here.glob("stop/checkpoint-*"))
                    done[kind] = measure(
                        trainer,
                        kind,
                        root / "model",
                        root / "documents.jsonl",
                        here / kind,
                        work,
                        resume_from,
                    )
                    if kind == "sigterm_in_save" and done[kind]["checkpoints"]:
                        # What the stop left to resume from, kept for resume_export (and its re-runs).
                        name = f"checkpoint-{max(done[kind]['checkpoints'])}"
                        shutil.copytree(here / kind / name, here / "stop" / name)
                    shutil.rmtree(here / kind, ignore_errors=True)
            for trainer in trainers:
                shutil.rmtree(work / trainer.label / size, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
        results["sizes"] = _sizes(runs[current.label], params, models)
        if compare_ref:
            results["compare_ref"]["sizes"] = _sizes(runs[compare_ref], params, models)
    finally:
        if worktree is not None:
            remove_worktree(worktree)
        shutil.rmtree(work, ignore_errors=True)
    results["when"] = f"{started:%Y-%m-%d %H:%M}-{datetime.now(UTC):%H:%M} UTC"
    results["load_average_after"] = _load_average()
    _judge(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"   [scale] written to {RESULTS} and {plot(results)}", flush=True)  # the report: python -m bench
    return results


def _sizes(
    runs: dict[str, dict[str, Any]], params: dict[str, int], models: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    return {
        size: {"model": models[size], "figures": size_figures(by_kind, params[size]), "runs": by_kind}
        for size, by_kind in runs.items()
    }


def _judge(results: dict[str, Any]) -> None:
    """The fits over the sizes and the target verdicts, for the current trainer and the earlier one."""
    for side in (results, results.get("compare_ref")):
        if not side or "sizes" not in side:
            continue
        for s in side["sizes"].values():  # from the runs again: the figures follow this code
            s["figures"] = size_figures(s["runs"], s["figures"]["params"])
        figures = {size: s["figures"] for size, s in side["sizes"].items()}
        side["fits"] = fits(figures)
        if TARGET_SIZE in figures:
            side["verdicts"] = [
                v.to_json() for v in verdicts(figures[TARGET_SIZE], side["fits"], sharded=side is results)
            ]


# ---- the report and the plot --------------------------------------------------------------------------


def _table(label: str, sizes: dict[str, Any]) -> list[str]:
    lines = [
        f"  {label}:",
        f"  {'size':>5} {'params':>7} {'state':>6} {'plain':>6} {'train':>6} {'periodic':>8} {'x':>5}"
        f" {'step s':>6} {'blocked s (x step)':>22} {'device wait s':>15} {'write s':>10} {'TERM a s/lost/saves':>20}"
        f" {'TERM b s/lost/saves':>20} {'resume':>7} {'x':>5} {'load/startup s':>14}",
    ]
    for size, entry in sizes.items():
        f = entry["figures"]
        plain, periodic, resume = f.get("plain") or {}, f.get("periodic") or {}, f.get("resume_export") or {}
        saves = periodic.get("saves") or []
        blocked = " ".join(
            f"{s['blocked_seconds']:.2f}({s['blocked_to_median_step']:.2f})"
            for s in saves
            if s["blocked_seconds"] is not None and s["blocked_to_median_step"] is not None
        )
        writes = " ".join(f"{s['write_seconds']:.1f}" for s in saves if s["write_seconds"] is not None) or "-"
        device_waits = (
            " ".join(
                f"{s['device_wait_seconds']:.1f}" for s in saves if s.get("device_wait_seconds") is not None
            )
            or "-"
        )

        def stop(kind: str, f: dict[str, Any] = f) -> str:
            s = f.get(kind)
            if not s:
                return "-"
            if s["exit_code"] != 75:
                return f"exit {s['exit_code']}"
            return f"{_s(s['signal_to_exit_seconds'])}/{s['steps_lost']}/{s['saves_after_signal']}"

        def rss(part: dict[str, Any]) -> str:
            text = _gb(part.get("peak_rss_bytes")).replace(" GB", "")
            return text if part.get("exit_code") in (0, None) else f"{text}!{part.get('exit_code')}"

        train = plain.get("train_peak_bytes")
        lines.append(
            f"  {size:>5} {f['params'] / 1e6:>6.0f}M {f['training_state_bytes'] / GB:>6.2f} {rss(plain):>6}"
            f" {_gb(train).replace(' GB', ''):>6} {rss(periodic):>8} {_x(periodic.get('peak_rss_to_plain')).rstrip('x'):>5}"
            f" {_s3(plain.get('median_step_seconds')):>6} {blocked or '-':>22} {device_waits:>15} {writes:>10}"
            f" {stop('sigterm_in_save'):>20} {stop('sigterm_between_saves'):>20} {rss(resume):>7}"
            f" {_x(resume.get('peak_rss_to_plain')).rstrip('x'):>5}"
            f" {_s(resume.get('model_load_seconds')) + '/' + _s(resume.get('startup_seconds')):>14}"
        )
    return lines


def _s3(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    lines = [
        f"scale ({results['when']}; {machine['cpus']} CPUs, {machine['memory_gib']} GiB; bench/results/scale.json):",
        f"  {results['what']}",
        "  (GB: peak RSS of the process, the largest of ru_maxrss, the 0.25 s samples and the trainer's"
        " parts; train: the peak of the training part; x: against plain; !N: exit N)",
    ]
    lines += _table(
        f"current trainer ({results['trainer']['head']} + working tree)", results.get("sizes") or {}
    )
    ref = results.get("compare_ref")
    if ref and ref.get("sizes"):
        lines += _table(f"{ref['ref']} ({ref['commit'][:7]}; blocked: the step-time gap)", ref["sizes"])
    for side, label in ((results, "current"), (ref, ref["ref"] if ref else "")):
        if not side or not side.get("verdicts"):
            continue
        fit = side.get("fits") or {}
        shown = "; ".join(
            f"{kind} {f['intercept_gb']} GB + {f['bytes_per_param']} B/param" for kind, f in fit.items() if f
        )
        lines.append(f"  peak RSS over the sizes ({label}): {shown or '-'}")
        lines.append(f"  targets at {TARGET_SIZE} ({label}):")
        for v in side["verdicts"]:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[v["met"]]
            limit = f" (limited by: {v['limited_by']})" if v.get("limited_by") else ""
            lines.append(f"    {v['name']}: {v['value']} (target {v['target']}: {verdict}){limit}")
    return lines


def plot(results: dict[str, Any], path: Path = PNG) -> Path:
    """scale.png: four panels (peak RSS over the sizes, what a periodic save blocks, SIGTERM -> exit,
    the RSS timeline of one size), the current trainer in solid lines, an earlier one dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = _plot_sides(results)
    fig, ((rss_ax, blocked_ax), (term_ax, line_ax)) = plt.subplots(2, 2, figsize=(13, 9))
    _plot_peak_rss(rss_ax, sides)
    _plot_saves(blocked_ax, sides)
    _plot_sigterm(term_ax, sides)
    _plot_rss_timeline(line_ax, sides)
    fig.suptitle(
        f"tpuft train at three sizes on {DEVICES} PJRT CPU devices ({results.get('when', '')})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


_Side = tuple[str, dict[str, Any], str]  # (label, sizes, line style)


def _plot_sides(results: dict[str, Any]) -> list[_Side]:
    """The current trainer (solid lines), and the earlier one where it ran (dashed)."""
    sides: list[_Side] = [("current", results.get("sizes") or {}, "-")]
    ref = results.get("compare_ref")
    if ref and ref.get("sizes"):
        sides.append((ref["ref"], ref["sizes"], "--"))
    return sides


def _millions(size: dict[str, Any]) -> float:
    return float(size["figures"]["params"]) / 1e6


def _plot_peak_rss(ax: Any, sides: list[_Side]) -> None:
    """Each run's peak RSS over the sizes, against the training state and the 2x target."""
    current = sides[0][1]
    if current:
        millions = [_millions(s) for s in current.values()]
        state = [m * 1e6 * STATE_BYTES_PER_PARAM / GB for m in millions]
        ax.plot(millions, state, "k-", lw=1, label="training state (16 B/param)")
        ax.plot(
            millions, [TARGET_PLAIN_RSS_TO_STATE * s for s in state], "k:", lw=1, label="2 x state (target)"
        )
    colors = {"plain": "tab:blue", "periodic": "tab:orange", "resume_export": "tab:green"}
    for label, sizes, style in sides:
        for kind, color in colors.items():
            points = [
                (_millions(s), f["peak_rss_bytes"] / GB, f["exit_code"])
                for s in sizes.values()
                if (f := s["figures"].get(kind)) and f.get("peak_rss_bytes")
            ]
            if not points:
                continue
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                color=color,
                marker="o",
                label=f"{kind} ({label})",
            )
            for x, y, code in points:
                if code != EXPECTED_EXIT[kind]:
                    ax.annotate(f"exit {code}", (x, y), fontsize=7, color=color)
    ax.set(xlabel="parameters (M)", ylabel="peak RSS (GB)", title="peak RSS of the process")
    ax.legend(fontsize=7)


def _plot_saves(ax: Any, sides: list[_Side]) -> None:
    """Each periodic save's blocked seconds over the sizes, against the median step and the target;
    apart from them, its wait for the device (not lost), where the trainer timed it."""
    for label, sizes, style in sides:
        marker = "o" if style == "-" else "s"
        waited = False
        for s in sizes.values():
            for save in (s["figures"].get("periodic") or {}).get("saves") or []:
                if save["blocked_seconds"] is not None:
                    ax.plot(
                        _millions(s), max(save["blocked_seconds"], 1e-3), marker, color="tab:red", alpha=0.7
                    )
                if save.get("device_wait_seconds") is not None:
                    waited = True
                    ax.plot(
                        _millions(s),
                        max(save["device_wait_seconds"], 1e-3),
                        marker,
                        color="tab:olive",
                        alpha=0.7,
                    )
        ax.plot([], [], marker, color="tab:red", label=f"blocked per periodic save ({label})")
        if waited:
            ax.plot([], [], marker, color="tab:olive", label=f"its wait for the device, not lost ({label})")
        steps = _median_steps(sizes)
        if steps:
            ax.plot(
                [p for p, _ in steps],
                [m for _, m in steps],
                style,
                marker="_",
                color="tab:gray",
                label=f"median step ({label})",
            )
            ax.plot(
                [p for p, _ in steps],
                [TARGET_BLOCKED_TO_STEP * m for _, m in steps],
                style,
                color="tab:gray",
                lw=0.8,
                alpha=0.5,
                label=f"{TARGET_BLOCKED_TO_STEP} x median step ({label})",
            )
    ax.set(xlabel="parameters (M)", ylabel="seconds", yscale="log", title="what a periodic save blocks")
    ax.legend(fontsize=7)


def _median_steps(sizes: dict[str, Any]) -> list[tuple[float, float]]:
    """(parameters in millions, the median step its periodic saves were judged against) per size."""
    steps = []
    for s in sizes.values():
        median = ((s["figures"].get("periodic") or {}).get("saves") or [{}])[0].get("median_step_seconds")
        if median:
            steps.append((_millions(s), median))
    return steps


def _plot_sigterm(ax: Any, sides: list[_Side]) -> None:
    """Signal -> exit of both SIGTERM runs over the sizes; a run that died is marked at 0."""
    for label, sizes, style in sides:
        for kind, color in (("sigterm_in_save", "tab:purple"), ("sigterm_between_saves", "tab:brown")):
            exits = [
                (_millions(s), f["signal_to_exit_seconds"])
                for s in sizes.values()
                if (f := s["figures"].get(kind))
                and f.get("signal_to_exit_seconds") is not None
                and f.get("exit_code") == EXPECTED_EXIT[kind]
            ]
            for s in sizes.values():  # a run that died (an earlier trainer, OOM-killed) is marked
                f = s["figures"].get(kind) or {}
                if f and f.get("exit_code") != EXPECTED_EXIT[kind]:
                    ax.plot(_millions(s), 0, "x", color=color, ms=9)
                    ax.annotate(
                        f"exit {f.get('exit_code')} ({label})", (_millions(s), 0), fontsize=7, color=color
                    )
            if exits:
                ax.plot(
                    [p for p, _ in exits],
                    [v for _, v in exits],
                    style,
                    marker="o",
                    color=color,
                    label=f"{kind} ({label})",
                )
    ax.axhline(TARGET_SIGTERM_EXIT_S, color="k", ls=":", lw=1, label="target")
    ax.set(xlabel="parameters (M)", ylabel="seconds", title="SIGTERM -> process exit")
    ax.legend(fontsize=7)


def _plot_rss_timeline(ax: Any, sides: list[_Side]) -> None:
    """The RSS over time of the plain and periodic runs of one size (TARGET_SIZE where it ran), with
    the periodic run's data-ready and step ends."""
    current = sides[0][1]
    shown = TARGET_SIZE if TARGET_SIZE in current else next(reversed(current), TARGET_SIZE)
    for label, sizes, style in sides:
        for kind, color in (("plain", "tab:blue"), ("periodic", "tab:orange")):
            run = ((sizes.get(shown) or {}).get("runs") or {}).get(kind) or {}
            timeline = run.get("rss_timeline") or []
            if not timeline:
                continue
            ax.plot(
                [t[0] for t in timeline],
                [t[1] / 1e3 for t in timeline],
                style,
                color=color,
                label=f"{kind} ({label})",
            )
            for t, what in run.get("events") or []:
                if kind == "periodic" and (what.startswith("step") or what == "data ready"):
                    ax.axvline(t, color=color, lw=0.4, ls=style, alpha=0.6)
    ax.set(
        xlabel="seconds since start",
        ylabel="RSS (GB)",
        title=f"{shown}: RSS over time (lines: the periodic run's data ready, each step)",
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def parser() -> argparse.ArgumentParser:
    parsed = argparse.ArgumentParser(prog="python -m bench scale")
    parsed.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parsed.add_argument(
        "--compare-ref",
        metavar="REF",
        default=None,
        help="also run an earlier trainer from git (e.g. 768b6be)",
    )
    return parsed


def cli(argv: Sequence[str]) -> dict[str, Any]:
    args = parser().parse_args(argv)
    return main(args.sizes, args.compare_ref)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "materials":
        print(json.dumps(materials_worker(Path(sys.argv[2]), sys.argv[3])))
    else:
        print("\n".join(report(cli(sys.argv[1:]))))
