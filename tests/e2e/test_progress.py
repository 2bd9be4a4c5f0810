"""Progress from a real FSDPv2 run: the pod's `tpuft train` runs on this host (4 PJRT CPU devices for
a v5e 2x2 host) and rank 0 reports into status.progress with the pod's own (pod-bound) token. Before
it, the run's prepare pod's real `tpuft prepare` runs on this host too: the data's figures reach
status.data with the plan's verdict recomputed from the model it read, and a run whose dataset lacks its
text field fails while Preparing, with no JobSet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique
from tests.e2e.conftest import OperatorProcess, copy_assets
from tests.support import get_json, patch_status_as, tpu_pods_of, wait_for
from tpuft_dev.cluster.executor import LocalExecutor
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.demo import host_run
from tpuft_operator.plan import dims_from_config

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.trainer]


def tiny_run(
    name: str, namespace: str, root: Path, steps: int, *, prepare_job: bool = True
) -> dict[str, Any]:
    """A run of the tiny model on this host. ``prepare_job=False`` (spec.prepare.enabled false): no
    prepare Job, the trainer prepares the data itself as it starts, for the tests whose subject is
    training, stops and restarts: a prepare Job there costs another pod and a `tpuft prepare` process
    (Python, transformers, the tokenizer) before the JobSet. The Preparing path with the real
    `tpuft prepare` is test_progress_from_a_real_training_run_reaches_status's."""
    spec: dict[str, Any] = {} if prepare_job else {"prepare": {"enabled": False}}
    return host_run(name, namespace, root, steps, **spec)


def test_progress_from_a_real_training_run_reaches_status(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path, tiny_assets: Path
) -> None:
    root = copy_assets(tiny_assets, tmp_path / "work")
    local_cluster.add_nodepool("v5e", "2x2", prefix=unique("cpu"))
    executor = LocalExecutor(local_cluster, namespace, tmp_path / "pods")
    executor.start()
    try:
        other = tiny_run("other", namespace, root, steps=8)
        other["spec"]["suspend"] = True  # exists only to prove one run's identity cannot touch another
        # A dataset whose rows have no "text" field: `tpuft prepare` says so, and the run fails on CPU.
        (root / "data" / "broken.jsonl").write_text('{"content": "no text field here"}\n' * 4)
        broken = host_run("broken", namespace, root, steps=8, output="broken-output")
        broken["spec"]["dataset"] = {"name": f"{root}/data/broken.jsonl"}
        local_cluster.apply([tiny_run("tiny", namespace, root, steps=8), other, broken])
        seen_running_progress: list[dict[str, Any]] = []

        def finished() -> dict[str, Any] | None:
            ft = get_json(local_cluster, "tpuft", "tiny", "-n", namespace)
            status = ft.get("status", {})
            if status.get("phase") == "Running" and status.get("progress"):
                seen_running_progress.append(status["progress"])
            return ft if status.get("phase") in ("Succeeded", "Failed") else None

        done = wait_for(finished, timeout=420, what="the tiny run to finish", interval=1)
        logs = "\n".join(p.read_text() for p in (tmp_path / "pods").glob("*.log"))
        assert done["status"]["phase"] == "Succeeded", logs[-3000:]
    finally:
        executor.stop()

    # The data was prepared once, on CPU, by the real `tpuft prepare`: its figures are the run's.
    data = done["status"]["data"]
    assert data["rows"] > 0 and data["documents"] > 0 and 0 < data["lossTokenShare"] <= 1, data
    assert data["stepsPerEpoch"] == data["rows"] // (2 * 4)  # perDeviceBatchSize 2 x 4 chips
    assert data["epochsCovered"] == round(8 / data["stepsPerEpoch"], 2)
    assert (root / "output" / "prepared" / data["fingerprint"]).is_dir()
    # ("other", suspended, prepares the same data into the same output: whichever finishes second
    # finds the first one's set complete and reuses it.)
    prepared = next(c for c in done["status"]["conditions"] if c["type"] == "DataPrepared")
    assert (prepared["status"], prepared["reason"]) == ("True", "Reused" if data["reused"] else "Prepared")
    # The plan's verdict, recomputed with the model's dimensions the prepare pod read (a local model the
    # operator cannot read): its parameters counted from the safetensors header, and it fits.
    config = json.loads((root / "model" / "config.json").read_text())
    assert data["plan"]["params"] == dims_from_config(config, "").params, data
    assert data["plan"]["hbmFits"] is data["plan"]["hostFits"] is True, data
    fits = next(c for c in done["status"]["conditions"] if c["type"] == "MemoryFits")
    assert (fits["status"], fits["reason"]) == ("True", "Fits"), fits
    # The broken dataset failed in Preparing, in the trainer's words, and never got a JobSet.
    failed = wait_for(
        lambda: (
            (s := get_json(local_cluster, "tpuft", "broken", "-n", namespace).get("status", {})).get("phase")
            in ("Failed", "Succeeded", "Running")
            and s
        ),
        timeout=60,
        what="the broken run to end",
    )
    assert failed["phase"] == "Failed", failed
    reason = next(c for c in failed["conditions"] if c["type"] == "Failed")["reason"]
    assert reason == "DataError" and "exit code 65 (DATA_ERROR)" in failed["message"], failed
    assert "has no 'text' field" in failed["message"] and "dataset.textField" in failed["message"]
    assert "jobSetName" not in failed
    assert not get_json(local_cluster, "jobsets", "-n", namespace, "-l", "tpuft.dev/finetune=broken")["items"]

    progress = done["status"]["progress"]
    assert progress["step"] == progress["totalSteps"] == 8
    assert isinstance(progress["loss"], float) and progress["loss"] > 0
    assert progress["summary"] == "8/8 (100%)"
    assert "updateTime" in progress
    # The status printer column shows it.
    assert "8/8 (100%)" in local_cluster.kubectl("get", "tpuft", "tiny", "-n", namespace).stdout
    # Progress arrived while the run was Running (not only at the end) when the run was long enough
    # to report twice; the last report always arrives.
    assert all(p["step"] <= 8 for p in seen_running_progress)

    # The trained model is on disk in the standard format.
    output = root / "output"
    assert (output / "model.safetensors").exists()
    assert json.loads((output / "config.json").read_text())["hidden_size"] == 64

    # The pod's credentials (its pod-bound token) may patch only its own run's status.
    (pod,) = get_json(local_cluster, "pods", "-n", namespace, "-l", tpu_pods_of("tiny"))["items"]
    config = tmp_path / "progress.kubeconfig"
    config.write_text(
        local_cluster.service_account_kubeconfig(
            namespace,
            pod["spec"]["serviceAccountName"],
            pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
        )
    )
    # The reporter's own call (a merge PATCH of the status, no GET: the progress Role grants no get).
    patch = {"status": {"progress": {"step": 1}}}
    code, message = patch_status_as(config, namespace, "tiny", patch)
    assert code == 200, message
    code, message = patch_status_as(config, namespace, "other", patch)
    assert code == 403 and "a pod may report progress only for its own run" in message, message
    for target in ("tiny", "other"):  # and reads no run back, its own included
        read = local_cluster.kubectl(
            "get", "tpuft", target, "-n", namespace, "--subresource=status", kubeconfig=config, check=False
        )
        assert read.returncode != 0 and "forbidden" in read.stderr.lower(), read.stderr
    spec = local_cluster.kubectl(
        "patch",
        "tpuft",
        "tiny",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"suspend":true}}',
        kubeconfig=config,
        check=False,
    )
    assert spec.returncode != 0 and "forbidden" in spec.stderr.lower()
    secrets = local_cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=config, check=False)
    assert secrets.returncode != 0


def test_a_killed_host_restarts_the_run_which_resumes_from_its_last_checkpoint(
    local_cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path, tiny_assets: Path
) -> None:
    root = copy_assets(tiny_assets, tmp_path / "work")
    local_cluster.add_nodepool("v5e", "2x2", prefix=unique("cpu"))
    body = tiny_run("resumable", namespace, root, steps=40, prepare_job=False)
    body["spec"]["training"]["saveSteps"] = 5
    body["spec"]["maxRestarts"] = 2
    executor = LocalExecutor(local_cluster, namespace, tmp_path / "pods")
    executor.start()
    try:
        local_cluster.apply([body])

        def past_first_checkpoint() -> bool:
            status = get_json(local_cluster, "tpuft", "resumable", "-n", namespace).get("status", {})
            step = (status.get("progress") or {}).get("step", 0)
            return 6 <= step < 40 and (root / "output" / "checkpoint-5").exists()

        wait_for(past_first_checkpoint, timeout=300, what="training past its first checkpoint", interval=0.3)
        assert executor.kill_all(), "no trainer process was running"  # SIGKILL: exit code 137

        def finished() -> dict[str, Any] | None:
            ft = get_json(local_cluster, "tpuft", "resumable", "-n", namespace)
            return ft if ft.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

        done = wait_for(finished, timeout=420, what="the restarted run to finish", interval=1)
        logs = "\n".join(p.read_text() for p in (tmp_path / "pods").glob("*.log"))
        assert done["status"]["phase"] == "Succeeded", logs[-3000:]
    finally:
        executor.stop()

    assert done["status"]["restarts"] == 1
    assert done["status"]["progress"]["step"] == 40
    record = json.loads((root / "output" / "tpuft-metrics.json").read_text())
    assert record["resumed_from"] is not None and record["resumed_from"].startswith("checkpoint-")
    assert int(record["resumed_from"].split("-")[1]) >= 5
    assert "resuming from" in logs
