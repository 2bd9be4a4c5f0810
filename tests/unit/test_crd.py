"""The committed CRD and API reference are what the models generate, and the schema teaches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tpuft_operator.api.cli import crd as crd_command
from tpuft_operator.api.cli import generated_files
from tpuft_operator.api.crd import crd

ROOT = Path(__file__).resolve().parents[2]


def test_committed_files_equal_generated() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in generated_files(ROOT).items() if p.read_text() != text]
    assert not stale, f"regenerate with `tpuft crd --write`: {stale}"


def test_check_flag_fails_on_a_stale_copy(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(crd_command, ["--write", "--root", str(tmp_path)]).exit_code == 0
    assert runner.invoke(crd_command, ["--check", "--root", str(tmp_path)]).exit_code == 0
    (tmp_path / "docs" / "api.md").write_text("stale\n")
    result = runner.invoke(crd_command, ["--check", "--root", str(tmp_path)])
    assert result.exit_code != 0 and "docs/api.md" in result.output


def _walk(path: str, node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, prop in node.get("properties", {}).items():
        out += _walk(f"{path}.{name}", prop)
    if "items" in node:
        out += _walk(f"{path}[]", node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(f"{path}{{}}", node["additionalProperties"])
    return out


def _root() -> dict[str, Any]:
    root: dict[str, Any] = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


def test_every_field_has_a_description() -> None:
    """`kubectl explain` prints these; a field without one teaches nothing."""
    fields = [
        (p, n) for p, n in _walk("", _root()) if p and not p.endswith(("[]", "{}")) and p != ".metadata"
    ]
    assert len(fields) > 100
    assert [p for p, node in fields if not node.get("description")] == []


def test_schema_is_structural() -> None:
    for path, node in _walk("", _root()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert ("$ref" not in node and "anyOf" not in node) or node.get("x-kubernetes-int-or-string"), path
        assert "title" not in node, path


def test_names_printer_columns_and_status() -> None:
    spec = crd()["spec"]
    assert spec["names"]["shortNames"] == ["tpuft", "tft"]
    assert spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Type", "Topology", "Slices", "Progress", "Age"]


def test_the_reference_states_bounds_in_the_right_direction() -> None:
    from tpuft_operator.api.reference import api_markdown

    dropout = next(line for line in api_markdown().splitlines() if line.startswith("| `dropout`"))
    assert "(>= 0.0; < 1.0)" in dropout, dropout  # exclusive maximum: dropout 1.0 drops everything
