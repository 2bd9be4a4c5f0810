"""The trainer config's YAML writer (tpuft_trainer.block_yaml) writes PyYAML's text byte for byte: the
golden files, what `kubectl get jobset -o yaml` shows and what the trainer reads do not depend on which
of the two wrote it. Hypothesis generates documents around the edges of plain scalars (indicators,
colons, spaces, YAML 1.1's other types spelled as strings, floats in exponent form)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_render_golden import EXAMPLE_FILES, finetune
from tpuft_operator.render import render_run
from tpuft_trainer import block_yaml
from tpuft_trainer.config import TrainerConfig

# Strings that are or are near something YAML reads as another type, or as syntax.
TRICKY = [
    "true",
    "False",
    "yes",
    "off",
    "null",
    "~",
    "=",
    "<<",
    "1",
    "-1",
    "0x1f",
    "0o7",
    "017",
    "1_000",
    "1:20",
    "1e3",
    "1.5",
    ".5",
    ".inf",
    "-.inf",
    ".nan",
    "2026-12-04",
    "2026-12-04 10:00:00",
    "---",
    "...",
    "a: b",
    "a:",
    ":a",
    "a:b",
    "gs://bucket/x",
    "a #b",
    "a#b",
    "#a",
    "- a",
    "-a",
    "? a",
    "@a",
    "`a",
    "%a",
    "!a",
    "&a",
    "*a",
    "|",
    ">",
    "'a'",
    '"a"',
    "[a]",
    "{a}",
    "a,b",
    "",
    " ",
    " a",
    "a ",
    "a\nb",
    "é",
    "a" * 101,
    "k" * 129,
]
pieces = st.sampled_from([*TRICKY, "abc", "Layer", "/", ".", "-", ":", "_", "+", "e", "9", " ", "#", "x"])
strings = st.one_of(st.sampled_from(TRICKY), st.lists(pieces, max_size=5).map("".join), st.text(max_size=12))
scalars = st.one_of(
    strings,
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e30, max_value=1e30).map(lambda f: f * 1e-12),  # exponent forms
)
keys = st.one_of(
    st.sampled_from(["model", "name", "lr", "a_b", "x.y", "1", "true", "a:", "a b", ""]), strings
)
values = st.recursive(
    scalars | st.lists(scalars, max_size=3),
    lambda inner: st.dictionaries(keys, inner, max_size=4) | st.lists(inner, max_size=2),
    max_leaves=12,
)
documents = st.dictionaries(keys, values, max_size=6)


def pyyaml(data: dict[str, Any], dumper: type) -> str:
    return yaml.dump(data, Dumper=dumper, sort_keys=False)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_writes_pyyamls_text_for_any_document(data: dict[str, Any]) -> None:
    assert block_yaml.dump(data) == pyyaml(data, yaml.CSafeDumper)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["name", "uri", "k"]), strings, min_size=1))
def test_plain_strings_match_the_pure_python_dumper_too(data: dict[str, Any]) -> None:
    # A PyYAML built without LibYAML falls back to SafeDumper. The two fold a long double-quoted
    # string at different places (found by CI: a 100-character string with an "é"), a string this
    # module hands to PyYAML anyway; wherever they agree, the text written here is theirs.
    pure = pyyaml(data, yaml.SafeDumper)
    if pure == pyyaml(data, yaml.CSafeDumper):
        assert block_yaml.dump(data) == pure
    else:
        assert block_yaml.dump(data) == pyyaml(data, yaml.CSafeDumper)


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_example_configs_are_written_without_pyyaml(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed is the point: every example's config takes the fast path, and reads back the same."""
    config = render_run(finetune(example)).trainer_config
    expected = pyyaml(config.model_dump(mode="json", exclude_none=True), yaml.CSafeDumper)

    def no_pyyaml(*args: object, **kwargs: object) -> str:
        raise AssertionError("block_yaml fell back to PyYAML for an example config")

    monkeypatch.setattr(block_yaml.yaml, "dump", no_pyyaml)
    text = config.to_yaml()
    monkeypatch.undo()
    assert text == expected
    assert TrainerConfig.from_yaml(text) == config


def test_floats_in_exponent_form_keep_their_dot() -> None:
    # YAML 1.1 reads `2e-05` as a string; the learning rates of most recipes are written this way.
    text = block_yaml.dump({"learning_rate": 2e-05, "big": 1e16, "small": 0.5})
    assert text == "learning_rate: 2.0e-05\nbig: 1.0e+16\nsmall: 0.5\n"
    assert yaml.safe_load(text) == {"learning_rate": 2e-05, "big": 1e16, "small": 0.5}


@pytest.mark.parametrize(
    "data",
    [
        {"k" * 129: 1},  # too long for a simple key: PyYAML writes `? key`
        {"k" * 128: 1, "v": "x" * 300},
        {"a": {"b": {"c": ["d", 1, 2.5, True]}}},
        {"empty": {}, "none": []},
        {"list_of_maps": [{"a": 1}]},
        {},
    ],
    ids=["long-key", "long-value", "nested", "empty", "list-of-maps", "nothing"],
)
def test_writes_pyyamls_text_at_the_edges(data: dict[str, Any]) -> None:
    assert block_yaml.dump(data) == pyyaml(data, yaml.CSafeDumper)
