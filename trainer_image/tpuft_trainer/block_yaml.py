"""Block YAML for the trainer config, written without PyYAML's representer where that is safe.

The operator renders one trainer config per run. Even with LibYAML's emitter, PyYAML's representer and
serializer (Python) cost ~0.3 ms of the ~0.4 ms a render takes, a fifth of the operator's CPU in a burst
of creates (docs/benchmarks.md, the N=1000 profile). A config is a few nested mappings of short ASCII
strings, numbers and lists of names, whose YAML is fixed text: this module writes that text itself and
hands anything else (a string that needs quotes, an empty collection, a list of mappings, a float that
is not finite) to PyYAML whole, so the output is PyYAML's own byte for byte
(tests/unit/test_block_yaml.py compares the two on generated documents).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import yaml

# PyYAML's pure-Python emitter took ~1.5 ms per config, LibYAML's ~0.4 ms. PyYAML's wheels bundle
# LibYAML; a build without it falls back to the same output, slower.
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# A string that a block-context plain scalar writes as itself: ASCII without spaces, not starting with
# an indicator (- ? : , [ ] { } # & * ! | > ' " % @ `) or a dot (`...`, `.inf`), no ':' at its end
# (': ' and a final ':' mark a key), and at most _PLAIN_MAX characters (a simple key may have 128;
# checked before the cache, so long strings never fill it).
_PLAIN: Final = re.compile(r"[A-Za-z0-9/][A-Za-z0-9_./@+=~:-]*(?<!:)\Z", re.ASCII)
_PLAIN_MAX: Final = 100
_STR_TAG: Final = "tag:yaml.org,2002:str"
_resolve: Final[Callable[..., str]] = yaml.resolver.Resolver().resolve


def _is_plain(text: str) -> bool:
    return len(text) <= _PLAIN_MAX and _is_plain_short(text)


@functools.lru_cache(maxsize=4096)  # keys and most values repeat from run to run
def _is_plain_short(text: str) -> bool:
    """Also not read back as another type: `true`, `null`, `1e3`, `1:20` (YAML 1.1's base 60), dates."""
    return _PLAIN.match(text) is not None and _resolve(yaml.ScalarNode, text, (True, False)) == _STR_TAG


class _NeedsPyYAML(Exception):
    """A value outside the shapes written here."""


def _scalar(value: object) -> str:
    if isinstance(value, str):
        if _is_plain(value):
            return value
    elif isinstance(value, bool):
        return "true" if value else "false"
    elif isinstance(value, int):
        return str(value)
    elif isinstance(value, float) and math.isfinite(value):
        text = repr(value).lower()
        # YAML 1.1 reads `1e-05` as a string: PyYAML writes `1.0e-05`.
        return text.replace("e", ".0e", 1) if "." not in text and "e" in text else text
    raise _NeedsPyYAML


def _mapping(data: Mapping[Any, Any], indent: str, lines: list[str]) -> None:
    for key, value in data.items():
        if not isinstance(key, str) or not _is_plain(key):
            raise _NeedsPyYAML
        if isinstance(value, dict):  # model_dump's; not the Mapping ABC (a slow isinstance)
            if not value:
                raise _NeedsPyYAML
            lines.append(f"{indent}{key}:\n")
            _mapping(value, indent + "  ", lines)
        elif isinstance(value, list):
            if not value:
                raise _NeedsPyYAML
            lines.append(f"{indent}{key}:\n")
            # A sequence inside a mapping is written "indentless": its dashes under the key.
            lines.extend(f"{indent}- {_scalar(item)}\n" for item in value)
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}\n")


def dump(data: Mapping[str, Any]) -> str:
    """The text `yaml.dump(data, sort_keys=False)` writes (safe dumper), faster for plain configs."""
    lines: list[str] = []
    try:
        _mapping(data, "", lines)
    except _NeedsPyYAML:
        return _pyyaml(data)
    return "".join(lines) if lines else _pyyaml(data)  # an empty mapping is `{}`


def _pyyaml(data: Mapping[str, Any]) -> str:
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False)
