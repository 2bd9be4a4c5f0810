"""The one owner of a run's data, as checkpoint/ owns saving: sources, chat rendering and assistant
masks, tokenising on every core, packing on arrays, evaluation rows, and the prepared format that
``tpuft prepare`` writes and every host of either training backend reads memory-mapped.

- ``sources``: where models, tokenizers and datasets come from (hub, local, any fsspec URI);
- ``chat``: a conversation -> its rendering and which tokens are the assistant's;
- ``encode``: a chunk of rows -> documents (token ids and loss masks as flat arrays);
- ``packing``: documents -> rows (best-fit on arrays; rows built as they are read);
- ``prepared``: the files on storage: fingerprint, manifest, marker last, the memory-mapped reader;
- ``prepare``: the pipeline: find a prepared set or make one, with a pool of workers;
- ``preflight``: what ``tpuft prepare`` checks before any TPU is requested.

Light at import: numpy, transformers and datasets are imported where they are used. The names below
are the sources' functions, which the rest of the trainer calls as ``data.<name>``.
"""

from tpuft_trainer.data.sources import (
    cache_dir,
    hub_errors,
    is_uri,
    load_model,
    load_rows,
    load_tokenizer,
    looks_local,
    model_location,
    token,
    weight_files,
)

__all__ = [
    "cache_dir",
    "hub_errors",
    "is_uri",
    "load_model",
    "load_rows",
    "load_tokenizer",
    "looks_local",
    "model_location",
    "token",
    "weight_files",
]
