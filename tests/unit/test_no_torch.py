"""The operator's API, renderer and planner never import the training stack; the trainer's config
contract and exit codes, which the operator imports, neither; the pod contract imports nothing at all
beyond the standard library (the trainer image and the operator image both import it)."""

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
import tpuft_trainer.config, tpuft_trainer.exit_codes, tpuft_trainer.pod_contract
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


STDLIB_PROBE = """
import sys
before = set(sys.modules)
import tpuft_trainer.pod_contract
new = {m.split(".")[0] for m in set(sys.modules) - before}
print(sorted(new - set(sys.stdlib_module_names) - {"tpuft_trainer"}))
"""


def test_pod_contract_imports_the_standard_library_only() -> None:
    out = subprocess.run([sys.executable, "-c", STDLIB_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
