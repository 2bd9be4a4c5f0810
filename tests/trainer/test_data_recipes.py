"""The data side of the recipes, on the CPU without XLA: assistant-only labels, packing, evaluation rows,
and that every model family packing accepts really isolates documents."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import tiny

from tpuft_trainer import data
from tpuft_trainer.config import DatasetSource
from tpuft_trainer.data import chat, packing, prepare
from tpuft_trainer.errors import DataError

pytestmark = pytest.mark.trainer

SEQ = 160


def chat_source(tmp_path: Path, **fields: Any) -> DatasetSource:
    path = tiny.write_rows(tmp_path / "chats.jsonl", tiny.long_question_chats(32))
    return DatasetSource(name=str(path), format="chat", **fields)


def prepared(source: DatasetSource, tok: Any, seq: int, output: Path) -> Any:
    return prepare.find_or_prepare(tiny.trainer_config(source, output, seq), tok)


def loss_share(ready: Any) -> float:
    return float(ready.manifest.splits["train"].loss_tokens / ready.manifest.positions())


def test_assistant_only_loss_labels_exactly_the_answers(tmp_path: Path) -> None:
    tok = tiny.tokenizer()
    everything = chat_source(tmp_path, assistant_only_loss=False)
    before = loss_share(prepared(everything, tok, SEQ, tmp_path / "out"))
    answers_only = chat_source(tmp_path)  # the default for chat
    ready = prepared(answers_only, tok, SEQ, tmp_path / "out")
    after = loss_share(ready)
    # long questions, one-word answers: ~61% of the positions carried loss, now a few percent
    assert 0.55 < before < 0.68, before
    assert 0.01 < after < 0.05, after
    for row, chat_row in zip(ready.rows(), tiny.long_question_chats(32), strict=True):
        labels, ids = row["labels"].tolist(), row["input_ids"].tolist()
        labelled = [t for t in labels if t != -100]
        answer = chat_row["messages"][1]["content"]
        assert "".join(tok.convert_ids_to_tokens(labelled)) == answer + "</s>"
        # and they sit where those tokens are in the row
        first = labels.index(labelled[0])
        assert ids[first : first + len(labelled)] == labelled


def test_generation_markers_and_the_prefix_fallback_agree() -> None:
    plain, marked = tiny.tokenizer(), tiny.tokenizer()
    marked.chat_template = tiny.CHAT_TEMPLATE_WITH_MARKERS
    assert not chat.has_generation_markers(plain) and chat.has_generation_markers(marked)
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one two three?"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and four?"},
        {"role": "assistant", "content": "no"},
    ]
    got = chat.encode(plain, conversation, assistant_only=True, dataset="d")
    assert got == chat.encode(marked, conversation, assistant_only=True, dataset="d")
    ids, mask = got
    spoken = "".join(t for t, m in zip(plain.convert_ids_to_tokens(ids), mask, strict=True) if m)
    assert spoken == "yes</s>no</s>"


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    tok = tiny.tokenizer()
    # counts the messages up front: every prefix renders a different first line
    tok.chat_template = "{{ messages | length }}\n" + tiny.CHAT_TEMPLATE
    conversation = tiny.long_question_chats(1)[0]["messages"]
    with pytest.raises(DataError, match=r"not prefix-stable.*assistantOnlyLoss: false"):
        chat.encode(tok, conversation, assistant_only=True, dataset="d")
    ids, mask = chat.encode(tok, conversation, assistant_only=False, dataset="d")
    assert sum(mask) == len(ids)


def test_packing_fills_rows_and_keeps_every_loss_token(tmp_path: Path) -> None:
    tok = tiny.tokenizer()
    source = DatasetSource(name=str(tiny.write_jsonl(tmp_path / "t.jsonl", n=64)))
    padded = prepared(source, tok, 256, tmp_path / "out")
    packed = prepared(source.model_copy(update={"packing": True}), tok, 256, tmp_path / "out")
    row = {key: value.tolist() for key, value in packed.rows()[0].items()}
    assert set(row) == {"input_ids", "position_ids", "labels"}  # no attention mask
    assert {len(r["input_ids"]) for r in packed.rows()} == {256}  # type: ignore[attr-defined]
    assert len(packed.rows()) <= len(padded.rows()) / 3  # documents of ~60 tokens, four to a row
    # a document's first token is not a target in either form, so the loss covers the same tokens
    assert packed.manifest.splits["train"].loss_tokens == padded.manifest.splits["train"].loss_tokens
    counted = sum(sum(1 for t in r["labels"][1:] if t != -100) for r in packed.rows())  # type: ignore[attr-defined]
    assert counted == packed.manifest.splits["train"].loss_tokens
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    assert len(starts) > 2 and all(row["labels"][i] == -100 for i in starts)
    assert all(
        b - a == 1 or b == 0 for a, b in zip(row["position_ids"], row["position_ids"][1:], strict=False)
    )


def test_best_fit_never_overfills_places_everything_and_matches_the_list_version() -> None:
    import random

    import numpy as np
    from bench import legacy_data

    rng = random.Random(3)
    lengths = [rng.randint(1, 50) for _ in range(500)]
    members, starts = packing.best_fit(np.asarray(lengths), 64)
    bins = [members[a:b].tolist() for a, b in itertools.pairwise(starts)]
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert max(sum(lengths[i] for i in b) for b in bins) <= 64
    assert sum(lengths) / (64 * len(bins)) > 0.9
    assert bins == legacy_data.best_fit(lengths, 64)  # the same rows as the trainer made before


def test_eval_fraction_is_held_out_by_seed(tmp_path: Path) -> None:
    source = DatasetSource(name=str(tiny.write_jsonl(tmp_path / "t.jsonl", n=50)), eval_fraction=0.2)
    rows = data.load_rows(source)
    train, held = prepare.split_rows(rows, source, seed=7)
    again = prepare.split_rows(rows, source, seed=7)[1]
    assert (len(train), len(held)) == (40, 10) and held["text"] == again["text"]
    assert not set(held["text"]) & set(train["text"]) or len(set(tiny.texts(50))) < 50
    assert prepare.split_rows(rows, source, seed=8)[1]["text"] != held["text"]


def test_eval_split_of_the_same_source(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    path = tmp_path / "dict"
    DatasetDict(
        {
            "train": Dataset.from_dict({"text": tiny.texts(8)}),
            "validation": Dataset.from_dict({"text": ["x."]}),
        }
    ).save_to_disk(str(path))
    source = DatasetSource(name=str(path), eval_split="validation")
    train, held = prepare.split_rows(data.load_rows(source), source, seed=0)
    assert (len(train), held["text"]) == (8, ["x."])
    with pytest.raises(DataError, match=r"[Ss]plit.*test"):
        prepare.split_rows(data.load_rows(source), source.model_copy(update={"eval_split": "test"}), seed=0)
    single = DatasetSource(name=str(tiny.write_jsonl(tmp_path / "t.jsonl", n=8)), eval_split="validation")
    with pytest.raises(DataError, match="a single file: it has one split"):
        prepare.split_rows(data.load_rows(single), single, seed=0)


def _tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=tiny.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=8,  # shorter than a row: the sliding-window masks see packing too
        pad_token_id=0,
        use_cache=False,
    )


@pytest.mark.parametrize("model_type", sorted(packing.PACKING_MODEL_TYPES))
def test_every_family_packing_accepts_isolates_documents(model_type: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(model_type)).eval()
    assert packing.packing_refusal(model) is None
    lengths = (7, 12, 5)
    docs = [torch.randint(4, tiny.VOCAB_SIZE, (n,)) for n in lengths]
    ids = torch.cat([*docs, torch.zeros(32 - sum(lengths), dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(n) for n in (*lengths, 32 - sum(lengths))])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=doc[None]).logits[0]
            assert torch.allclose(packed[start : start + len(doc)], alone, atol=1e-5), model_type
            start += len(doc)
        leaky = model(input_ids=ids).logits[0]  # the same row as one sequence: later documents differ
    assert not torch.allclose(
        leaky[lengths[0] : lengths[0] + lengths[1]], packed[lengths[0] : lengths[0] + lengths[1]]
    )


def test_packing_refuses_an_unverified_family() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    refusal = packing.packing_refusal(model)
    assert refusal is not None and "'gpt2' is not one of them" in refusal and "packing: false" in refusal


def test_recipe_arguments_are_transformers_own() -> None:
    from transformers import TrainingArguments

    from tpuft_trainer import recipe
    from tpuft_trainer.config import TrainingConfig

    training = TrainingConfig(max_steps=100, lr_scheduler="constant", warmup_ratio=0.1, eval_steps=25)
    arguments = recipe.training_arguments(training, global_batch=32, evaluates=True)
    args = TrainingArguments(output_dir="/tmp/unused", **arguments)
    assert args.lr_scheduler_type.value == "constant_with_warmup" and args.get_warmup_steps(100) == 10
    assert (args.eval_strategy.value, args.eval_steps, args.per_device_eval_batch_size) == ("steps", 25, 32)
    assert args.prediction_loss_only
    assert recipe.training_arguments(training, global_batch=32, evaluates=False).get("eval_strategy") is None
    assert recipe.needs_final_evaluation(25, 90) and not recipe.needs_final_evaluation(25, 100)
    assert recipe.needs_final_evaluation(None, 100)


def test_model_flops_count_weights_not_the_lookup() -> None:
    from tpuft_trainer.throughput import mfu, model_flops

    model = tiny.model("llama")
    flops = model_flops(model)
    embedding = tiny.VOCAB_SIZE * 64
    assert flops.trainable_matmul_params == sum(p.numel() for p in model.parameters()) - embedding
    assert flops.per_token(32) == 6 * flops.trainable_matmul_params + 12 * 2 * 64 * 32
    assert mfu(1000.0, 2e9, chips=4, peak_per_chip=1e12) == 0.5
    assert mfu(None, 2e9, chips=4, peak_per_chip=1e12) is None and mfu(1.0, 1.0, 4, None) is None


def test_rows_without_a_target_are_dropped_and_none_is_an_error(tmp_path: Path) -> None:
    tok = tiny.tokenizer()
    source = chat_source(tmp_path)
    # 40 positions: every question is longer, so no assistant token is left in any row
    with pytest.raises(DataError, match=r"none of its 32 rows has a token to learn within 40.*maxSeqLength"):
        prepared(source, tok, 40, tmp_path / "out")
    mixed = tiny.long_question_chats(16) + tiny.long_question_chats(16, question_words=2)
    path = tiny.write_rows(tmp_path / "mixed.jsonl", mixed)
    kept = prepared(DatasetSource(name=str(path), format="chat"), tok, 60, tmp_path / "out")
    assert len(kept.rows()) == 16  # only the short questions leave room for their answers
    assert (kept.manifest.splits["train"].documents, kept.manifest.splits["train"].dropped) == (32, 16)
