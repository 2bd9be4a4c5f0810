"""tpuft's development tools: the local cluster (`tpuft cluster`) and `make demo`.

They run from a checkout of the repository (the editable install of `make venv`, or `devtools/` on
PYTHONPATH) and are not part of the operator image: nothing in tpuft_operator imports this package
except the lazy `cluster` entry of the `tpuft` command table.
"""
