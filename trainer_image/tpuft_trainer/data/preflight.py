"""What ``tpuft prepare`` checks before any TPU is requested, each failure with its exit code (64-78:
the operator fails the run in its Preparing phase, no JobSet is created).

1. the model's config and tokenizer are readable with the run's token, and its weight files are
   listed (not downloaded): a gated model without access or a wrong name fails here, not on TPUs.
   Its dimensions (the config's, and the parameters counted from the safetensors headers) go to the
   operator in the summary, which recomputes its plan's HBM and host-RAM verdict with them;
2. the output is writable (a probe file written and removed): checkpoints and the model go there;
3. the whole dataset is read, rendered and tokenised (data.prepare): a missing field, a template that
   is not prefix-stable, rows with nothing to learn, an empty or missing evaluation split;
4. the dataset is published at the output, for every host to read.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from tpuft_trainer.checkpoint.layout import Store
from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.data import prepare, sources
from tpuft_trainer.errors import NotFoundError, PermissionDeniedError
from tpuft_trainer.prepare_contract import ModelFigures

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    prepared: prepare.Prepared
    model: ModelFigures | None  # the model's dimensions (None: its config has none we can read)


def run(config: TrainerConfig, *, workers: int) -> Checked:
    tokenizer, figures = check_model(config)
    check_output_writable(config.output.uri)
    return Checked(prepare.find_or_prepare(config, tokenizer, workers=workers, publish=True), figures)


def check_model(config: TrainerConfig) -> tuple[Any, ModelFigures | None]:
    """The model's tokenizer and dimensions (returned), its config readable and its weight files listed."""
    from transformers import AutoConfig

    source = config.model
    location = sources.model_location(source, weights=False)
    try:
        model_config = AutoConfig.from_pretrained(
            location, revision=source.revision, token=sources.token(source)
        )
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
    return tokenizer, model_figures(
        source.name, model_config.to_dict(), sources.parameter_count(source, location, weights)
    )


def model_figures(name: str, config: dict[str, Any], params: int | None) -> ModelFigures | None:
    """What the operator's plan needs of the model; None (said in the log) for a config that is not a
    decoder-only transformer's as the plan reads them: the run goes on without a recomputed verdict."""
    try:
        figures = ModelFigures.from_config(config, params)
    except (ValueError, KeyError, TypeError) as error:
        log.warning("model %s: no dimensions for the operator's plan in its config (%s)", name, error)
        return None
    log.info(
        "model %s: %s parameters (%s), %d layers, hidden %d, vocabulary %d: reported for the operator's plan",
        name,
        f"{figures.params:,}" if figures.params is not None else "?",
        "counted from the safetensors headers"
        if figures.params is not None
        else "to be computed from the config",
        figures.num_layers,
        figures.hidden_size,
        figures.vocab_size,
    )
    return figures


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
