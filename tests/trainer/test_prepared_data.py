"""The prepared dataset (data/), on the CPU without XLA: the rows equal the earlier in-process path's
bit for bit, whatever the worker count; a prepared set is reused until a setting that decides its
content changes; a cut-off prepare is never read; a bucket output works; `tpuft prepare` reports its
figures, and its errors with their exit codes, to the operator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiny
from bench import legacy_data
from click.testing import CliRunner

from tpuft_trainer import data
from tpuft_trainer.config import DatasetSource
from tpuft_trainer.data import prepare, prepared, sources
from tpuft_trainer.errors import DataError, NotFoundError, PermissionDeniedError

pytestmark = pytest.mark.trainer


def legacy_rows(source: DatasetSource, tok: Any, seq: int, *, split: str = "train") -> list[dict[str, Any]]:
    train, held = prepare.split_rows(data.load_rows(source), source, seed=42)
    rows = legacy_data.tokenize(train if split == "train" else held, tok, source, seq, 1)
    return [dict(row) for row in rows]


def mixed_chats(n: int) -> list[dict[str, Any]]:
    """Conversations of 1-3 turns, some with a system prompt, of varied lengths."""
    import random

    rng = random.Random(5)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            words = " ".join(rng.choice(tiny.WORDS) for _ in range(rng.randint(1, 14)))
            messages += [
                {"role": "user", "content": f"{words}?"},
                {"role": "assistant", "content": f"{turn} {words[: rng.randint(1, 20)]}"},
            ]
        rows.append({"messages": messages})
    return rows


CASES = {
    "text padded": dict(format="text"),
    "text packed": dict(format="text", packing=True),
    "chat assistant-only packed": dict(format="chat", packing=True),
    "chat assistant-only padded, generation markers": dict(format="chat"),
    "chat every token packed": dict(format="chat", assistant_only_loss=False, packing=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prepared_rows_equal_the_in_process_rows_of_before(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tiny.tokenizer()
    if "markers" in case:
        tok.chat_template = tiny.CHAT_TEMPLATE_WITH_MARKERS
    settings = CASES[case]
    rows = tiny.texts(150) if settings["format"] == "text" else mixed_chats(150)
    path = tiny.write_rows(
        tmp_path / "d.jsonl", [{"text": r} for r in rows] if settings["format"] == "text" else rows
    )
    source = DatasetSource(name=str(path), eval_fraction=0.1, **settings)  # type: ignore[arg-type]
    monkeypatch.setattr(prepare, "CHUNK_ROWS", 32)  # several chunks, so the pool's order matters
    # The rows of before, once per split: they do not depend on the worker count.
    before = {split: legacy_rows(source, tok, 48, split=split) for split in ("train", "eval")}
    for workers in (1, 2):
        output = tmp_path / f"out-{workers}"
        for split, old in before.items():
            new = tiny.prepared_rows(source, tok, 48, output, workers=workers, split=split)
            assert len(new) == len(old) and set(new[0]) == set(old[0])
            assert new == [{key: row[key] for key in new[0]} for row in old], (case, workers, split)


def test_a_prepared_set_is_reused_until_what_decides_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tiny.tokenizer()
    path = tiny.write_jsonl(tmp_path / "d.jsonl", n=40)
    config = tiny.trainer_config(DatasetSource(name=str(path), packing=True), tmp_path / "out", 64)
    first = prepare.find_or_prepare(config, tok)
    assert not first.reused and first.directory == tmp_path / "out" / "prepared" / first.manifest.fingerprint

    def no_tokenising(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenised again")

    monkeypatch.setattr(prepare, "encode_chunk", no_tokenising)
    # Steps, learning rate, the batch: nothing that decides the rows. The same set, read as it is.
    other_run = config.model_copy(
        update={"training": config.training.model_copy(update={"max_steps": 9, "learning_rate": 1e-3})}
    )
    again = prepare.find_or_prepare(other_run, tok)
    assert again.reused and again.manifest == first.manifest
    monkeypatch.undo()
    changes = {
        "maxSeqLength": config.model_copy(
            update={"training": config.training.model_copy(update={"max_seq_length": 32})}
        ),
        "packing": config.model_copy(
            update={"dataset": config.dataset.model_copy(update={"packing": False})}
        ),
        "seed with an eval fraction": tiny.trainer_config(
            config.dataset.model_copy(update={"eval_fraction": 0.2}), tmp_path / "out", 64, seed=7
        ),
    }
    keys = {first.manifest.fingerprint}
    for what, changed in changes.items():
        ready = prepare.find_or_prepare(changed, tok)
        assert not ready.reused and ready.manifest.fingerprint not in keys, what
        keys.add(ready.manifest.fingerprint)
    marked = tiny.tokenizer()
    marked.chat_template = tiny.CHAT_TEMPLATE_WITH_MARKERS  # the tokenizer's own files changed
    assert prepared.fingerprint(config, marked) not in keys
    path.write_text(path.read_text() + json.dumps({"text": "one more row."}) + "\n")  # the data changed
    assert prepared.fingerprint(config, tok) not in keys


def test_a_set_smaller_than_one_global_batch_is_a_data_error_with_its_figures(tmp_path: Path) -> None:
    path = tiny.write_jsonl(tmp_path / "d.jsonl", n=8)
    ready = prepare.find_or_prepare(
        tiny.trainer_config(DatasetSource(name=str(path), packing=True), tmp_path / "out", 256),
        tiny.tokenizer(),
    )
    rows = ready.manifest.splits["train"].rows
    assert rows < 8  # ~60-token documents, four to a row
    ready.check_fills_a_batch(rows, "d.jsonl")  # exactly one batch: fine
    with pytest.raises(
        DataError, match=rf"has {rows} rows after packing 8 documents, fewer than one global batch"
    ):
        ready.check_fills_a_batch(rows + 1, "d.jsonl")


def test_a_cut_off_prepare_is_never_read(tmp_path: Path) -> None:
    tok = tiny.tokenizer()
    path = tiny.write_jsonl(tmp_path / "d.jsonl", n=40)
    config = tiny.trainer_config(DatasetSource(name=str(path)), tmp_path / "out", 64)
    whole = prepare.find_or_prepare(config, tok)
    expected = [row["input_ids"].tolist() for row in whole.rows()]
    (whole.directory / prepared.COMPLETE).unlink()  # as if the pod died before the marker
    (whole.directory / "train" / "tokens.bin").write_bytes(b"\0" * 8)  # and with a torn file
    redone = prepare.find_or_prepare(config, tok)
    assert not redone.reused and (redone.directory / prepared.COMPLETE).exists()
    assert [row["input_ids"].tolist() for row in redone.rows()] == expected


def test_a_bucket_output_gets_the_set_marker_last_and_hosts_read_a_local_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    monkeypatch.setenv("TPUFT_CACHE_DIR", str(tmp_path / "cache"))
    tok = tiny.tokenizer()
    path = tiny.write_jsonl(tmp_path / "d.jsonl", n=40)
    config = tiny.trainer_config(DatasetSource(name=str(path), packing=True), "memory://bucket/run", 64)
    made = prepare.find_or_prepare(config, tok)
    key = made.manifest.fingerprint
    fs = fsspec.filesystem("memory")
    assert fs.exists(f"/bucket/run/prepared/{key}/.tpuft-complete")
    assert fs.exists(f"/bucket/run/prepared/{key}/train/row_starts.bin")
    # Another host (an empty cache) finds it at the output and reads it from a local copy.
    monkeypatch.setenv("TPUFT_CACHE_DIR", str(tmp_path / "other-host"))
    read = prepare.find_or_prepare(config, tok)
    assert read.reused and str(read.directory).startswith(str(tmp_path / "other-host"))
    assert [r["input_ids"].tolist() for r in read.rows()] == [r["input_ids"].tolist() for r in made.rows()]
    fs.rm("/bucket", recursive=True)


# ---- tpuft prepare ---------------------------------------------------------------------------------
def run_prepare(
    tmp_path: Path, training: dict[str, Any] | None = None, **dataset: Any
) -> tuple[int, dict[str, Any], str]:
    from tpuft_trainer.cli import prepare as prepare_command
    from tpuft_trainer.config import ModelSource

    model = (
        tiny.save_model_dir(tmp_path / "model") if not (tmp_path / "model").exists() else tmp_path / "model"
    )
    config = tiny.trainer_config(
        DatasetSource(**dataset), tmp_path / "out", 64, **(training or {})
    ).model_copy(update={"model": ModelSource(name=str(model))})
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    summary = tmp_path / "termination-log"
    result = CliRunner().invoke(
        prepare_command,
        ["--config", str(tmp_path / "config.yaml"), "--workers", "1", "--summary-file", str(summary)],
    )
    return result.exit_code, json.loads(summary.read_text()), result.output


def test_tpuft_prepare_reports_its_figures_and_errors_with_their_exit_codes(tmp_path: Path) -> None:
    from tpuft_trainer.prepare_contract import PrepareSummary, parse_error

    path = str(tiny.write_jsonl(tmp_path / "d.jsonl", n=40))
    code, body, _ = run_prepare(tmp_path, name=path, packing=True, eval_fraction=0.25)
    summary = PrepareSummary.from_message(json.dumps(body))
    assert code == 0 and summary is not None, body
    assert (summary.documents, summary.dropped, summary.eval_rows, summary.reused) == (30, 0, 10, False)
    assert summary.positions == summary.rows * 64 and 0 < summary.loss_tokens < summary.positions
    assert summary.tokens_per_second > 0
    # The model's dimensions for the operator's plan: its config's, and its parameters counted from
    # the safetensors header (the weights unread), which is the model's own count.
    figures = summary.model
    assert figures is not None, body
    layout = (figures.hidden_size, figures.num_layers, figures.intermediate_size, figures.num_heads)
    assert (*layout, figures.num_kv_heads, figures.vocab_size) == (64, 2, 128, 4, 2, tiny.VOCAB_SIZE)
    assert figures.params == tiny.model().num_parameters()
    code, body, _ = run_prepare(tmp_path, name=path, packing=True, eval_fraction=0.25)
    assert code == 0 and body["reused"] is True and body["seconds"] == 0
    assert body["model"]["params"] == figures.params  # reused data, the model checked all the same
    # A user error: exit 65 (the run fails, no TPU), the message naming the field to set.
    code, body, _ = run_prepare(tmp_path, name=path, text_field="body")
    error = parse_error(json.dumps(body))
    assert code == 65 and error is not None and error[1] == 65 and "dataset.textField" in error[0]
    code, body, _ = run_prepare(tmp_path, name=str(tmp_path / "absent.jsonl"))
    assert code == 66 and "does not exist" in body["error"]
    for weights in (tmp_path / "model").glob("*.safetensors"):
        weights.unlink()
    code, body, _ = run_prepare(tmp_path, name=path)
    assert code == 66 and "has no weight files" in body["error"], body


def test_a_bucket_models_parameters_are_counted_from_its_headers_and_never_fail_the_check(
    tmp_path: Path,
) -> None:
    import fsspec

    from tpuft_trainer.config import ModelSource

    local = tiny.save_model_dir(tmp_path / "model")
    fs = fsspec.filesystem("memory")
    fs.put(str(local) + "/", "/models/tiny/", recursive=True)
    weights = sources.weight_files(ModelSource(name="memory://models/tiny"), "")
    assert weights == ["model.safetensors"]
    source = ModelSource(name="memory://models/tiny")
    assert sources.parameter_count(source, "", weights) == tiny.model().num_parameters()
    # Not a safetensors header: no count (the plan computes it from config.json), not an error.
    fs.pipe("/models/tiny/model.safetensors", b"\xff" * 64)
    assert sources.parameter_count(source, "", weights) is None
    assert sources.parameter_count(source, "", ["pytorch_model.bin"]) is None
    fs.rm("/models", recursive=True)
    # A config without a decoder-only transformer's dimensions: no figures (the operator then has no
    # verdict to recompute), not a failure of the pre-flight.
    from tpuft_trainer.data import preflight

    assert preflight.model_figures("t5", {"d_model": 512, "num_layers": 6}, None) is None


def test_the_output_must_be_writable_before_any_tpu_is_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    from tpuft_trainer.data import preflight

    class ReadOnly(MemoryFileSystem):
        protocol = "readonly"

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            if "w" in mode:
                raise PermissionError(13, "Permission denied", path)
            return super()._open(path, mode, **kwargs)

    import fsspec

    fsspec.register_implementation("readonly", ReadOnly, clobber=True)
    with pytest.raises(PermissionDeniedError, match="readonly://bucket/run is not writable"):
        preflight.check_output_writable("readonly://bucket/run")
    preflight.check_output_writable("memory://bucket/writable")  # a writable one passes


def test_an_evaluation_split_without_rows_to_evaluate_is_a_data_error(tmp_path: Path) -> None:
    import datasets

    tok = tiny.tokenizer()
    directory = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": tiny.texts(8)}),
            "test": datasets.Dataset.from_dict({"text": ["", ""]}),  # nothing to predict in either
        }
    ).save_to_disk(str(directory))
    source = DatasetSource(name=str(directory), eval_split="test")
    with pytest.raises(DataError, match=r"evaluation set .* none of its 2 rows has a token to learn"):
        prepare.find_or_prepare(tiny.trainer_config(source, tmp_path / "out", 32), tok)
    assert not any((tmp_path / "out" / "prepared").glob(f"*/{prepared.COMPLETE}"))  # nothing published
    with pytest.raises(NotFoundError):
        prepare.find_or_prepare(
            tiny.trainer_config(DatasetSource(name=str(tmp_path / "none.jsonl")), tmp_path / "out", 32), tok
        )


# ---- preference pairs (objective dpo) ---------------------------------------------------------------
PAIR_LENGTH = 40  # short enough that some prompts fill it (dropped) and some completions pass it (cut)
# A template whose generation prompt ends otherwise than the rendered assistant turn begins: the
# tokenised prompt is not a prefix of prompt + completion (as Gemma's), so the completion starts earlier.
MOVED_BOUNDARY_TEMPLATE = tiny.CHAT_TEMPLATE.replace(
    "<s>assistant: {% endif %}", "<s>assistant:\n{% endif %}"
)


def preference_rows(chat: bool) -> list[dict[str, Any]]:
    """tiny's pairs and the edges: a prompt that fills PAIR_LENGTH alone, a completion longer than it,
    a plain completion that ends with EOS already, a multi-turn chat prompt."""
    rows = tiny.preference_pairs(48, chat=chat)
    long_prompt, long_answer = "why " * 12, "because " * 8
    if chat:
        user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
        said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
        rows += [
            {"prompt": user(long_prompt), "chosen": said("yes"), "rejected": said("no")},
            {"prompt": user("q?"), "chosen": said(long_answer), "rejected": said("no")},
            {
                "prompt": [{"role": "system", "content": "be"}, *user("a"), *said("b"), *user("c?")],
                "chosen": said("yes"),
                "rejected": said("no"),
            },
        ]
    else:
        rows += [
            {"prompt": long_prompt, "chosen": "yes", "rejected": "no"},
            {"prompt": "q? ", "chosen": long_answer, "rejected": "no"},
            {"prompt": "q? ", "chosen": "yes</s>", "rejected": "no"},
        ]
    return rows


def trl_pairs(rows: Any, tok: Any, config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """trl 1.16's own tokenisation of ``rows``: DPOTrainer._prepare_dataset with tpuft's DPOConfig."""
    import contextlib
    import tempfile
    from types import SimpleNamespace

    import trl.trainer.dpo_trainer
    from trl import DPOConfig, DPOTrainer

    from tpuft_trainer import dpo

    # One process: its "main process first" ordering would start accelerate's state (and with it the
    # XLA runtime in this test process) for nothing.
    monkeypatch.setattr(trl.trainer.dpo_trainer, "global_then_local_main_first", contextlib.nullcontext)
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], **dpo.arguments(config))
    return DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), rows, tok, args, "train")


@pytest.mark.parametrize("kind", ["plain", "chat", "chat, prompt not a prefix"])
def test_prepared_pairs_equal_trls_own_tokenisation(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tpuft_trainer.data import preference

    tok = tiny.tokenizer()
    if "prefix" in kind:
        tok.chat_template = MOVED_BOUNDARY_TEMPLATE
    path = tiny.write_rows(tmp_path / "pairs.jsonl", preference_rows(chat=kind != "plain"))
    source = DatasetSource(name=str(path), format="preference", eval_fraction=0.25)
    monkeypatch.setattr(prepare, "CHUNK_ROWS", 16)  # several chunks, so the pool's order matters
    train_rows, eval_rows = prepare.split_rows(data.load_rows(source), source, seed=42)
    for workers in (1, 2) if kind == "chat" else (1,):  # (a pool of workers costs seconds to start)
        config = tiny.trainer_config(source, tmp_path / f"out-{workers}", PAIR_LENGTH, objective="dpo")
        ready = prepare.find_or_prepare(config, tok, workers=workers)
        assert ready.manifest.pairs and not ready.reused
        for split, rows in (("train", train_rows), ("eval", eval_rows)):
            theirs = trl_pairs(rows, tok, config, monkeypatch)
            ours = ready.pairs(split)
            assert ours.column_names == list(preference.ID_COLUMNS)
            assert ours.to_dict() == theirs.select_columns(list(preference.ID_COLUMNS)).to_dict(), (
                kind,
                split,
            )
            figures = ready.manifest.splits[split]
            cut = sum(
                len(p) + max(len(c), len(r)) > PAIR_LENGTH
                for p, c, r in zip(
                    theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"], strict=True
                )
            )
            assert (figures.documents, figures.rows, figures.truncated) == (len(rows), len(theirs), cut)
        splits = ready.manifest.splits.values()
        assert sum(f.dropped for f in splits) and sum(f.truncated for f in splits), splits  # the edges
        train = ready.manifest.splits["train"]
        assert ready.manifest.positions() == 2 * train.rows * PAIR_LENGTH
    if "prefix" in kind:  # the boundary moved: the prompt's last token ("\n") is left out, as trl does
        assert all(ids[-1] != tok.convert_tokens_to_ids("\n") for ids in ready.pairs("train")["prompt_ids"])


def test_prepared_pairs_are_read_without_copying_them(tmp_path: Path) -> None:
    """The Dataset DPOTrainer gets is Arrow laid over the memory-mapped files: its ids are the files'
    pages (a rewritten file shows through), not a copy held in the process."""
    import numpy as np

    path = tiny.write_rows(tmp_path / "pairs.jsonl", tiny.preference_pairs(16))
    config = tiny.trainer_config(
        DatasetSource(name=str(path), format="preference"), tmp_path / "out", 64, objective="dpo"
    )
    ready = prepare.find_or_prepare(config, tiny.tokenizer())
    pairs = ready.pairs()
    first = pairs[0]["chosen_ids"]
    ids = np.memmap(ready.directory / "train" / "chosen_ids.bin", dtype="<i4", mode="r+")
    ids[0] = 99
    ids.flush()
    assert pairs[0]["chosen_ids"] == [99, *first[1:]]
    with pytest.raises(
        DataError, match=r"has 16 preference pairs whose prompt fits .* fewer than one global batch \(17\)"
    ):
        ready.check_fills_a_batch(17, "pairs.jsonl")


def test_tpuft_prepare_prepares_the_pairs_of_a_dpo_run(tmp_path: Path) -> None:
    """The operator's prepare Job runs for DPO runs too: their pairs are prepared and reported."""
    from tpuft_trainer.prepare_contract import PrepareSummary

    path = str(tiny.write_rows(tmp_path / "pairs.jsonl", tiny.preference_pairs(40, chat=True)))
    dpo = {"objective": "dpo"}
    code, body, output = run_prepare(tmp_path, dpo, name=path, format="preference", eval_fraction=0.25)
    summary = PrepareSummary.from_message(json.dumps(body))
    assert code == 0 and summary is not None, (body, output)
    assert (summary.documents, summary.dropped, summary.rows, summary.eval_rows) == (30, 0, 30, 10)
    assert summary.positions == 2 * 30 * 64 and 0 < summary.loss_tokens < summary.positions
    code, body, _ = run_prepare(tmp_path, dpo, name=path, format="preference", eval_fraction=0.25)
    assert code == 0 and body["reused"] is True
    code, body, _ = run_prepare(tmp_path, dpo, name=path, format="preference", rejected_field="worse")
    assert code == 65 and "Set dataset.rejectedField" in body["error"], body
