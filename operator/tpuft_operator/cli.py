"""`tpuft`: one command, with a subcommand per job.

Subcommands are imported only when they run, so `tpuft --help` and the operator never import the
training stack, and `tpuft train` can say how to install it when it is missing. `tpuft cluster` lives
in the development package tpuft_dev (devtools/), which the operator image does not ship: this table
is the only place tpuft_operator names it.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from tpuft_operator import __version__

# name -> ("module:attribute", one-line help shown by `tpuft --help`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "cluster": (
        "tpuft_dev.cluster.cli:cluster",
        "Run a real local Kubernetes control plane with fake TPU nodes (development tool).",
    ),
    "crd": ("tpuft_operator.api.cli:crd", "Print the TPUFineTune CRD generated from the API models."),
    "render": (
        "tpuft_operator.render.cli:render",
        "Print the objects the operator would create for a TPUFineTune.",
    ),
    "plan": ("tpuft_operator.plan_cli:plan", "Show a TPUFineTune's TPU shape, mesh, HBM and host RAM needs."),
    "operator": ("tpuft_operator.main:operator", "Run the operator (reconciles TPUFineTunes into JobSets)."),
    "train": ("tpuft_trainer.cli:train", "Run the FSDPv2 training core from a rendered configuration."),
    "prepare": (
        "tpuft_trainer.cli:prepare",
        "Prepare a run's dataset once on CPU and check the run before any TPU is requested.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        target, short_help = SUBCOMMANDS[cmd_name]
        module_name, attribute = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            return _unavailable(cmd_name, short_help, error)
        command: click.Command = getattr(module, attribute)
        command.short_help = short_help
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing must not import every subcommand (and with it torch).
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, short_help: str, error: ModuleNotFoundError) -> click.Command:
    hint = ""
    if name in ("train", "prepare"):
        hint = (
            "\nThe training core needs the trainer extra: pip install 'tpuft[trainer]' "
            "-c requirements/constraints.txt (or run `make venv`)."
        )
    elif name == "cluster" and (error.name or "").partition(".")[0] == "tpuft_dev":
        hint = (
            "\n`tpuft cluster` is a development tool (package tpuft_dev, in the repository's devtools/); "
            "the operator image does not ship it. Run it from a checkout of the tpuft repository "
            "after `make venv` (or with devtools/ on PYTHONPATH)."
        )

    @click.command(name=name, help=short_help, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def missing(args: Any) -> None:
        raise click.ClickException(f"`tpuft {name}` cannot run: {error}.{hint}")

    return missing


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tpuft")
def cli() -> None:
    """Fine-tune LLMs on GKE TPU slices with a Kubernetes custom resource.

    \b
    Typical flow on a laptop (no GKE needed):
      tpuft cluster up && eval "$(tpuft cluster env)"
      tpuft cluster add-nodepool --type v5e --topology 2x2
      tpuft render -f examples/v5e-single-host.yaml
    """


def main() -> None:
    cli()
