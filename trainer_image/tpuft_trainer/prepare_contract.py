"""What `tpuft prepare` reports to the operator: the contract of the prepare Job. Light module (the
operator imports it): the standard library only.

The prepare Job's container runs ``tpuft prepare --config FILE --workers N --summary-file
/dev/termination-log``. Kubernetes keeps that file's content (at most 4096 bytes) as the container's
``state.terminated.message``, which the operator reads from the pod: no extra permission, no channel
of its own. On success the message is a ``PrepareSummary`` as compact JSON; on a failure, ``{"error":
..., "exitCode": ...}`` with the exit code of exit_codes.py (64-78: a user error, the run fails; any
other: an infrastructure failure the Job retries).

The summary also carries the model's dimensions (``ModelFigures``: its config.json, and its parameter
count from its weight files' headers), with which the operator recomputes its plan's HBM and host-RAM
verdict (plan.py) before any TPU is requested: it cannot read a model itself. Both directions stay
compatible: a summary without them (an older trainer) still parses, with ``model`` None, and an
older operator ignores the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

SUMMARY_LIMIT = 4096  # bytes Kubernetes keeps of a termination message


@dataclass(frozen=True)
class ModelFigures:
    """A decoder-only model's dimensions, as plan.ModelDims needs them. The one reading of a
    config.json's keys in the project: the prepare Job reports them, `tpuft plan` reads a local
    config.json with them (plan.dims_from_config)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size / num_heads
    tied_embeddings: bool = False
    gated_mlp: bool = True
    experts: int = 1  # mixture of experts: MLPs per layer, and how many each token runs through
    experts_per_token: int = 1
    # Counted from the shapes in the weight files' headers (safetensors), never from the weights;
    # None when they have none (e.g. .bin files): the plan then computes it from the dimensions.
    params: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], params: int | None = None) -> ModelFigures:
        """From a Hugging Face config.json (Llama/Gemma/Qwen/Mistral keys, or GPT-2's); ValueError for
        a config that is not a decoder-only transformer's."""
        if "text_config" in config and "hidden_size" not in config:
            config = config["text_config"]  # multimodal wrappers keep the language model inside
        if "hidden_size" in config:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            experts = int(config.get("num_local_experts") or 1)  # Mixtral's name for its experts
            return cls(
                hidden_size=hidden,
                num_layers=int(config["num_hidden_layers"]),
                intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                vocab_size=int(config["vocab_size"]),
                head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                gated_mlp=config.get("hidden_act", config.get("hidden_activation", "silu"))
                not in ("gelu_new", "relu"),
                experts=experts,
                experts_per_token=int(config.get("num_experts_per_tok") or 1) if experts > 1 else 1,
                params=params,
            )
        if "n_embd" in config:  # GPT-2 style
            hidden = int(config["n_embd"])
            return cls(
                hidden_size=hidden,
                num_layers=int(config["n_layer"]),
                intermediate_size=int(config.get("n_inner") or 4 * hidden),
                num_heads=int(config["n_head"]),
                num_kv_heads=int(config["n_head"]),
                vocab_size=int(config["vocab_size"]),
                tied_embeddings=True,
                gated_mlp=False,
                params=params,
            )
        raise ValueError("no hidden_size or n_embd; not a decoder-only transformer config")

    def to_wire(self) -> dict[str, Any]:
        return {_camel(key): value for key, value in asdict(self).items()}

    @classmethod
    def from_wire(cls, body: Any) -> ModelFigures | None:
        """The figures of a summary's ``model`` object, or None when absent or malformed (the rest of
        the summary stands either way: the operator then has no verdict to recompute)."""
        if not isinstance(body, Mapping):
            return None
        try:
            figures = cls(**{f.name: body[_camel(f.name)] for f in fields(cls) if _camel(f.name) in body})
        except TypeError:
            return None
        numbers = [figures.hidden_size, figures.num_layers, figures.intermediate_size, figures.num_heads]
        numbers += [figures.num_kv_heads, figures.vocab_size, figures.experts, figures.experts_per_token]
        optional = [n for n in (figures.head_dim, figures.params) if n is not None]
        flags = [figures.tied_embeddings, figures.gated_mlp]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers + optional):
            return None
        return figures if all(isinstance(flag, bool) for flag in flags) else None


@dataclass(frozen=True)
class PrepareSummary:
    """The figures of a prepared dataset (its manifest's, in the API's camelCase on the wire)."""

    fingerprint: str  # the directory under <output>/prepared/ that holds it
    reused: bool  # it was complete already: nothing was tokenised
    documents: int  # training documents read (rows of the source's split, minus held-out ones)
    dropped: int  # documents without a token to learn within maxSeqLength
    rows: int  # training rows of maxSeqLength (packed or padded)
    positions: int  # rows x maxSeqLength
    loss_tokens: int  # positions that count in the loss
    eval_rows: int  # evaluation rows (0: no evaluation set)
    seconds: float  # the prepare's wall time (0 when reused)
    tokens_per_second: float  # tokenised tokens a second (0 when reused)
    # The model's dimensions, for the operator's plan (None: a trainer that did not report them, or a
    # config it could not read them from).
    model: ModelFigures | None = None

    def to_message(self) -> str:
        body = {_camel(f.name): getattr(self, f.name) for f in fields(self) if f.name != "model"}
        if self.model is not None:
            body["model"] = self.model.to_wire()
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_message(cls, text: str) -> PrepareSummary | None:
        """The summary in a termination message, or None when it holds none (an error, garbage)."""
        try:
            body = json.loads(text)
            figures = {f.name: body[_camel(f.name)] for f in fields(cls) if f.name != "model"}
            return cls(**figures, model=ModelFigures.from_wire(body.get("model")))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def error_message(message: str, exit_code: int) -> str:
    """A failure's termination message, cut to fit Kubernetes' limit."""
    room = SUMMARY_LIMIT - 64
    return json.dumps({"error": message[:room], "exitCode": exit_code}, separators=(",", ":"))


def parse_error(text: str) -> tuple[str, int] | None:
    """(message, exit code) of a failure's termination message, or None."""
    try:
        body: Any = json.loads(text)
        return str(body["error"]), int(body["exitCode"])
    except (ValueError, TypeError, KeyError):
        return None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
