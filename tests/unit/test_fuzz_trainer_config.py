"""The trainer's config parser under fuzzing (issue 8): whatever the file holds, `TrainerConfig.from_yaml`
either returns a config or raises pydantic's ValidationError (YAML, wrong content) or the project's
ConfigError (not YAML at all); never anything else. And `tpuft train --config` on a bad file exits with
CONFIG_ERROR (64) and says why, so the operator fails the run at once instead of restarting it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tpuft_trainer.config import TrainerConfig
from tpuft_trainer.errors import ConfigError
from tpuft_trainer.exit_codes import ExitCode

VALID: dict[str, Any] = {
    "version": "tpuft.dev/trainer-config/v1",
    "model": {"name": "google/gemma-2-2b", "token_env": "HF_TOKEN"},
    "dataset": {"name": "tatsu-lab/alpaca", "format": "chat"},
    "fsdp": {"layer_cls_to_wrap": ["GemmaDecoderLayer"], "mesh": {"fsdp": 4}},
    "training": {"method": "lora", "max_steps": 10, "lora": {"r": 4}},
    "output": {"uri": "gs://bucket/out"},
    "world": {"slices": 2, "hosts_per_slice": 2, "chips_per_host": 4},
    "progress": {"namespace": "ns", "name": "run"},
}

PATHS = [
    ("version",),
    ("model",),
    ("model", "name"),
    ("model", "dtype"),
    ("dataset", "format"),
    ("fsdp", "mesh", "fsdp"),
    ("fsdp", "layer_cls_to_wrap"),
    ("training", "max_steps"),
    ("training", "epochs"),
    ("training", "learning_rate"),
    ("training", "lora"),
    ("training", "lora", "dropout"),
    ("world", "slices"),
    ("progress", "min_interval_seconds"),
    ("output",),
    ("unknown",),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)

# Pieces of YAML that exercise its dark corners: flow/block mixes, anchors and aliases, tags (including
# the ones unsafe loaders would execute), document markers, odd scalars and unicode.
YAML_PIECES = [
    "model:", " name:", " {", "}", "[", "]", ",", ":", "- ", "\n", "  ", "&a ", "*a ", "*missing ",
    "!!python/object/apply:os.system ['id'] ", "!!binary ", "!!set ", "!!timestamp ", "!!float ",
    "? ", "---\n", "...\n", "|\n", ">-\n", "'", '"', "#", "%YAML 1.1\n", "<<: *a\n", "~", ".nan",
    "0x1F", "1e400", "9" * 40, "\t", "\u202e", "\x85", "\ufeff", "\U0001f999", "training:", "max_steps: ",
]  # fmt: skip


def check(parse: Any, arg: Any) -> TrainerConfig | None:
    try:
        config: TrainerConfig = parse(arg)
    except (ValidationError, ConfigError):
        return None
    # What parses renders back to YAML that parses to the same config.
    assert TrainerConfig.from_yaml(config.to_yaml()) == config
    return config


def set_path(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict):
            return
        node = node.setdefault(key, {})
    if isinstance(node, dict):
        node[path[-1]] = value


def test_the_valid_config_parses() -> None:
    config = check(TrainerConfig.model_validate, copy.deepcopy(VALID))
    assert config is not None and config.world.slices == 2


def test_a_config_in_json_reads_a_character_beyond_the_bmp_as_itself() -> None:
    # json.dumps writes U+10000 as the escaped pair "\\ud800\\udc00"; PyYAML alone read two lone
    # surrogates there, which LibYAML's emitter refused (UnicodeEncodeError, found by the fuzz test).
    obj = copy.deepcopy(VALID)
    obj["model"]["name"] = "org/\U00010000-\U0001f999"
    config = check(TrainerConfig.from_yaml, json.dumps(obj))
    assert config is not None and config.model.name == "org/\U00010000-\U0001f999"


def test_an_escaped_surrogate_without_its_pair_is_a_config_error_that_says_where() -> None:
    text = json.dumps(VALID).replace('"google/gemma-2-2b"', '"\\ud83d-gemma"')
    with pytest.raises(ConfigError, match=r"(?s)without its pair is not a character.*line 1, column 62"):
        TrainerConfig.from_yaml(text)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), json_values), min_size=1, max_size=3))
def test_mutated_config_parses_or_raises_validation_error(
    mutations: list[tuple[tuple[str, ...], Any]],
) -> None:
    obj = copy.deepcopy(VALID)
    for path, value in mutations:
        set_path(obj, path, value)
    check(TrainerConfig.model_validate, obj)
    # The same object through YAML and JSON text (what the pod annotation holds).
    check(TrainerConfig.from_yaml, yaml.safe_dump(obj))
    check(TrainerConfig.from_yaml, json.dumps(obj))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60), st.text(max_size=60), st.text(min_size=1, max_size=60))
def test_any_strings_render_to_yaml_that_reads_back_the_same(model: str, dataset: str, uri: str) -> None:
    """The operator writes each run's config with LibYAML's emitter (fast) where PyYAML has it: whatever
    the strings of a spec, the text reads back to the same config. (Its text is PyYAML's own but for
    where a long double-quoted string is folded; the golden files hold the examples' text.)"""
    data = copy.deepcopy(VALID)
    data["model"]["name"], data["dataset"]["name"], data["output"]["uri"] = model, dataset, uri
    try:
        config = TrainerConfig.model_validate(data)
    except ValidationError:
        return
    text = config.to_yaml()
    assert TrainerConfig.from_yaml(text) == config


def test_configs_are_written_with_libyaml() -> None:
    # The speed the operator's burst of creates relies on (docs/benchmarks.md); PyYAML's wheels have it.
    assert yaml.__with_libyaml__, "PyYAML was built without LibYAML: reinstall it from a wheel"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_any_text_parses_or_raises_config_errors(text: str) -> None:
    check(TrainerConfig.from_yaml, text)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(YAML_PIECES), max_size=40))
def test_yaml_shaped_text_parses_or_raises_config_errors(pieces: list[str]) -> None:
    check(TrainerConfig.from_yaml, "".join(pieces))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # deeper than Python's stack
        "- " * 5_000 + "x",
        "model: {name: " + "9" * 5_000 + "}",  # an integer longer than int() converts
        "model: !!python/object/apply:os.system ['touch /tmp/tpuft-pwned']",
        "a: &a [*a]",  # a self-referencing alias
        "model: &m {name: x}\ndataset: *m",  # any alias
        "model: {name: x}\n---\nmodel: {name: y}",  # two documents
        "\x00",
        "",
    ],
    ids=[
        "deep-flow",
        "deep-block",
        "huge-int",
        "python-tag",
        "recursive-alias",
        "alias",
        "two-docs",
        "nul",
        "empty",
    ],
)
def test_hostile_documents_raise_config_errors(text: str) -> None:
    with pytest.raises((ValidationError, ConfigError)):
        TrainerConfig.from_yaml(text)
    assert not Path("/tmp/tpuft-pwned").exists()


def test_a_billion_laughs_is_refused_before_it_can_explode() -> None:
    """Nested aliases load small but print enormous: any error message quoting them (pydantic renders
    the input of an error) would eat the host's memory. The parser refuses aliases outright."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    lines.append("model: {name: *a9}")
    with pytest.raises(ConfigError) as raised:
        TrainerConfig.from_yaml("\n".join(lines))
    assert "aliases (*name) are not allowed" in str(raised.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("model: [\n", "not a valid YAML document"),
        (yaml.safe_dump({**VALID, "training": {"max_steps": 0}}), "training.max_steps"),
    ],
    ids=["not-yaml", "out-of-range"],
)
def test_tpuft_train_exits_with_config_error(tmp_path: Path, content: str, says: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "tpuft_operator", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == ExitCode.CONFIG_ERROR == 64, done.stderr
    assert "invalid trainer configuration" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
