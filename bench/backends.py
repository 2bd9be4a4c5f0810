"""The two training backends side by side (issue 48), part of `python -m bench trainer` (trainer.json,
`backends`): `tpuft train` at `backend: xla` (one process holding N PJRT CPU devices; the main venv,
torch 2.9 + torch_xla 2.9) and at `backend: native` (the launcher and N worker processes, FSDP2 over
gloo; `scripts/venv.sh native`, torch 2.15), N = DEVICES, on the training core's tiny Llama
(trainer.MODEL, its sequence length and global batch), one run after the other on this machine.

Same model directory, same prepared data, same global batch, steps and saves. The data is prepared
once (`tpuft prepare`) and each run's output links its `prepared/` to that directory: both backends
read the same files (every run must report that fingerprint, reused, or the benchmark fails). Per run:

- step time: the median of the trainer's own `step_seconds` without steps 1-WARMUP_STEPS (xla
  compiles its graphs there) and without the step after each periodic save (which pays the save's
  blocking); tokens/s = global batch x sequence length / that median; and tokens/s over every step
  after the warm-up, the saves included;
- peak RSS of every process of the run (xla: the one process; native: the launcher and its workers):
  VmHWM sampled by this harness every SAMPLE_S, and for rank 0 at least the trainer's own per-part
  peaks; their sum, each process's, and the peak of the sampled total RSS and total PSS (which divides
  the pages processes share, such as the libraries' code, among them);
- save blocking: the checkpoint manager's SaveRecord of each periodic save in rank 0's record:
  `blocked_seconds` (what training waited), `staging_seconds`, `device_wait_seconds`, `write_seconds`;
- the machine's load: the load average at the start and end of each run and the share of the CPU the
  rest of the machine took meanwhile (the machine is shared: only ratios from one run mean much).

The runs alternate xla, native, native, xla (ROUNDS rounds, each the last one's order reversed), so a
change of the machine's load weighs on both alike. Per backend: speed from its best run, memory the
mean of its runs, the saves the median of all its periodic saves (FIGURES); native / xla of those,
and of each round's two runs. Its working files (a temporary directory) are removed after a run that
succeeded, kept (and named in the error) after one that failed.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.scale import compiled_late, median_step
from bench.trainer import GLOBAL_BATCH, MODEL, SEQ_LEN

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("xla", "native")
DEVICES = 2  # PJRT CPU devices (xla) = worker processes (native): one per core of this machine
STEPS, SAVE_STEPS = 20, 5  # periodic saves at 5, 10 and 15; the last step's save is synchronous
WARMUP_STEPS = 3  # steps 1-3 are left out of the step time (xla compiles there)
ROUNDS = 2
# Made-up documents, log-normal lengths (median MEDIAN_WORDS tokens, at most SEQ_LEN): 524 packed
# rows, more than the STEPS x GLOBAL_BATCH a run reads (no epoch ends within a run).
DOCUMENTS, MEDIAN_WORDS = 1200, 24
SAMPLE_S = 0.05  # VmHWM/VmRSS of every process of the run
PSS_EVERY = 5  # samples between two reads of smaps_rollup (PSS: more costly to read)
RUN_TIMEOUT_S = 900


def periodic_saves_of(metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The periodic saves of a run's record (rank 0's CheckpointManager SaveRecords)."""
    return [
        {
            key: save[key]
            for key in ("step", "blocked_seconds", "staging_seconds", "device_wait_seconds", "write_seconds")
        }
        for save in (metrics.get("attempt") or {}).get("checkpoints") or []
        if save.get("reason") == "periodic"
    ]


def step_figures(metrics: Mapping[str, Any], positions_per_step: int) -> dict[str, Any]:
    """Step time and tokens/s of a run's record (`step_seconds[i]` is step i + 2's wall time): the
    median without the warm-up and the steps that included a periodic save (`scale.median_step`), and
    tokens/s over every step after the warm-up, the saves' blocking included."""
    saves = [save["step"] for save in periodic_saves_of(metrics)]
    step_seconds = metrics["step_seconds"]
    median = median_step(step_seconds, 1, saves, WARMUP_STEPS)
    steps = dict(enumerate(step_seconds, start=2))
    timed = [step for step in steps if step > WARMUP_STEPS and step - 1 not in saves]
    after_warmup = [seconds for step, seconds in steps.items() if step > WARMUP_STEPS]
    return {
        "median_step_seconds": round(median, 4) if median is not None else None,
        "timed_steps": timed,
        "tokens_per_second": round(positions_per_step / median, 1) if median else None,
        "tokens_per_second_with_saves": (
            round(positions_per_step * len(after_warmup) / sum(after_warmup), 1) if after_warmup else None
        ),
        "compiled_after_warmup": compiled_late(metrics.get("compiles_after_step"), 1, WARMUP_STEPS),
    }


def process_peaks(
    samples: Mapping[int, Mapping[str, Any]], trainer_parts: Mapping[str, int] | None
) -> list[dict[str, Any]]:
    """Each process's peak RSS: the largest VmHWM sampled, and for rank 0 (the xla process, native's
    worker 0) at least the trainer's own per-part peaks: it resets VmHWM between its parts, so a peak
    just before a reset can fall between two samples. (The launcher's ru_maxrss from wait4 is no
    measure of its own: Linux reports there the largest of it and its reaped children, the workers.)"""
    out = []
    for seen in sorted(samples.values(), key=lambda seen: _role_order(seen["role"])):
        peak, source = int(seen["hwm"]), "sampled"
        if seen["role"] in ("process", "worker 0") and trainer_parts and max(trainer_parts.values()) > peak:
            peak, source = max(trainer_parts.values()), "trainer"
        out.append(
            {
                "role": seen["role"],
                "omp_num_threads": seen.get("omp_num_threads"),
                "peak_bytes": peak,
                "from": source,
                "sampled_hwm_bytes": int(seen["hwm"]),
                # At the largest RSS sampled: anonymous memory (heaps, tensors) and file pages (the
                # interpreter's and the libraries' code, mapped files): the latter are shared.
                "rss_anon_bytes": int(seen["anon"]),
                "rss_file_bytes": int(seen["file"]),
            }
        )
    return out


def _role_order(role: str) -> tuple[int, str]:
    return ({"process": 0, "launcher": 0}.get(role, 1), role)


def rss_figures(
    peaks: Sequence[Mapping[str, Any]], peak_total_rss: int, peak_total_pss: int
) -> dict[str, Any]:
    return {
        "processes": list(peaks),
        "process_count": len(peaks),
        "sum_of_peaks_bytes": sum(int(p["peak_bytes"]) for p in peaks),
        "largest_process_bytes": max(int(p["peak_bytes"]) for p in peaks),
        "peak_total_rss_bytes": peak_total_rss,  # all processes at one sample: <= the sum of peaks
        "peak_total_pss_bytes": peak_total_pss,
    }


# How a backend's runs are summed up, per figure. The machine is shared and another job's burst can
# slow one run several-fold (it did: docs/benchmarks.md), so speed is each backend's best run, as the
# recipes' benchmark keeps its best round; the saves' figures are the median over all the periodic
# saves of the backend's runs; memory, which the load hardly moves, the mean of its runs.
FIGURES: dict[str, tuple[str, Any]] = {
    "median_step_seconds": ("best", lambda r: r["steps"]["median_step_seconds"]),
    "tokens_per_second": ("best", lambda r: r["steps"]["tokens_per_second"]),
    "tokens_per_second_with_saves": ("best", lambda r: r["steps"]["tokens_per_second_with_saves"]),
    "rss_sum_of_peaks_bytes": ("mean", lambda r: r["rss"]["sum_of_peaks_bytes"]),
    "rss_largest_process_bytes": ("mean", lambda r: r["rss"]["largest_process_bytes"]),
    "rss_peak_total_pss_bytes": ("mean", lambda r: r["rss"]["peak_total_pss_bytes"]),
    "save_blocked_seconds": ("saves", lambda r: [s["blocked_seconds"] for s in r["saves"]]),
    "save_staging_seconds": ("saves", lambda r: [s["staging_seconds"] for s in r["saves"]]),
    "save_write_seconds": ("saves", lambda r: [s["write_seconds"] for s in r["saves"]]),
    # The whole run as the harness timed it, launch to exit (start-up, compilation, saves, export). Not
    # the trainer's attempt.startup_seconds: a native worker counts from its own start, after the
    # launcher's, so the two backends' start-ups are not measured alike.
    "wall_seconds": ("best", lambda r: r["wall_seconds"]),
}
BEST_IS_LEAST = ("median_step_seconds", "wall_seconds")  # the others' best is the most


def summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per backend: each figure as FIGURES says; native / xla of those; and native / xla of the
    speed figures round by round (the two runs of a round ran next to each other)."""

    def figure(backend: str, name: str) -> float | None:
        how, pick = FIGURES[name]
        mine = [r for r in runs if r["backend"] == backend]
        if how == "saves":
            values = [v for r in mine for v in pick(r)]
            return round(statistics.median(values), 4) if values else None
        values = [v for r in mine if (v := pick(r)) is not None]
        if not values:
            return None
        if how == "mean":
            return round(statistics.fmean(values), 4)
        return min(values) if name in BEST_IS_LEAST else max(values)

    by_backend = {b: {name: figure(b, name) for name in FIGURES} for b in BACKENDS}
    ratio = {name: _ratio(by_backend["native"][name], by_backend["xla"][name]) for name in FIGURES}
    rounds = []
    for first in range(0, len(runs) - 1, 2):  # each round: one run of each backend, side by side
        pair = {r["backend"]: r for r in runs[first : first + 2]}
        if set(pair) == set(BACKENDS):
            rounds.append(
                {
                    name: _ratio(FIGURES[name][1](pair["native"]), FIGURES[name][1](pair["xla"]))
                    for name in ("median_step_seconds", "tokens_per_second", "rss_sum_of_peaks_bytes")
                }
            )
    return {
        **by_backend,
        "how": {name: how for name, (how, _) in FIGURES.items()},
        "native_over_xla": ratio,
        "native_over_xla_by_round": rounds,
    }


def _ratio(value: float | None, to: float | None) -> float | None:
    return round(value / to, 3) if value is not None and to else None


def max_loss_difference(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest |loss| difference at a step between any xla and any native run (same data, order
    and initial weights: a check that both trained the same thing)."""
    xla = [r["losses"] for r in runs if r["backend"] == "xla"]
    native = [r["losses"] for r in runs if r["backend"] == "native"]
    diffs = [abs(a[step] - b[step]) for a in xla for b in native for step in a.keys() & b.keys()]
    return round(max(diffs), 6) if diffs else None


# ---- the harness ---------------------------------------------------------------------------------------


@dataclass
class Tree:
    """A process and its descendants: sampled until the root exits, reaped with wait4."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    root_role: str
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    peak_total_rss: int = 0
    peak_total_pss: int = 0
    _done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> dict[str, Any]:
        load_start = _load_average()
        jiffies, own, children = _cpu_jiffies(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        with self.log.open("wb") as out:  # a file, not a pipe: a full pipe would stall the run
            proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        sampler = threading.Thread(target=self._sample, args=(proc.pid,), daemon=True)
        sampler.start()
        timer = threading.Timer(RUN_TIMEOUT_S, _kill_group, args=(proc.pid,))
        timer.start()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: the pid stays ours
        wall = time.monotonic() - started
        self._done.set()
        timer.cancel()
        sampler.join(timeout=10)
        _, status, _ = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        tree_cpu = _cpu(resource.RUSAGE_CHILDREN) - children  # the launcher reaped its workers: theirs too
        busy = (_cpu_jiffies() - jiffies) / os.sysconf("SC_CLK_TCK")
        others = max(0.0, busy - tree_cpu - (_cpu(resource.RUSAGE_SELF) - own))
        return {
            "exit_code": proc.returncode,
            "wall_seconds": round(wall, 2),
            "cpu_seconds": round(tree_cpu, 1),
            "others_cpu_share": round(others / (wall * (os.cpu_count() or 1)), 3),
            "load_average": [load_start, _load_average()],
        }

    def _sample(self, root: int) -> None:
        tick = 0
        while not self._done.is_set():
            total_rss = total_pss = 0
            for pid in _tree(root):
                fields = _status(pid)
                if not fields.get("VmRSS"):
                    continue
                seen = self.samples.get(pid)
                if seen is None or seen["role"].startswith("other"):
                    # A child seen between its fork and its exec has its parent's environment, name
                    # and memory: it is named again until it is a worker (or stays what it is), and
                    # its figures start over when it turns out to be another program.
                    identity = self._identity(pid, root)
                    if seen is None or seen["role"] != identity["role"]:
                        seen = self.samples[pid] = {**identity, "hwm": 0, "rss": 0, "anon": 0, "file": 0}
                seen["hwm"] = max(seen["hwm"], fields.get("VmHWM", 0))
                if fields["VmRSS"] > seen["rss"]:
                    seen.update(
                        rss=fields["VmRSS"], anon=fields.get("RssAnon", 0), file=fields.get("RssFile", 0)
                    )
                total_rss += fields["VmRSS"]
                if tick % PSS_EVERY == 0:
                    total_pss += _pss(pid)
            self.peak_total_rss = max(self.peak_total_rss, total_rss)
            self.peak_total_pss = max(self.peak_total_pss, total_pss)
            tick += 1
            self._done.wait(SAMPLE_S)

    def _identity(self, pid: int, root: int) -> dict[str, Any]:
        """A process's role (the root's, a worker's LOCAL_RANK, else its name) and its threads setting."""
        try:
            environ = dict(
                entry.decode(errors="replace").partition("=")[::2]
                for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if entry
            )
        except OSError:
            environ = {}
        if pid == root:
            role = self.root_role
        elif "LOCAL_RANK" in environ:
            role = f"worker {environ['LOCAL_RANK']}"
        else:
            try:
                role = f"other ({Path(f'/proc/{pid}/comm').read_text().strip()})"
            except OSError:
                role = "other"
        return {
            "role": role,
            "omp_num_threads": environ.get("OMP_NUM_THREADS"),
            "hwm": 0,
            "rss": 0,
            "anon": 0,
            "file": 0,
        }


def _tree(root: int) -> list[int]:
    """``root`` and its descendants now (/proc/PID/task/TID/children: every thread's children)."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                queue.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except OSError:
                continue
    return found


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        os.kill(pid, signal.SIGKILL)


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _cpu_jiffies() -> int:
    """Busy jiffies of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4]


def _load_average() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


# ---- the runs -----------------------------------------------------------------------------------------


def native_python() -> str:
    """The native backend's venv (scripts/venv.sh native): an error saying how to get it if missing."""
    path = subprocess.run(
        [str(REPO / "scripts" / "venv.sh"), "native", "--path"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not (Path(path) / ".complete").is_file():
        raise SystemExit(
            f"the native backend's venv is missing at {path}: run `scripts/venv.sh native` (or make venv-native)"
        )
    return str(Path(path) / "bin" / "python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(backend: str, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "TPU_", "TPUFT_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("operator", "trainer_image")),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        KUBECONFIG="/nonexistent",  # no progress reporting to any cluster
        TPUFT_CACHE_DIR=str(cache),
    )
    if backend == "xla":
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES))
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return env


def config(root: Path, backend: str, output: Path) -> dict[str, Any]:
    """Every run's trainer config: only `backend` and the output differ."""
    return {
        "backend": backend,
        "model": {"name": str(root / "model"), "dtype": "float32"},
        "dataset": {"name": str(root / "documents.jsonl"), "packing": True},
        "training": {
            "max_steps": STEPS,
            "learning_rate": 1e-3,
            "per_device_batch_size": GLOBAL_BATCH // DEVICES,
            "max_seq_length": SEQ_LEN,
            "optimizer": "adamw",
            "save_steps": SAVE_STEPS,
            "logging_steps": 1,  # the loss read every step: each step has finished when its time is taken
        },
        "output": {"uri": str(output)},
        "world": {"chips_per_host": DEVICES},
    }


def materials_worker(root: Path) -> None:
    """The model (trainer.MODEL, float32), a word-level tokenizer and made-up documents."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = MODEL["vocab_size"]
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(**MODEL, num_key_value_heads=MODEL["num_attention_heads"], use_cache=False,
                    pad_token_id=0, eos_token_id=2, bos_token_id=2)
    ).save_pretrained(root / "model")  # fmt: skip
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(root / "model")
    rng = random.Random(48)
    with (root / "documents.jsonl").open("w") as out:
        for _ in range(DOCUMENTS):
            words = max(4, min(SEQ_LEN, round(rng.lognormvariate(math.log(MEDIAN_WORDS), 0.6))))
            out.write(
                json.dumps({"text": " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(words))})
                + "\n"
            )


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")


def prepare(root: Path) -> dict[str, Any]:
    """The model, the documents, and the prepared dataset at ``root``/shared (`tpuft prepare`, once):
    its manifest."""
    import yaml

    env = _env("xla", root / "cache")
    _check(
        subprocess.run([sys.executable, "-m", "bench.backends", "materials", str(root)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=600),
        "building the model and documents",
    )  # fmt: skip
    path = root / "prepare.yaml"
    path.write_text(yaml.safe_dump(config(root, "xla", root / "shared")))
    _check(
        subprocess.run([sys.executable, "-m", "tpuft_operator", "prepare", "--config", str(path)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600),
        "tpuft prepare",
    )  # fmt: skip
    (manifest,) = (root / "shared" / "prepared").glob("*/manifest.json")
    body: dict[str, Any] = json.loads(manifest.read_text())
    return body


def run(root: Path, backend: str, index: int, python: str) -> dict[str, Any]:
    """One `tpuft train` run of ``backend``: the harness's figures and the trainer's record."""
    import yaml

    output = root / f"run-{index}-{backend}"
    output.mkdir()
    (output / "prepared").symlink_to(root / "shared" / "prepared", target_is_directory=True)
    path = root / f"run-{index}-{backend}.yaml"
    path.write_text(yaml.safe_dump(config(root, backend, output)))
    tree = Tree(
        [python, "-m", "tpuft_operator", "train", "--config", str(path)],
        _env(backend, root / f"cache-{index}"),
        root / f"run-{index}-{backend}.log",
        "process" if backend == "xla" else "launcher",
    )
    harness = tree.run()
    if harness["exit_code"] != 0:
        tail = tree.log.read_text(errors="replace")[-3000:]
        raise SystemExit(
            f"tpuft train at backend {backend} failed (exit {harness['exit_code']}; its files: {root}):\n{tail}"
        )
    metrics = json.loads((output / "tpuft-metrics.json").read_text())
    parts = {k: v for k, v in (metrics.get("peak_rss") or {}).items() if isinstance(v, int)}
    peaks = process_peaks(tree.samples, parts)
    return {
        "backend": backend,
        **harness,
        "processes": metrics.get("process_count"),
        "devices": metrics.get("devices"),
        "startup_seconds": (metrics.get("attempt") or {}).get("startup_seconds"),
        "steps": step_figures(metrics, GLOBAL_BATCH * SEQ_LEN),
        "step_seconds": metrics["step_seconds"],
        "saves": periodic_saves_of(metrics),
        "rss": rss_figures(peaks, tree.peak_total_rss, tree.peak_total_pss),
        "trainer_peak_rss_parts": parts,
        "losses": {int(k): v for k, v in metrics["losses"].items()},
        "data": {k: metrics["data"].get(k) for k in ("fingerprint", "reused")},
        "data_directory": str(Path(metrics["data"]["directory"]).resolve()),
    }


def order(rounds: int = ROUNDS) -> list[str]:
    """xla, native, native, xla, ...: each round reverses the last's order."""
    out: list[str] = []
    for r in range(rounds):
        out += list(BACKENDS if r % 2 == 0 else reversed(BACKENDS))
    return out


def main(rounds: int = ROUNDS) -> dict[str, Any]:
    python = native_python()
    root = Path(tempfile.mkdtemp(prefix="tpuft-bench-backends-"))
    started = datetime.now(UTC)
    load_start = _load_average()
    prepared = prepare(root)
    runs = []
    for index, backend in enumerate(order(rounds)):
        print(f"   [backends] {backend} run {index + 1}/{2 * rounds}", flush=True)
        runs.append(run(root, backend, index, sys.executable if backend == "xla" else python))
    same_data = {(r["data"]["fingerprint"], r["data_directory"]) for r in runs}
    if len(same_data) != 1 or not all(r["data"]["reused"] for r in runs):
        raise SystemExit(f"the runs did not all read the one prepared dataset: {same_data}")
    for r in runs:
        r.pop("data_directory")
    shutil.rmtree(root, ignore_errors=True)
    return {
        "what": (
            f"tpuft train, backend xla (1 process, {DEVICES} PJRT CPU devices) vs native ({DEVICES} gloo "
            f"processes + launcher), the tiny Llama, rows of {SEQ_LEN}, global batch {GLOBAL_BATCH}"
        ),
        "started": started.isoformat(timespec="seconds"),
        "ended": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": {"start": load_start, "end": _load_average()},
        "cpu_count": os.cpu_count(),
        "devices": DEVICES,
        "model": MODEL,
        "seq_len": SEQ_LEN,
        "global_batch": GLOBAL_BATCH,
        "steps": STEPS,
        "save_steps": SAVE_STEPS,
        "warmup_steps": WARMUP_STEPS,
        "sample_seconds": SAMPLE_S,
        "data": {
            "fingerprint": next(iter(same_data))[0],
            "rows": prepared["splits"]["train"]["rows"],
            "documents": prepared["splits"]["train"]["documents"],
            "prepare_seconds": prepared["seconds"],
        },
        "versions": {"xla": _versions(sys.executable), "native": _versions(python)},
        "order": [r["backend"] for r in runs],
        "runs": runs,
        "summary": summary(runs),
        "max_loss_difference": max_loss_difference(runs),
    }


def _versions(python: str) -> dict[str, str]:
    done = subprocess.run(
        [python, "-c", "import json, torch; print(json.dumps({'torch': torch.__version__}))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, str] = json.loads(done.stdout)
    return result


def report(results: Mapping[str, Any]) -> list[str]:
    """Every run, then native / xla: the console's lines."""
    lines = [
        f"backends ({results['what']}; {results['steps']} steps, a periodic save every {results['save_steps']}; "
        f"load average {results['load_average']['start'][0]:.1f} -> {results['load_average']['end'][0]:.1f}):",
        f"  {'run':<10} {'step s':>7} {'tokens/s':>9} {'w/ saves':>9} {'RSS sum':>8} {'PSS':>8} "
        f"{'blocked s (periodic saves)':>26} {'others':>6}",
    ]
    for index, r in enumerate(results["runs"]):
        steps, rss = r["steps"], r["rss"]
        blocked = "/".join(f"{s['blocked_seconds']:.3f}" for s in r["saves"])
        lines.append(
            f"  {index + 1}. {r['backend']:<7} {steps['median_step_seconds']:>7.3f} {steps['tokens_per_second']:>9,.0f}"
            f" {steps['tokens_per_second_with_saves']:>9,.0f} {_gb(rss['sum_of_peaks_bytes']):>8}"
            f" {_gb(rss['peak_total_pss_bytes']):>8} {blocked:>26} {r['others_cpu_share']:>6.0%}"
        )
        lines.append("       peak RSS per process: " + _per_process(rss["processes"]))
    ratio, by_round = results["summary"]["native_over_xla"], results["summary"]["native_over_xla_by_round"]
    lines.append(
        f"  native / xla: step {ratio['median_step_seconds']}x (best runs; by round "
        f"{', '.join(str(r['median_step_seconds']) for r in by_round)}), tokens/s {ratio['tokens_per_second']}x, "
        f"RSS sum {ratio['rss_sum_of_peaks_bytes']}x (means), save blocked {ratio['save_blocked_seconds']}x "
        f"(medians of the saves); largest loss difference at a step {results['max_loss_difference']}"
    )
    return lines


def page_rows(results: Mapping[str, Any]) -> list[str]:
    """The rows of docs/benchmarks.md's table (a test checks the page shows them as they are here)."""
    summed, ratio = results["summary"], results["summary"]["native_over_xla"]
    runs = {b: [r for r in results["runs"] if r["backend"] == b] for b in BACKENDS}
    by_round = ", ".join(f"{r['median_step_seconds']:.2f}x" for r in summed["native_over_xla_by_round"])

    def row(label: str, cell: Any, ratio_of: str | None, note: str = "") -> str:
        x = f"{ratio[ratio_of]:.2f}x" if ratio_of else ""
        return f"| {label} | {cell('xla')} | {cell('native')} | {x}{note} |"

    def each(backend: str, pick: Any, fmt: str) -> str:
        return " / ".join(format(pick(r), fmt) for r in runs[backend])

    def saves(backend: str, key: str) -> str:
        values = [s[key] for r in runs[backend] for s in r["saves"]]
        return f"{summed[backend][f'save_{key}']:.3f} ({min(values):.3f}-{max(values):.3f})"

    first_timed = results["warmup_steps"] + 1
    return [
        row("median step, s: the best run (each run)",
            lambda b: f"{summed[b]['median_step_seconds']:.3f} ({each(b, lambda r: r['steps']['median_step_seconds'], '.3f')})",
            "median_step_seconds", f"; by round {by_round}"),
        row("tokens/s at that median step", lambda b: f"{summed[b]['tokens_per_second']:,.0f}", "tokens_per_second"),
        row(f"tokens/s over steps {first_timed}-{results['steps']}, saves included",
            lambda b: f"{summed[b]['tokens_per_second_with_saves']:,.0f}", "tokens_per_second_with_saves"),
        row("peak RSS, sum of the processes (each, GB)",
            lambda b: f"{_gb(summed[b]['rss_sum_of_peaks_bytes'])} ({_per_process(runs[b][-1]['rss']['processes'])})",
            "rss_sum_of_peaks_bytes"),
        row("peak total PSS (shared pages divided)", lambda b: _gb(summed[b]["rss_peak_total_pss_bytes"]),
            "rss_peak_total_pss_bytes"),
        row("a periodic save blocks training, s: median (range)", lambda b: saves(b, "blocked_seconds"),
            "save_blocked_seconds"),
        row("its write, in the background, s", lambda b: saves(b, "write_seconds"), "save_write_seconds"),
        row("the whole run, launch to exit, s (best run)", lambda b: f"{summed[b]['wall_seconds']:.1f}",
            "wall_seconds"),
        row("the rest of the machine's CPU during each run", lambda b: each(b, lambda r: r["others_cpu_share"], ".0%"),
            None),
    ]  # fmt: skip


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _per_process(processes: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(
        f"{p['role']} {p['peak_bytes'] / 1e9:.2f}" for p in processes if not p["role"].startswith("other")
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "materials":
        materials_worker(Path(sys.argv[2]))
    else:
        raise SystemExit("run by `python -m bench trainer` (bench/trainer.py)")
