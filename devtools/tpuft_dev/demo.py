"""`make demo`: the whole product on this machine, with a real FSDPv2 run of a tiny model.

    local cluster (real control plane, kwok TPU nodes)  ->  CRD + the chart's RBAC
    ->  operator (as the chart's ServiceAccount)  ->  kubectl apply examples/tiny-cpu-demo.yaml
    ->  the prepare Job (CPU node pool): its pod's `tpuft prepare` runs on this host, tokenises and
        packs the data once and checks the run (Preparing; status.data has the figures)
    ->  JobSet -> pod scheduled on a fake v5e 2x2 node -> the pod's `tpuft train` runs on this host
        over 4 PJRT CPU devices (one per "chip"), reads the prepared data and reports progress into
        the resource's status
    ->  Preparing -> Pending -> Running (live progress, eval loss) -> Succeeded  ->  the model
        reloads with from_pretrained, and the loss curve (training and evaluation) is left at the
        output as a PNG

Simulated: the TPU and CPU nodes (kwok) and the container runtime (the executor runs the pods'
commands on the host). Real: everything else. Ctrl-C cleans up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tpuft_dev.cluster.executor import LocalExecutor, run_on_host_annotations
from tpuft_dev.cluster.local import LocalCluster
from tpuft_dev.cluster.operator_process import (
    HOST_PATH_VALUES,
    OperatorProcess,
    install_operator,
    operator_env,
)
from tpuft_operator.api.models import TERMINAL_PHASES, Phase
from tpuft_operator.api.resources import FINETUNE

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-cpu-demo.yaml"
ASSETS = Path("/tmp/tpuft-demo")  # the example mounts this host path at the same path
NAMESPACE = "tpuft-demo"


def say(message: str) -> None:
    print(f"\n\033[1m==> {message}\033[0m", flush=True)


def build_assets(root: Path = ASSETS) -> None:
    """A 2-layer Llama with a character-level tokenizer, and a small text dataset, built locally
    into ``root``/model and ``root``/data/train.jsonl (in a subprocess: the demo itself stays light)."""
    code = f"""
import json, random, string, torch, transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
root = {str(root)!r}
chars = sorted(set(string.printable) - set("\\x0b\\x0c"))
vocab = {{t: i for i, t in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + chars)}}
core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                           bos_token="<s>", eos_token="</s>")
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
    bos_token_id=2, eos_token_id=3, use_cache=False)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(root + "/model")
tok.save_pretrained(root + "/model")
words = "the quick brown fox jumps over a lazy dog one two three".split()
rng = random.Random(0)
import os
os.makedirs(root + "/data", exist_ok=True)
with open(root + "/data/train.jsonl", "w") as out:
    for _ in range(256):
        out.write(json.dumps({{"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "."}}) + "\\n")
"""
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def host_run(
    name: str, namespace: str, root: Path, steps: int, *, output: str = "output", **spec: Any
) -> dict[str, Any]:
    """A TPUFineTune of the tiny model and data `build_assets` made in ``root``, whose pods the local
    executor runs on this machine (the tests and benchmarks that train for real through the
    operator); ``spec`` overrides top-level spec fields."""
    return {
        "apiVersion": FINETUNE.api_version,
        "kind": FINETUNE.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": f"{root}/model", "dtype": "float32"},
            "dataset": {"name": f"{root}/data/train.jsonl"},
            "tpu": {"type": "v5e", "topology": "2x2"},
            "fsdp": {"gradientCheckpointing": False},
            "training": {
                "maxSteps": steps,
                "learningRate": 1e-3,
                "perDeviceBatchSize": 2,
                "maxSeqLength": 32,
                "optimizer": "adamw",
                "loggingSteps": 1,  # every step's loss: the tests read where a resumed run's losses start
            },
            "output": {"uri": f"{root}/{output}"},
            "maxRestarts": 0,
            "volumes": [{"name": "work", "hostPath": {"path": str(root), "type": "Directory"}}],
            "volumeMounts": [{"name": "work", "mountPath": str(root)}],
            "podAnnotations": run_on_host_annotations(),
            **spec,
        },
    }


def data_line(data: dict[str, Any]) -> str:
    """status.data, as the demo prints it once the data is prepared."""
    if "rows" not in data:
        return "data prepared (no figures reported)"
    share = data.get("lossTokenShare")
    line = (
        f"data: {data['rows']} rows from {data.get('documents')} documents "
        f"({data.get('droppedDocuments', 0)} dropped), {data.get('evalRows', 0)} evaluation rows"
    )
    if share is not None:
        line += f", {share:.0%} of the positions in the loss"
    if data.get("stepsPerEpoch") is not None:
        line += f"; {data['stepsPerEpoch']} steps an epoch"
    if data.get("epochsCovered") is not None:
        line += f", maxSteps covers {data['epochsCovered']} epochs"
    how = "reused" if data.get("reused") else f"prepared in {data.get('preparedSeconds', 0):.1f} s"
    return f"{line}; {how} ({data.get('fingerprint')})"


def demo_resource() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = NAMESPACE
    annotations = body["spec"].setdefault("podAnnotations", {})
    annotations.update(run_on_host_annotations())
    return body


def verify_model(output: Path) -> None:
    code = (
        "import sys, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True)\n"
        "print(f'{type(m).__name__}: {sum(p.numel() for p in m.parameters()):,} parameters, '"
        "f'hidden {m.config.hidden_size}, {m.config.num_hidden_layers} layers')\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(output)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


LOSS_CURVE = "loss-curve.png"


def plot_losses(metrics: dict[str, Any], path: Path) -> Path:
    """The run's training and evaluation losses against the step, as a PNG (matplotlib, dev extra)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for key, label, style in (("losses", "training loss", "-"), ("eval_losses", "evaluation loss", "o--")):
        points = sorted((int(step), loss) for step, loss in metrics.get(key, {}).items())
        if points:
            axes.plot([s for s, _ in points], [v for _, v in points], style, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title("tpuft demo: tiny Llama on 4 PJRT CPU devices")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run(keep: bool = False) -> int:
    # Its own cluster directory, so a second checkout's demo or test cluster is left alone.
    name = os.environ.get("TPUFT_DEMO_CLUSTER", "demo")
    cluster = LocalCluster(name=name, log=lambda line: print(f"    {line}", flush=True))
    operator: OperatorProcess | None = None
    executor: LocalExecutor | None = None
    workdir = ASSETS / "run"
    try:
        say("Bringing up the local cluster (real kube-apiserver, scheduler, JobSet; kwok TPU nodes)")
        cluster.up()
        say(
            "Adding a fake GKE TPU node pool: v5e, topology 2x2 (one host with 4 chips); the CPU pool "
            "where the data is prepared comes with the cluster"
        )
        cluster.add_nodepool("v5e", "2x2", prefix="demo-v5e")
        print(
            cluster.kubectl(
                "get", "nodes", "-L", "cloud.google.com/gke-tpu-topology,cloud.google.com/gke-nodepool"
            ).stdout
        )

        say("Building a tiny Llama model and a dataset in /tmp/tpuft-demo (nothing is downloaded)")
        if not (ASSETS / "model" / "config.json").exists():
            build_assets()
        shutil.rmtree(ASSETS / "output", ignore_errors=True)
        workdir.mkdir(parents=True, exist_ok=True)

        say("Installing the CRD and the operator's RBAC from the Helm chart")
        # The demo's run reads its model and data from this host (hostPath): the admin opts in.
        kubeconfig = install_operator(cluster, values=HOST_PATH_VALUES)
        say("Starting the operator as the chart's ServiceAccount (only the chart's permissions)")
        operator = OperatorProcess(
            kubeconfig,
            workdir / "operator.log",
            **{
                **operator_env(cluster, HOST_PATH_VALUES),
                "TPUFT_RESYNC_SECONDS": "5",
                "TPUFT_PROGRESS_INTERVAL_SECONDS": "1",
            },
        )
        operator.start()

        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        executor = LocalExecutor(cluster, NAMESPACE, workdir / "pods")
        executor.start()

        say(
            f"kubectl apply -f {EXAMPLE.relative_to(REPO)}  (its prepare pod's `tpuft prepare`, then its TPU "
            "pod's `tpuft train`, will run on this host)"
        )
        cluster.apply([demo_resource()], field_manager="kubectl")
        print(cluster.kubectl("get", "tpuft", "-n", NAMESPACE).stdout.splitlines()[0], flush=True)
        last_line = ""
        deadline = time.monotonic() + 900
        phase = ""
        data_said = False
        while time.monotonic() < deadline:
            line = cluster.kubectl("get", "tpuft", "-n", NAMESPACE, "--no-headers").stdout.strip()
            items = json.loads(cluster.kubectl("get", "tpuft", "-n", NAMESPACE, "-o", "json").stdout)["items"]
            status = items[0].get("status", {}) if items else {}
            phase = status.get("phase", "")
            progress = status.get("progress") or {}
            if "loss" in progress:
                line += f"   loss {progress['loss']:.4f}, ETA {progress.get('etaSeconds', '?')}s"
            if "evalLoss" in progress:
                line += f", eval loss {progress['evalLoss']:.4f}"
            if line and line != last_line:
                print(line, flush=True)
                last_line = line
            if status.get("data") and not data_said:
                print(f"    {data_line(status['data'])}", flush=True)
                data_said = True
            if phase in TERMINAL_PHASES:
                break
            time.sleep(1)
        say(f"Finished: {phase or 'timed out'}")
        print(cluster.kubectl("describe", "tpuft", "-n", NAMESPACE).stdout.split("Events:")[-1])
        if phase != Phase.SUCCEEDED:
            for log_file in sorted((workdir / "pods").glob("*.log")):
                print(f"--- {log_file.name}\n" + "\n".join(log_file.read_text().splitlines()[-30:]))
            return 1
        say("The fine-tuned model, reloaded with transformers.AutoModelForCausalLM.from_pretrained:")
        verify_model(ASSETS / "output")
        print(f"    files: {', '.join(sorted(p.name for p in (ASSETS / 'output').iterdir()))}")
        say("Training and evaluation loss (tpuft-metrics.json; TensorBoard events in output/tensorboard):")
        metrics = json.loads((ASSETS / "output" / "tpuft-metrics.json").read_text())
        evals = {int(k): v for k, v in metrics["eval_losses"].items()}
        print("    eval loss by step: " + ", ".join(f"{k}: {v:.4f}" for k, v in sorted(evals.items())))
        print(f"    loss curve: {plot_losses(metrics, ASSETS / 'output' / LOSS_CURVE)}")
        return 0
    finally:
        say("Cleaning up" + (" (keeping the cluster: --keep)" if keep else ""))
        if executor is not None:
            executor.stop()
        if operator is not None:
            operator.stop()
        if not keep:
            cluster.down()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(run(keep="--keep" in sys.argv))
