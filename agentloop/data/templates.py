"""Prompt formats of the projects our recipes come from, verbatim: they are data formats users must match.

    GSM8K_INSTRUCTION            verl's examples/data_preprocess/gsm8k.py suffix (question + " " + it)
    COUNTDOWN_TEMPLATES          TinyZero's countdown prompts: "base" (for base models, raw text) and
                                 "qwen-instruct" (carries its own ChatML markup); both end in "<think>"
    SEARCH_R1_TEMPLATE           Search-R1's instruction + "Question: {question}\\n"

TinyZero does not apply a chat template to its prompts (they carry their own markup): prepare those rows
with `data.apply_chat_template=false`. Search-R1 applies the tokenizer's chat template when there is one.
"""

from __future__ import annotations

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

_COUNTDOWN_TASK = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")

COUNTDOWN_TEMPLATES: dict[str, str] = {
    "base": (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
        "The assistant first thinks about the reasoning process in the mind and then provides the user with "
        "the answer.\nUser: " + _COUNTDOWN_TASK + "\nAssistant: Let me solve this step by step.\n<think>"),
    "qwen-instruct": (
        "<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process in the "
        "mind and then provides the user with the answer.<|im_end|>\n<|im_start|>user\n " + _COUNTDOWN_TASK
        + "<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"),
}

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n")


def countdown_prompt(numbers: list[int], target: int, template: str = "base") -> str:
    """TinyZero's prompt for one puzzle (`numbers` shown as a Python list, e.g. [44, 19, 35])."""
    try:
        fmt = COUNTDOWN_TEMPLATES[template]
    except KeyError:
        raise ValueError(f"countdown template must be one of {sorted(COUNTDOWN_TEMPLATES)}, got {template!r}") from None
    return fmt.format(numbers=list(numbers), target=target)


def search_r1_prompt(question: str) -> str:
    """Search-R1's prompt: the question stripped, with a "?" added when it has none."""
    q = question.strip()
    if q and q[-1] != "?":
        q += "?"
    return SEARCH_R1_TEMPLATE.format(question=q)
