"""The operator's API, renderer and planner never import the training stack."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "torch_xla", "transformers", "datasets", "peft", "trl"}:
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
import tpuft_operator.api, tpuft_operator.api.crd, tpuft_operator.api.cli
import tpuft_operator.render, tpuft_operator.render.cli
import tpuft_operator.plan, tpuft_operator.plan_cli
from tpuft_operator.cli import cli
from click.testing import CliRunner
assert CliRunner().invoke(cli, ["render", "--help"]).exit_code == 0
assert not any(m.split(".")[0] == "torch" for m in sys.modules)
print("ok")
"""


def test_api_render_and_plan_import_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
