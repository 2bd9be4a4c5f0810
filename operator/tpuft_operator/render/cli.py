"""`tpuft render -f FILE`: the objects the operator would create, with no cluster."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import yaml

from tpuft_operator.api.validation import SpecError
from tpuft_operator.render import RenderSettings, render_run
from tpuft_operator.render.output import to_yaml
from tpuft_trainer.config import UnicodeSafeLoader


def load_documents(path: Path) -> list[dict[str, Any]]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    try:
        docs = [d for d in yaml.load_all(text, Loader=UnicodeSafeLoader) if d is not None]
    except yaml.YAMLError as error:
        raise click.ClickException(f"{path}: not valid YAML: {error}") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise click.ClickException(f"{path}: every document must be a mapping (a TPUFineTune)")
    return docs


@click.command(name="render")
@click.option(
    "-f",
    "--filename",
    "path",
    required=True,
    type=click.Path(path_type=Path, allow_dash=True),
    help="TPUFineTune YAML ('-' reads stdin).",
)
@click.option("-o", "--output", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
@click.option("--image", default=None, help="Trainer image to use when spec.image is not set.")
@click.option(
    "--image-native", default=None, help="Trainer image of `backend: native` runs when spec.image is not set."
)
def render(path: Path, fmt: str, image: str | None, image_native: str | None) -> None:
    """Print every object the operator would create for a TPUFineTune: the namespace's trainer
    ServiceAccount and progress Role/RoleBinding (once per namespace), then the prepare Job (unless
    spec.prepare.enabled is false), then the JobSet (the trainer config inside both, as a pod
    annotation).

    Without metadata.uid (a file not read back from a cluster) the objects carry no ownerReferences.
    """
    settings = RenderSettings()
    if image:
        settings = replace(settings, trainer_image=image)
    if image_native:
        settings = replace(settings, trainer_image_native=image_native)
    objects: list[dict[str, Any]] = []
    namespaces: set[str] = set()
    for doc in load_documents(path):
        if doc.get("kind") != "TPUFineTune":
            continue
        try:
            run = render_run(doc, settings)
            namespace = str(run.jobset["metadata"]["namespace"])
            if namespace not in namespaces:
                namespaces.add(namespace)
                objects += run.namespace_objects
            if run.prepare_job is not None:  # created first; the JobSet once the data is prepared
                objects.append(run.prepare_job)
            objects += run.objects
        except SpecError as error:
            name = (doc.get("metadata") or {}).get("name", "?")
            lines = "\n".join(f"  {e.field}: {e.reason}" for e in error.errors)
            raise click.ClickException(f"TPUFineTune {name} is invalid:\n{lines}") from None
    if not objects:
        raise click.ClickException(f"{path}: no TPUFineTune found")
    if fmt == "json":
        body: Any = (
            objects[0] if len(objects) == 1 else {"apiVersion": "v1", "kind": "List", "items": objects}
        )
        click.echo(json.dumps(body, indent=2))
    else:
        click.echo(to_yaml(objects), nl=False)
