"""Data: verl-format rows from JSONL/Parquet files or built-in sets, as `Sample`s.

`load_samples(cfg.data)` is the entry point. To add a built-in set, write a function
returning verl rows and call `register_dataset("name", fn)`; select it with
`data.builtin=name`.

May import: the vocabulary and util only.
"""

from agentloop.data import (
    tasks,  # noqa: F401 - registers the calculator sets
    tool_demos,  # noqa: F401 - registers the code and search_qa sets
)
from agentloop.data.builtin import (
    builtin_rows,
    get_dataset,
    list_datasets,
    register_dataset,
)
from agentloop.data.loader import (
    load_file,
    load_samples,
    parse_row,
    rows_to_samples,
    sample_to_row,
    to_plain,
    write_jsonl,
)

__all__ = [
    "builtin_rows",
    "get_dataset",
    "list_datasets",
    "load_file",
    "load_samples",
    "parse_row",
    "register_dataset",
    "rows_to_samples",
    "sample_to_row",
    "to_plain",
    "write_jsonl",
]
