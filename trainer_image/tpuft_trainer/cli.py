"""`tpuft train --config FILE` and `tpuft prepare --config FILE`: the training core and the data
prepare step, exiting with the documented codes.

The exit code is the operator's only signal of *why* a pod failed: user errors (exit_codes.py) end the
run at once, anything else is treated as infrastructure and restarted from the latest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from tpuft_trainer.errors import StoppedAfterCheckpoint, TrainerError
from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.pod_contract import JOB_COMPLETION_INDEX_ENV, LOG_LEVEL_ENV, TPU_WORKER_ID_ENV
from tpuft_trainer.prepare_contract import PrepareSummary, error_message

if TYPE_CHECKING:
    from tpuft_trainer.config import TrainerConfig

log = logging.getLogger("tpuft_trainer")

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM while")


def exit_code_for(error: BaseException) -> int:
    """The exit code for an exception that ended the run."""
    if isinstance(error, TrainerError):
        return int(error.exit_code)
    if isinstance(error, MemoryError) or any(marker in str(error) for marker in OOM_MARKERS):
        return ExitCode.OUT_OF_MEMORY
    if "Could not find the transformer layer class" in str(error):
        return ExitCode.CONFIG_ERROR
    return 1


def _setup_logging() -> None:
    rank = os.environ.get(TPU_WORKER_ID_ENV, os.environ.get(JOB_COMPLETION_INDEX_ENV, "0"))
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format=f"%(asctime)s [host {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# Both commands read the same file: the trainer configuration the operator rendered.
config_option = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The trainer configuration the operator rendered (YAML, tpuft.dev/trainer-config/v1).",
)


@click.command("train")
@config_option
def train(config_path: Path) -> None:
    """Run the FSDPv2 training core from a rendered configuration.

    \b
    Exit codes: 0 success; 64 bad configuration; 65 bad dataset; 66 model, dataset or output not
    found; 77 permission denied; 78 out of memory; 75 stopped by SIGTERM after every host saved the
    same step (restarted, not counted against maxRestarts); anything else is an infrastructure
    failure that the JobSet restarts (resuming from the latest checkpoint).

    \b
    SIGTERM (suspend, preemption, a node drain) makes every host save the step it reaches and exit
    within the grace period; a save cut off by SIGKILL is never resumed from.
    """
    _setup_logging()
    config = _load_config(config_path)
    if config.backend == "native":
        _train_native(config, config_path)

    from tpuft_trainer.train import run

    _run_to_exit(run, config)


def _run_to_exit(
    run: Callable[[TrainerConfig], Any],
    config: TrainerConfig,
    noted: Callable[[int], None] = lambda code: None,
) -> NoReturn:
    """Runs a training loop (either backend's) and exits with its outcome's code, logged as the
    operator's failure split reads it; ``noted`` hears the code first (the native launcher's note)."""
    try:
        record = run(config)
    except StoppedAfterCheckpoint as stopped:
        log.warning("%s (exit %d)", stopped, stopped.exit_code)
        noted(stopped.exit_code)
        end(stopped.exit_code)
    except Exception as error:
        code = exit_code_for(error)
        if code == 1:
            log.exception("training failed (infrastructure or unknown error; the JobSet may restart it)")
        else:
            log.error("training failed (%s, exit %d): %s", ExitCode(code).name, code, error)
        noted(code)
        end(code)
    log.info("done: %d steps in %.1f s", record.final_step, record.seconds)
    noted(ExitCode.OK)
    end(ExitCode.OK)


def _train_native(config: TrainerConfig, config_path: Path) -> NoReturn:
    """backend native: on the pod, the launcher (one worker process per chip, native/launcher.py);
    in a worker, the owned training loop (native/loop.py). Neither imports torch_xla."""
    from tpuft_trainer.native import launcher

    if not launcher.is_worker(os.environ):
        try:
            code = launcher.launch(config, config_path)
        except TrainerError as error:
            code = int(error.exit_code)
            try:
                kind = ExitCode(code).name
            except ValueError:  # exit 1 (a WorldError: the hosts cannot meet) is the infrastructure's
                kind = "infrastructure"
            log.error("launch failed (%s, exit %d): %s", kind, code, error)
        end(code)
    from tpuft_trainer.native.loop import run

    _run_to_exit(run, config, noted=launcher.note_exit)


def _load_config(config_path: Path, summary_file: Path | None = None) -> TrainerConfig:
    from pydantic import ValidationError

    from tpuft_trainer.config import TrainerConfig

    try:
        return TrainerConfig.load(config_path)
    except (OSError, ValueError, ValidationError) as error:
        message = f"invalid trainer configuration {config_path}: {error}"
    except Exception as error:  # a YAML syntax error
        message = f"unreadable trainer configuration {config_path}: {error}"
    log.error("%s", message)
    _write_summary(summary_file, error_message(message, ExitCode.CONFIG_ERROR))
    sys.exit(ExitCode.CONFIG_ERROR)


@click.command("prepare")
@config_option
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes that tokenise (default: the CPUs this process may use, at most 16).",
)
@click.option(
    "--summary-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the result as one line of JSON (the prepare Job: /dev/termination-log).",
)
def prepare(config_path: Path, workers: int | None, summary_file: Path | None) -> None:
    """Prepare the run's dataset once, on CPU, and check the run before any TPU is requested.

    \b
    Reads the tokenizer (never the weights) and the dataset, renders chat, tokenises on a pool of
    workers, drops rows with nothing to learn, holds out the evaluation rows, packs or pads, and
    writes the result under <output>/prepared/<fingerprint>/ (memory-mappable files, a manifest, a
    completion marker written last). A complete one with the same fingerprint is reused as it is:
    `tpuft train` then reads it instead of tokenising. Also checks that the model's config and
    tokenizer are readable with the run's token, its weight files are there, and the output is
    writable, and reports the model's dimensions (its parameters counted from the safetensors
    headers) for the operator's plan. Exit codes as `tpuft train`'s: 64-78 are user errors (the run
    fails, no TPU is requested); anything else is retried.
    """
    _setup_logging()
    config = _load_config(config_path, summary_file)
    from tpuft_trainer.data import preflight
    from tpuft_trainer.data.prepare import default_workers
    from tpuft_trainer.data.prepared import EVAL, TRAIN

    try:
        ready = preflight.run(config, workers=workers or default_workers())
    except Exception as error:
        code = exit_code_for(error)
        if code == 1:
            log.exception("prepare failed (infrastructure or unknown error; the Job retries it)")
        else:
            log.error("prepare failed (%s, exit %d): %s", ExitCode(code).name, code, error)
        _write_summary(summary_file, error_message(str(error), code))
        sys.exit(code)
    manifest = ready.prepared.manifest
    train = manifest.splits[TRAIN]
    summary = PrepareSummary(
        fingerprint=manifest.fingerprint,
        reused=ready.prepared.reused,
        documents=train.documents,
        dropped=train.dropped,
        rows=train.rows,
        positions=manifest.positions(),
        loss_tokens=train.loss_tokens,
        eval_rows=manifest.splits[EVAL].rows if EVAL in manifest.splits else 0,
        seconds=0.0 if ready.prepared.reused else manifest.seconds,
        tokens_per_second=0.0 if ready.prepared.reused else manifest.tokens_per_second,
        model=ready.model,
    )
    _write_summary(summary_file, summary.to_message())
    click.echo(summary.to_message())


def _write_summary(path: Path | None, text: str) -> None:
    if path is None:
        return
    try:
        path.write_text(text)
    except OSError as error:  # the result is in the log either way
        log.warning("could not write the summary to %s: %s", path, error)


def end(code: int) -> NoReturn:
    """Ends a run that has started the XLA runtime with exit ``code``, after the logs are out, and
    without the interpreter's teardown. torch_xla's runtime threads can race that teardown into a
    native abort (SIGABRT, "terminate called without an active exception"; pytorch/xla#4033; seen
    in this project's tests after errors raised inside a training loop), and the abort would turn a
    64 into 134: a user error read as infrastructure and restarted, or a SIGTERM stop (75) counted
    against maxRestarts. Nothing is lost by skipping the teardown: by now every save and upload has
    returned, and the trainer starts no threads and registers no exit handlers of its own."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
