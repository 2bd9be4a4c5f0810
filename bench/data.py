"""Data at scale (issue 47): `python -m bench data [--sizes 20000 100000]`, part of `make bench`.

A chat set shaped like an open SFT mixture, made here (nothing downloaded): 1 to 4 turns, a system
prompt in 30% of the conversations, ~750 tokens a conversation, words drawn from a Zipf-distributed
vocabulary of made-up words; a byte-level BPE tokenizer of up to 32,000 tokens trained on it; a
Llama-3-style chat template without ``{% generation %}`` markers (as most templates on the hub);
assistant-only loss, packing, maxSeqLength 2048. Every measurement is a process of its own with an
empty datasets cache (a pod starts with none), one at a time:

- ``legacy``: the in-process path of tpuft up to ffed871 (bench/legacy_data.py), 20k only (at
  ~250 bytes a token, 100k conversations would need ~19 GB of this 24 GiB machine);
- ``prepare-1``, ``prepare-2``: ``data.prepare`` (what ``tpuft prepare`` and ``tpuft train`` run) with
  1 and 2 workers, assistant masks included;
- ``floor``: the one-process floor: every conversation rendered once and tokenised in one batched call
  with character offsets (what an assistant mask needs), nothing else;
- ``trl``: trl's own path: rendered, tokenised in batched ``dataset.map``, best-fit packed on Arrow
  with ``trl.data_utils.pack_dataset`` (no assistant mask: trl finds one only from markers);
- ``train``: ``tpuft train`` (a tiny model on 4 PJRT CPU devices), seconds from process start to the
  end of its first step, without and with the set prepared beforehand;
- preference pairs (``--pairs N``, objective dpo): chat pairs made of the same conversations (the
  prompt: every turn but the last answer; chosen: that answer; rejected: the next conversation's),
  tokenised by ``dpo-trl`` (trl 1.16's DPOTrainer at start: ``_prepare_dataset``, what every host ran
  before) and by ``dpo-prepare-1``/``-2`` (data.prepare, 1 and 2 workers: the same columns); and
  ``dpo-read``: the prepared pairs opened as the Dataset DPOTrainer is given, then every pair read
  (its RSS over the base: what the memory-mapped files cost a training process).

Figures: wall seconds, conversations a second, peak RSS over the process's base (VmRSS once its
imports and the tokenizer are loaded) in bytes a token, and for the pool the workers' own peak; rows
after packing and the packing share (real tokens / positions). Results: bench/results/data.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from bench import results_file

RESULTS = results_file("data")
SIZES = (20_000, 100_000)
PAIRS = 5_000
LEGACY_MAX = 20_000
MAX_LENGTH = 2048
VOCAB = 32_000
TARGETS = {"wall_over_floor": 1.2, "bytes_per_token": 20.0, "packing_share_points": 1.0}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


# ---- the data and the tokenizer --------------------------------------------------------------------
def _words(rng: random.Random, count: int = 40_000) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    return [
        "".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(count)
    ]


def _sentence(rng: random.Random, words: list[str], cumulative: list[float], n: int) -> str:
    chosen = rng.choices(words, cum_weights=cumulative, k=n)
    return " ".join(chosen).capitalize() + rng.choice((".", ".", "?", "!"))


def write_corpus(path: Path, conversations: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = _words(rng)
    weights = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))  # Zipf
    with path.open("w") as out:
        for _ in range(conversations):
            messages = []
            if rng.random() < 0.3:
                messages.append(
                    {"role": "system", "content": _sentence(rng, words, weights, rng.randint(8, 30))}
                )
            for _ in range(rng.randint(1, 4)):
                question = " ".join(
                    _sentence(rng, words, weights, rng.randint(6, 18)) for _ in range(rng.randint(1, 4))
                )
                answer = " ".join(
                    _sentence(rng, words, weights, rng.randint(8, 24)) for _ in range(rng.randint(3, 14))
                )
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_tokenizer(directory: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False)

    def texts() -> Any:
        with corpus.open() as lines:
            for index, line in enumerate(lines):
                if index >= 5000:
                    return
                yield from (m["content"] for m in json.loads(line)["messages"])

    core.train_from_iterator(texts(), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[4], pad_token=SPECIALS[1]
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    return directory


def write_model(directory: Path, tokenizer_dir: Path) -> Path:
    """A tiny Llama with the tokenizer's vocabulary, for the start-up runs."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LENGTH,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


# ---- one measurement, in its own process -------------------------------------------------------------
def _rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_seconds() -> float:
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _config(corpus: Path, model: Path, output: Path, *, pairs: bool = False) -> Any:
    from tpuft_trainer.config import (
        DatasetSource,
        ModelSource,
        OutputConfig,
        TrainerConfig,
        TrainingConfig,
    )  # fmt: skip

    dataset = (
        DatasetSource(name=str(corpus), format="preference")
        if pairs
        else DatasetSource(name=str(corpus), format="chat", packing=True)
    )
    return TrainerConfig(
        model=ModelSource(name=str(model), dtype="float32"),
        dataset=dataset,
        training=TrainingConfig(
            max_steps=2,
            max_seq_length=MAX_LENGTH,
            per_device_batch_size=1,
            objective="dpo" if pairs else "sft",
        ),
        output=OutputConfig(uri=str(output)),
    )


def write_pairs(path: Path, corpus: Path, pairs: int) -> Path:
    """Chat preference pairs made of the corpus' conversations (see the module docstring)."""
    with corpus.open() as lines:
        chats = [json.loads(line)["messages"] for _, line in zip(range(pairs + 1), lines, strict=False)]
    with path.open("w") as out:
        for chat, other in itertools.pairwise(chats):
            row = {"prompt": chat[:-1], "chosen": chat[-1:], "rejected": other[-1:]}
            out.write(json.dumps(row) + "\n")
    return path


def _pairs_worker(kind: str, corpus: Path, model: Path, output: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tpuft_trainer.checkpoint.layout import Store
    from tpuft_trainer.data import prepare, prepared, sources

    tok = AutoTokenizer.from_pretrained(model)
    config = _config(corpus, model, output, pairs=True)
    result: dict[str, Any]
    if kind == "dpo-trl":
        import contextlib
        import tempfile as tmp

        import trl.trainer.dpo_trainer
        from trl import DPOConfig, DPOTrainer

        from tpuft_trainer import dpo

        # One process: the ordering of processes around the map does no work.
        trl.trainer.dpo_trainer.global_then_local_main_first = contextlib.nullcontext  # type: ignore[assignment]
        args = DPOConfig(output_dir=tmp.mkdtemp(), report_to=[], **dpo.arguments(config))
    base = _rss()
    started, cpu = time.monotonic(), _cpu_seconds()
    if kind == "dpo-trl":
        rows = sources.load_rows(config.dataset)
        trainer: Any = types.SimpleNamespace(_tokenizer=tok)  # all of the trainer it reads
        done = DPOTrainer._prepare_dataset(trainer, rows, tok, args, "train")
        result = {
            "pairs": len(done),
            "tokens": sum(sum(map(len, done[c])) for c in ("prompt_ids", "chosen_ids", "rejected_ids")),
        }
    elif kind.startswith("dpo-prepare-"):
        key = prepared.fingerprint(config, tok)
        ready = prepare.prepare(
            config, tok, key, Store(str(output)), workers=int(kind.rsplit("-", 1)[1]), publish=True
        )
        train = ready.manifest.splits["train"]
        result = {
            "pairs": train.rows,
            "tokens": train.tokens,
            "dropped": train.dropped,
            "truncated": train.truncated,
        }
    elif kind == "dpo-read":
        import datasets  # noqa: F401  (its import is the training process's anyway: not counted)
        import pyarrow  # noqa: F401

        ready = prepare.find_or_prepare(config, tok)  # prepared by dpo-prepare-1 at the same output
        assert ready.reused
        base = _rss()
        started, cpu = time.monotonic(), _cpu_seconds()
        dataset = ready.pairs()
        opened = _rss() - base
        tokens = 0
        for pair in dataset:
            tokens += len(pair["prompt_ids"]) + len(pair["chosen_ids"]) + len(pair["rejected_ids"])
        result = {"pairs": len(dataset), "tokens": tokens, "opened_bytes": opened}
    else:
        raise SystemExit(f"unknown kind {kind}")
    result.update(
        seconds=round(time.monotonic() - started, 2),
        # CPU seconds (this process and its workers): less sensitive than the wall time to other work
        # sharing the machine.
        cpu_seconds=round(_cpu_seconds() - cpu, 2),
        base_bytes=base,
        peak_bytes=_rss("VmHWM"),
        rss_after_bytes=_rss(),
        workers_peak_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    )
    return result


def worker(kind: str, corpus: Path, model: Path, output: Path) -> dict[str, Any]:
    if kind.startswith("dpo-"):
        return _pairs_worker(kind, corpus, model, output)
    from transformers import AutoTokenizer

    from tpuft_trainer.config import DatasetSource
    from tpuft_trainer.data import sources

    tok = AutoTokenizer.from_pretrained(model)
    source = DatasetSource(name=str(corpus), format="chat", packing=True)
    base = _rss()
    started = time.monotonic()
    result: dict[str, Any]
    if kind == "legacy":
        from bench import legacy_data

        rows = legacy_data.tokenize(sources.load_rows(source), tok, source, MAX_LENGTH, 1)
        figures = legacy_data.figures(rows)
        result = {
            "rows": figures.rows,
            "loss_tokens": figures.loss_tokens,
            "tokens": _tokens(rows, tok.pad_token_id),
        }
    elif kind.startswith("prepare-"):
        from tpuft_trainer.checkpoint.layout import Store
        from tpuft_trainer.data import prepare, prepared

        config = _config(corpus, model, output)
        key = prepared.fingerprint(config, tok)
        ready = prepare.prepare(
            config, tok, key, Store(str(output)), workers=int(kind.split("-")[1]), publish=True
        )
        train = ready.manifest.splits["train"]
        result = {
            "rows": train.rows,
            "loss_tokens": train.loss_tokens,
            "tokens": train.tokens,
            "dropped": train.dropped,
        }
    elif kind == "floor":
        rows = sources.load_rows(source)
        texts = [tok.apply_chat_template(m, tokenize=False) for m in rows["messages"]]
        encoded = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        result = {"tokens": sum(len(ids) for ids in encoded["input_ids"])}
        del encoded, texts
    elif kind == "trl":
        from trl.data_utils import pack_dataset

        rows = sources.load_rows(source)
        text = rows.map(
            lambda b: {"text": [tok.apply_chat_template(m, tokenize=False) for m in b["messages"]]},
            batched=True, remove_columns=rows.column_names,
        )  # fmt: skip
        ids = text.map(
            lambda b: tok(b["text"], add_special_tokens=False, truncation=True, max_length=MAX_LENGTH),
            batched=True, remove_columns=["text"],
        )  # fmt: skip
        tokens = sum(len(r) for r in ids["input_ids"])
        packed = pack_dataset(ids, MAX_LENGTH, strategy="bfd")
        result = {"rows": len(packed), "tokens": tokens}
    else:
        raise SystemExit(f"unknown kind {kind}")
    result.update(
        seconds=round(time.monotonic() - started, 2),
        base_bytes=base,
        peak_bytes=_rss("VmHWM"),
        workers_peak_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    )
    return result


def _tokens(rows: Any, pad_id: int) -> int:
    """Real tokens of packed rows: every position but the padding (the pad token never occurs in a
    rendered conversation of this set)."""
    import numpy as np

    return sum(
        int((np.asarray(batch["input_ids"]) != pad_id).sum())
        for batch in rows.with_format("numpy").iter(batch_size=1024)
    )


def measure(kind: str, corpus: Path, model: Path, output: Path) -> dict[str, Any]:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=tempfile.mkdtemp(), TOKENIZERS_PARALLELISM="true"
    )
    result_file = Path(tempfile.mkdtemp()) / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.data", "--worker", kind, str(corpus), str(model), str(output), str(result_file)],
        env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode:
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(result_file.read_text())
    tokens = max(1, result.get("tokens", 1))
    result["bytes_per_token"] = round((result["peak_bytes"] - result["base_bytes"]) / tokens, 1)
    if result.get("workers_peak_bytes"):
        result["worker_bytes_per_token"] = round(
            (result["workers_peak_bytes"] - result["base_bytes"]) / tokens, 1
        )
    if result.get("pairs"):
        result["pairs_per_second"] = round(result["pairs"] / max(result["seconds"], 1e-9), 1)
        result["pairs_per_cpu_second"] = round(result["pairs"] / max(result["cpu_seconds"], 1e-9), 1)
    if result.get("rows"):
        result["packing_share"] = round(tokens / (result["rows"] * MAX_LENGTH), 4)
    return result


def startup(corpus: Path, model: Path, *, prepared_first: bool) -> dict[str, Any]:
    """`tpuft train` on 4 CPU devices: process start -> end of the first step."""
    output = Path(tempfile.mkdtemp())
    config = _config(corpus, model, output)
    config_path = output / "config.yaml"
    config_path.write_text(config.to_yaml())
    env = dict(
        os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=tempfile.mkdtemp(), TPUFT_CACHE_DIR=tempfile.mkdtemp(),
    )  # fmt: skip
    if prepared_first:
        subprocess.run(
            [sys.executable, "-m", "tpuft_operator", "prepare", "--config", str(config_path)],
            env=env, check=True, capture_output=True, timeout=3600,
        )  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tpuft_operator", "train", "--config", str(config_path)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode:
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    metrics = json.loads((output / "tpuft-metrics.json").read_text())
    return {
        "startup_seconds": metrics["attempt"]["startup_seconds"],
        "process_seconds": round(time.monotonic() - started, 1),
        "reused": metrics["data"]["reused"],
        "peak_rss_load_bytes": metrics["peak_rss"]["load"],
    }


# ---- the run ------------------------------------------------------------------------------------------
def main(sizes: tuple[int, ...] = SIZES, pairs: int = PAIRS) -> dict[str, Any]:
    """The SFT sizes (none: keep data.json's figures of them) and the preference pairs (0: keep theirs)."""
    work = Path(tempfile.mkdtemp(prefix="tpuft-bench-data-"))
    most = max((*sizes, pairs + 1))
    corpus_all = write_corpus(work / f"chats-{most}.jsonl", most)
    model = write_model(work / "model", write_tokenizer(work / "tokenizer", corpus_all))
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() and not (sizes and pairs) else {}
    results: dict[str, Any] = {"sizes": {}} if sizes else kept
    if pairs:
        results["pairs"] = measure_pairs(work, corpus_all, model, pairs)
    elif "pairs" in kept:
        results["pairs"] = kept["pairs"]
    for size in sizes:
        corpus = work / f"chats-{size}.jsonl"
        if not corpus.exists():
            with corpus_all.open() as lines, corpus.open("w") as out:
                out.writelines(line for _, line in zip(range(size), lines, strict=False))
        kinds = ["floor", "prepare-1", "prepare-2", "trl"] + (["legacy"] if size <= LEGACY_MAX else [])
        runs = {}
        for kind in kinds:
            runs[kind] = measure(kind, corpus, model, Path(tempfile.mkdtemp()))
            if "seconds" in runs[kind]:
                runs[kind]["conversations_per_second"] = round(size / runs[kind]["seconds"], 1)
            print(f"{size} {kind}: {json.dumps(runs[kind])}", flush=True)
        results["sizes"][str(size)] = runs
    if sizes:
        smallest = work / f"chats-{min(sizes)}.jsonl"
        results["startup"] = {
            "conversations": min(sizes),
            "without_prepared": startup(smallest, model, prepared_first=False),
            "with_prepared": startup(smallest, model, prepared_first=True),
        }
    results.update(
        what="issue 47's data path at scale (see bench/data.py)",
        max_seq_length=MAX_LENGTH,
        cpu_count=os.cpu_count(),
        targets=TARGETS,
        verdicts=verdicts(results),
    )
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report(results)))
    return results


def measure_pairs(work: Path, corpus: Path, model: Path, pairs: int) -> dict[str, Any]:
    path = write_pairs(work / f"pairs-{pairs}.jsonl", corpus, pairs)
    output = Path(tempfile.mkdtemp())  # dpo-read reads what dpo-prepare-1 published here
    runs: dict[str, Any] = {"pairs": pairs}
    for kind in ("dpo-trl", "dpo-prepare-1", "dpo-prepare-2", "dpo-read"):
        where = output if kind in ("dpo-prepare-1", "dpo-read") else Path(tempfile.mkdtemp())
        runs[kind] = measure(kind, path, model, where)
        print(f"{pairs} pairs {kind}: {json.dumps(runs[kind])}", flush=True)
    return runs


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, runs in results["sizes"].items():
        floor = runs["floor"].get("seconds")
        best = min(
            (runs[k]["seconds"] for k in ("prepare-1", "prepare-2") if "seconds" in runs[k]), default=None
        )
        out[size] = {
            "wall_over_floor": round(best / floor, 2) if best and floor else None,
            "bytes_per_token": max(runs[k].get("bytes_per_token", 0) for k in ("prepare-1", "prepare-2")),
        }
        if "legacy" in runs and "packing_share" in runs["legacy"]:
            out[size]["packing_share_points_vs_legacy"] = round(
                100 * (runs["prepare-1"]["packing_share"] - runs["legacy"]["packing_share"]), 2
            )
    return out


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"data ({results['what']}; {results['cpu_count']} CPUs; bench/results/data.json):"]
    lines.append(
        f"{'size':>7} {'path':>10} {'seconds':>8} {'conv/s':>8} {'B/token':>8} {'rows':>7} {'share':>6}"
    )
    for size, runs in results["sizes"].items():
        for kind, r in runs.items():
            if "failed" in r:
                lines.append(f"{size:>7} {kind:>10} failed ({r['failed']})")
                continue
            lines.append(
                f"{size:>7} {kind:>10} {r['seconds']:>8} {r.get('conversations_per_second', ''):>8} "
                f"{r['bytes_per_token']:>8} {r.get('rows', ''):>7} {r.get('packing_share', ''):>6}"
            )
    pairs = results.get("pairs")
    if pairs:
        lines.append(
            f"{pairs['pairs']} chat preference pairs (dpo): pairs/s, seconds, pairs per CPU second, "
            "peak RSS over the base (MB)"
        )
        for kind in ("dpo-trl", "dpo-prepare-1", "dpo-prepare-2", "dpo-read"):
            r = pairs.get(kind, {})
            if "seconds" not in r:
                lines.append(f"{kind:>14} failed")
                continue
            peak = (r["peak_bytes"] - r["base_bytes"]) / 1e6
            lines.append(
                f"{kind:>14} {r['pairs_per_second']:>9} {r['seconds']:>8} "
                f"{r.get('pairs_per_cpu_second', ''):>9} {peak:>8.0f}"
            )
    start = results.get("startup")
    if not start:
        return lines
    lines.append(
        f"tpuft train start-up at {start['conversations']} conversations: "
        f"{start['without_prepared'].get('startup_seconds')} s preparing in-process, "
        f"{start['with_prepared'].get('startup_seconds')} s reading a prepared set"
    )
    lines.append(f"verdicts: {json.dumps(results['verdicts'])}")
    return lines


def cli(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench data", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="none: pairs only")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="preference pairs (0: none)")
    args = parser.parse_args(argv)
    return main(tuple(args.sizes), args.pairs)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        kind, corpus, model, output, result = sys.argv[2:]
        Path(result).write_text(json.dumps(worker(kind, Path(corpus), Path(model), Path(output))))
    else:
        cli(sys.argv[1:])
