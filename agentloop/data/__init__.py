"""Data: verl-format rows from JSONL/Parquet files or built-in sets, as `Sample`s.

`load_samples(cfg.data)` is the entry point (`load_train_data(cfg.data)` for training: training rows plus
validation rows from a file, a built-in set or a slice held out of the training rows). To add a built-in
set, write a function returning verl rows and call `register_dataset("name", fn)`; select it with
`data.builtin=name`.

    loader.py      verl rows from JSONL/Parquet -> Samples (and back)
    builtin.py     the built-in set registry and the arithmetic / countdown / gsm8k_mini sets
    tasks.py       the calculator task; tool_demos.py the code, code_stdio and search_qa sets
    templates.py   verl's / TinyZero's / Search-R1's prompt formats, verbatim
    prepare.py     `agentloop data prepare`: the data sets' own files -> verl rows, per recipe
    check.py       `agentloop data check`: what is wrong with a verl file, row by row

May import: the vocabulary and util; check.py also reads the reward and tool registries (lower layers).
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
from agentloop.data.check import (
    CheckReport,
    Problem,
    check_file,
    check_rows,
    format_report,
)
from agentloop.data.loader import (
    TrainData,
    load_file,
    load_samples,
    load_train_data,
    parse_row,
    rows_to_samples,
    sample_to_row,
    to_plain,
    write_jsonl,
)
from agentloop.data.prepare import (
    PREPARERS,
    generate_countdown,
    prepare,
    read_rows,
    write_rows,
)

__all__ = [
    "PREPARERS",
    "CheckReport",
    "Problem",
    "TrainData",
    "builtin_rows",
    "check_file",
    "check_rows",
    "format_report",
    "generate_countdown",
    "get_dataset",
    "list_datasets",
    "load_file",
    "load_samples",
    "load_train_data",
    "parse_row",
    "prepare",
    "read_rows",
    "register_dataset",
    "rows_to_samples",
    "sample_to_row",
    "to_plain",
    "write_jsonl",
    "write_rows",
]
