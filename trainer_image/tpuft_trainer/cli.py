"""`tpuft train --config FILE`: run the training core, exiting with the documented codes.

The exit code is the operator's only signal of *why* a pod failed: user errors (exit_codes.py) end the
run at once, anything else is treated as infrastructure and restarted from the latest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from tpuft_trainer.errors import StoppedAfterCheckpoint, TrainerError
from tpuft_trainer.exit_codes import ExitCode
from tpuft_trainer.pod_contract import JOB_COMPLETION_INDEX_ENV, LOG_LEVEL_ENV, TPU_WORKER_ID_ENV

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


@click.command("train")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The trainer configuration the operator rendered (YAML, tpuft.dev/trainer-config/v1).",
)
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
    from pydantic import ValidationError

    from tpuft_trainer.config import TrainerConfig

    try:
        config = TrainerConfig.load(config_path)
    except (OSError, ValueError, ValidationError) as error:
        log.error("invalid trainer configuration %s: %s", config_path, error)
        sys.exit(ExitCode.CONFIG_ERROR)
    except Exception as error:  # a YAML syntax error
        log.error("unreadable trainer configuration %s: %s", config_path, error)
        sys.exit(ExitCode.CONFIG_ERROR)

    from tpuft_trainer.train import run

    try:
        record = run(config)
    except StoppedAfterCheckpoint as stopped:
        log.warning("%s (exit %d)", stopped, stopped.exit_code)
        end(stopped.exit_code)
    except Exception as error:
        code = exit_code_for(error)
        if code == 1:
            log.exception("training failed (infrastructure or unknown error; the JobSet may restart it)")
        else:
            log.error("training failed (%s, exit %d): %s", ExitCode(code).name, code, error)
        end(code)
    log.info("done: %d steps in %.1f s", record.final_step, record.seconds)
    end(ExitCode.OK)


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
