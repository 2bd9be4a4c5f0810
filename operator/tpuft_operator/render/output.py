"""YAML for people: multi-line strings (the trainer config in the pod template's annotation) as literal blocks."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """Objects as a multi-document YAML stream, keys in the order the renderer wrote them."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=110)
