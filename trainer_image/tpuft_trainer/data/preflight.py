"""What ``tpuft prepare`` checks before any TPU is requested, each failure with its exit code (64-78:
the operator fails the run in its Preparing phase, no JobSet is created).

1. the model's config and tokenizer are readable with the run's token, and its weight files are
   listed (not downloaded): a gated model without access or a wrong name fails here, not on TPUs;
2. the output is writable (a probe file written and removed): checkpoints and the model go there;
3. the whole dataset is read, rendered and tokenised (data.prepare): a missing field, a template that
   is not prefix-stable, rows with nothing to learn, an empty or missing evaluation split;
4. the dataset is published at the output, for every host to read.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tpuft_trainer.checkpoint.layout import Store
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.data import prepare, sources
from tpuft_trainer.errors import NotFoundError, PermissionDeniedError

log = logging.getLogger(__name__)


def run(config: TrainerConfig, *, workers: int) -> prepare.Prepared:
    tokenizer = check_model(config)
    check_output_writable(config.output.uri)
    return prepare.find_or_prepare(config, tokenizer, workers=workers, publish=True)


def check_model(config: TrainerConfig) -> Any:
    """The model's config and tokenizer (returned), and its weight files listed."""
    from transformers import AutoConfig

    source = config.model
    location = sources.model_location(source, weights=False)
    try:
        AutoConfig.from_pretrained(location, revision=source.revision, token=sources.token(source))
    except Exception as error:
        raise sources.hub_errors(error, f"model {source.name}") from error
    tokenizer = sources.load_tokenizer(source, location)
    weights = sources.weight_files(source, location)
    if not weights:
        raise NotFoundError(
            f"model {source.name} has no weight files ({', '.join('*' + s for s in sources.WEIGHT_SUFFIXES)}); "
            "check spec.model.name"
        )
    log.info("model %s: config and tokenizer readable, %d weight file(s) listed", source.name, len(weights))
    return tokenizer


def check_output_writable(uri: str) -> None:
    store = Store(uri)
    probe = f".tpuft-write-probe-{uuid.uuid4().hex[:8]}"
    try:
        store.write_text("probe\n", probe)
        store.remove(probe)
    except PermissionError as error:
        raise PermissionDeniedError(f"the output {uri} is not writable: {error}") from error
    except FileNotFoundError as error:
        raise NotFoundError(f"the output {uri} does not exist: {error}") from error
    log.info("output %s is writable", uri)
