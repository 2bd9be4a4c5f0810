"""Tiny models, tokenizers and datasets built locally (nothing is downloaded)."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

VOCAB_SIZE = 128
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tokenizer() -> Any:
    """A character-level fast tokenizer (WordLevel over single characters)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    assert len(vocab) <= VOCAB_SIZE
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model(family: str = "llama", *, seed: int = 0, dtype: str = "float32") -> Any:
    import torch
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        use_cache=False,
    )
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    }
    config_name, model_name, extra = configs[family]
    config = getattr(transformers, config_name)(**common, **extra)
    torch.manual_seed(seed)
    built = getattr(transformers, model_name)(config)
    return built.to(getattr(torch, dtype))


def save_model_dir(path: Path, family: str = "llama", dtype: str = "float32") -> Path:
    model(family, dtype=dtype).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "one", "two", "three"]


def texts(n: int = 64, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(n)]


def write_jsonl(path: Path, n: int = 64, *, chat: bool = False, field: str = "text") -> Path:
    with path.open("w") as out:
        for text in texts(n):
            if chat:
                row: dict[str, Any] = {
                    "messages": [
                        {"role": "user", "content": text[:20]},
                        {"role": "assistant", "content": text},
                    ]
                }
            else:
                row = {field: text}
            out.write(json.dumps(row) + "\n")
    return path


def text_dataset(n: int = 64) -> Any:
    """A datasets.Dataset with one ``text`` column (what optimum-tpu's tutorials start from)."""
    from datasets import Dataset

    return Dataset.from_dict({"text": texts(n)})


def token_dataset(seq_len: int = 32, n: int = 64) -> Any:
    """A datasets.Dataset of fixed-length input_ids/labels for the stock-Trainer tests."""
    from datasets import Dataset

    tok = tokenizer()
    ids = [tok(t, truncation=True, max_length=seq_len, padding="max_length")["input_ids"] for t in texts(n)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * seq_len] * n})


ANSWERS = ["yes", "no", "blue", "red"]
CHAT_TEMPLATE_WITH_MARKERS = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def long_question_chats(n: int = 64, seed: int = 0, question_words: int = 16) -> list[dict[str, Any]]:
    """Chats with a long user turn and a one-word answer that depends on the question's first word
    (so a model can learn it), like instruction data whose prompts dwarf the answers."""
    import random

    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(question_words)]
        answer = ANSWERS[WORDS.index(words[0]) % len(ANSWERS)]
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(words) + "?"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return chats


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preference_pairs(n: int = 64, seed: int = 0, *, chat: bool = False) -> list[dict[str, Any]]:
    """Made-up preference pairs: a short question, a chosen answer from one half of ANSWERS and a rejected
    one from the other half (of different lengths), so a policy can learn to prefer the chosen kind."""
    import random

    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(3, 6))]
        chosen = rng.choice(ANSWERS[::2]) + rng.choice(["", " " + rng.choice(WORDS)])
        prompt, rejected = " ".join(words) + "? ", rng.choice(ANSWERS[1::2])
        if chat:
            pairs.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def prepared_rows(
    source: Any, tok: Any, max_length: int, output: Path, *, workers: int = 1, split: str = "train"
) -> list[dict[str, list[int]]]:
    """``source`` prepared as the trainer prepares it (data.prepare), its rows as lists of ints."""
    from tpuft_trainer.data import prepare

    ready = prepare.find_or_prepare(trainer_config(source, output, max_length), tok, workers=workers)
    return [{key: value.tolist() for key, value in row.items()} for row in ready.rows(split)]  # type: ignore[attr-defined]


def trainer_config(source: Any, output: Path, max_length: int = 64, **training: Any) -> Any:
    from tpuft_trainer.config import ModelSource, OutputConfig, TrainerConfig, TrainingConfig

    return TrainerConfig(
        model=ModelSource(name="tiny"),
        dataset=source,
        training=TrainingConfig(max_steps=1, max_seq_length=max_length, **training),
        output=OutputConfig(uri=str(output)),
    )
