"""Same data_source, same score: our rewards under verl's / TinyZero's / Search-R1's names against
re-implementations of their documented rules (/work/notes/verl_compat.md §1, §4, §6.5, §6.6), over
thousands of generated answers.

The references below are written literally from the documented rules (and use `eval` exactly where
TinyZero does), in a different shape from the code under test. Each differential test also checks that
our lenient variants (agentloop/gsm8k, agentloop/countdown) disagree on many of the same strings: the
generated answers are hard enough to tell the rule sets apart.
"""

from __future__ import annotations

import random
import re
import string

import pytest

from agentloop.rewards import countdown, get_reward, gsm8k, view_of
from agentloop.rewards.search_r1_qa import SEARCH_R1_SOURCES, VERL_SEARCH_R1_SOURCES

N = 3000

# ---------------------------------------------------------------- references


def ref_verl_gsm8k(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if len(solutions) == 0:
            final_answer = None
        else:
            final_answer = solutions[-1].replace(",", "").replace("$", "")
    else:
        answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = None
        if len(answer) == 0:
            pass
        else:
            invalid_str = ["", "."]
            for final_answer in reversed(answer):
                if final_answer not in invalid_str:
                    break
    if final_answer is None:
        return 0
    return score if final_answer == ground_truth else format_score


def ref_tinyzero_countdown(solution_str, ground_truth, format_score=0.1, score=1.0):
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    if "Assistant:" in solution_str:
        solution_str = solution_str.split("Assistant:", 1)[1]
    elif "<|im_start|>assistant" in solution_str:
        solution_str = solution_str.split("<|im_start|>assistant", 1)[1]
    else:
        solution_str = None
    equation = None
    if solution_str is not None:
        last = solution_str.split("\n")[-1]
        matches = list(re.finditer(r"<answer>(.*?)</answer>", last))
        equation = matches[-1].group(1).strip() if matches else None
    if equation is None:
        return 0
    try:
        valid = sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(numbers)
    except Exception:  # noqa: BLE001 - TinyZero's code as published
        valid = False
    if not valid:
        return format_score
    try:
        if not re.match(r"^[\d+\-*/().\s]+$", equation):
            result = None
        else:
            try:
                result = eval(equation, {"__builtins__": None}, {})
            except Exception:  # noqa: BLE001 - TinyZero's code as published
                result = None
        if result is None:
            return format_score
        return score if abs(result - target) < 1e-5 else format_score
    except Exception:  # noqa: BLE001 - TinyZero's code as published
        return format_score


def _squad(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def ref_search_r1(solution_str, ground_truth):
    matches = list(re.finditer(r"<answer>(.*?)</answer>", solution_str, re.DOTALL))
    if len(matches) <= 1:
        return 0
    answer = matches[-1].group(1).strip()
    golden = ground_truth["target"]
    golden = [golden] if isinstance(golden, str) else golden
    return 1 if any(_squad(g) == _squad(answer) for g in golden) else 0


def ref_verl_search_r1(solution_str, ground_truth):
    matches = list(re.finditer(r"<answer>(.*?)</answer>", solution_str, re.DOTALL))
    if len(matches) < 1:
        return 0
    answer = matches[-1].group(1).strip()
    golden = ground_truth["target"]
    golden = [golden] if isinstance(golden, str) else golden
    if any(_squad(g) == _squad(answer) for g in golden):
        if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:
            return 1.0 / 4
        return 1.0
    return 0.0


# ---------------------------------------------------------------- generated answers

_WORDS = ("she", "buys", "apples", "each", "costs", "so", "total", "left", "per", "week", "then", "half")


def _reasoning(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 12)):
        a, b = rng.randint(1, 400), rng.randint(1, 60)
        parts.append(rng.choice([
            f"{rng.choice(_WORDS)} {a} * {b} = {a * b}.",
            f"<<{a}+{b}={a + b}>>{a + b}",
            f"{a} - {b} = {a - b}",
            f"${a}.{b:02d} {rng.choice(_WORDS)}",
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 9))) + ".",
            f"That is {a:,} in all.",
        ]))
    return rng.choice([" ", "\n"]).join(parts)


def gsm8k_cases(n: int = N, seed: int = 0) -> list[tuple[str, str]]:
    """(answer text, ground truth string) like a model's GSM8K answers: right, wrong and oddly formatted."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        value = rng.choice([rng.randint(0, 120), rng.randint(100, 99999), -rng.randint(1, 50)])
        gt = str(value)
        shown = rng.choice([value, value, value, value + rng.choice([-1, 1, 10])])
        final = rng.choice([
            f"#### {shown}", f"#### {shown}", f"####{shown}", f"#### ${shown}", f"#### {shown}.00",
            f"#### {shown}.", f"#### {shown:,}", f"####  {shown}", f"#### **{shown}**",
            f"The answer is {shown}.", f"\\boxed{{{shown}}}", f"#### {shown} dollars", f"#### {shown}\n",
            f"#### {shown}<|im_end|>", f"**Answer:** {shown}", f"#### {shown}.5",
        ])
        text = _reasoning(rng)
        if rng.random() < 0.15:  # an earlier `####` line, right or wrong
            text = f"#### {rng.choice([value, value + 3])}\n" + text
        if rng.random() < 0.1:
            text += "\n" + "x" * rng.randint(250, 400)  # pushes an early answer out of verl's window
        cases.append((text + rng.choice(["\n", " ", "\n\n"]) + final + rng.choice(["", "", " ", "\nDone."]), gt))
    return cases


BASE_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer.\n"
    "User: Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n<think>")
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n Using the numbers "
               "{numbers}, create an equation that equals {target}. Return it in <answer> </answer> tags."
               "<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>")


def countdown_cases(n: int = N, seed: int = 1) -> list[tuple[str, dict]]:
    """(prompt + response, ground truth) like TinyZero's decoded sequences."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        nums = [rng.randint(1, 99) for _ in range(rng.choice([3, 4]))]
        a, b, c = nums[0], nums[1], nums[2]
        target = a + b * c if rng.random() < 0.5 else a * b - c
        right = f"{a} + {b} * {c}" if target == a + b * c else f"{a} * {b} - {c}"
        extra = nums[3:]
        if extra:
            right = f"({right}) * {extra[0]} / {extra[0]}"
        eq = rng.choice([
            right, right, right, right.replace(" ", ""), f"{right} = {target}", f"{a} + {b} + {c}",
            f"{a} * {b}", f"({right}) / 0", f"{a}.5 + {b} * {c}", f"{a} ** 2 - {b} - {c}", "", "foo",
            f"{a} // {b} + {c}", f"{right}  ", f"{a} x {b} x {c}", f"({a} + {b}) {c}", "()",
            f"{a} + {b} + {c} + {a}",
        ])
        response = " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 20))) + " </think>"
        response += rng.choice([f" <answer>{eq}</answer>", f"\n<answer>{eq}</answer>", f"\n<answer> {eq} </answer>",
                                f"\n<answer>{eq}</answer>\n", f"<answer>{eq}</answer><|endoftext|>",
                                f"<answer>{eq}</answer><|im_end|>\n<|endoftext|>", f"\n<answer>{eq}",
                                f"\n<answer>{a}</answer> <answer>{eq}</answer>", f"\n<answer>\n{eq}</answer>",
                                " the answer is " + eq])
        prompt = rng.choice([BASE_PROMPT, CHAT_PROMPT, ""]).format(numbers=nums, target=target)
        cases.append((prompt + response, {"target": target, "numbers": nums}))
    return cases


SEARCH_R1_PROMPT = (
    "<|im_start|>user\nAnswer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, you can call a "
    "search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. If you find no further "
    "external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without "
    "detailed illustrations. For example, <answer> Beijing </answer>. Question: {q}\n<|im_end|>\n"
    "<|im_start|>assistant\n")


def qa_cases(n: int = N, seed: int = 2) -> list[tuple[str, str, dict]]:
    """(response, prompt + response, ground truth) of Search-R1-style episodes."""
    rng = random.Random(seed)
    golds = [["Paris"], ["The Beatles", "Beatles"], ["1989"], ["Neil Armstrong"], ["beijing"], ["H2O"], ["an apple"]]
    cases = []
    for _ in range(n):
        gold = rng.choice(golds)
        pred = rng.choice([gold[0], gold[-1].upper(), f"the {gold[0]}", f"{gold[0]}.", "Lyon", "", "Beijing",
                           f" {gold[0]} , ", f"{gold[0]} (city)"])
        body = rng.choice(["<think> ok </think>", "<search> q </search>\n\n<information>Doc 1</information>\n\n"])
        tail = rng.choice([f"<answer>{pred}</answer>", f"<answer>{pred}</answer><|im_end|>", "no answer<|im_end|>",
                           f"<answer>x</answer><answer>{pred}</answer>", f"<answer>\n{pred}\n</answer>",
                           f"<answer>{pred}</answer>" * rng.choice([11, 12])])
        response = body + tail
        cases.append((response, SEARCH_R1_PROMPT.format(q="Where?") + response, {"target": gold}))
    return cases


# ---------------------------------------------------------------- the differential tests


def test_openai_gsm8k_scores_as_verl():
    fn = get_reward("openai/gsm8k")
    assert view_of(fn) == "response"
    cases = gsm8k_cases()
    ours = [fn("openai/gsm8k", s, gt) for s, gt in cases]
    theirs = [float(ref_verl_gsm8k(s, gt)) for s, gt in cases]
    diff = [(c, a, b) for c, a, b in zip(cases, ours, theirs) if a != b]
    assert not diff, f"{len(diff)} of {len(cases)} differ from verl, e.g. {diff[:3]}"
    assert 0.15 < sum(theirs) / len(theirs) < 0.85  # both outcomes are common
    # the lenient reading (what openai/gsm8k used to be) differs on many of the same strings
    lenient = [gsm8k.compute_score("openai/gsm8k", s, gt) for s, gt in cases]
    assert sum(a != b for a, b in zip(lenient, theirs)) > len(cases) // 10


def test_verl_gsm8k_flexible_matches_reference():
    from agentloop.rewards.verl_gsm8k import verl_gsm8k_score

    cases = gsm8k_cases(seed=5) + [("....", "1"), ("no digits", "1"), ("1,000.", "1,000.")]
    for s, gt in cases:
        assert verl_gsm8k_score(s, gt, method="flexible") == ref_verl_gsm8k(s, gt, method="flexible"), s


def test_countdown_scores_as_tinyzero():
    fn = get_reward("countdown")
    assert view_of(fn) == "prompt_response"
    cases = countdown_cases()
    ours = [fn("countdown", s, gt) for s, gt in cases]
    theirs = [float(ref_tinyzero_countdown(s, gt)) for s, gt in cases]
    diff = [(c, a, b) for c, a, b in zip(cases, ours, theirs) if a != b]
    assert not diff, f"{len(diff)} of {len(cases)} differ from TinyZero, e.g. {diff[:3]}"
    assert {0.0, 0.1, 1.0} <= set(theirs)
    lenient = [countdown.compute_score("countdown", s, gt) for s, gt in cases]
    assert sum(a != b for a, b in zip(lenient, theirs)) > len(cases) // 10


@pytest.mark.parametrize("source", SEARCH_R1_SOURCES + VERL_SEARCH_R1_SOURCES)
def test_search_r1_names_score_as_their_projects(source):
    fn = get_reward(source)
    verl = source.startswith("searchR1_")
    assert view_of(fn) == ("response" if verl else "prompt_response")
    cases = qa_cases(n=600)
    for response, full, gt in cases:
        if verl:
            assert fn(source, response, gt) == float(ref_verl_search_r1(response, gt)), response
        else:
            assert fn(source, full, gt) == float(ref_search_r1(full, gt)), full


def test_tinyzero_rules_on_hand_picked_answers():
    fn = get_reward("countdown")
    gt = {"target": 24, "numbers": [2, 3, 4]}
    p = "User: ...\nAssistant: Let me solve this step by step.\n<think>"
    assert fn("countdown", p + " </think> <answer>2*3*4</answer>", gt) == 1.0
    assert fn("countdown", p + " </think> <answer>2*3*4 = 24</answer>", gt) == 0.1  # 24 counts as a number
    assert fn("countdown", p + " </think> <answer>2*3*4</answer>\n", gt) == 0.0  # not on the last line
    assert fn("countdown", " </think> <answer>2*3*4</answer>", gt) == 0.0  # no "Assistant:" in the text
    assert fn("countdown", p + "<answer></answer>", gt) == 0.1  # any extracted answer: format score
    assert fn("countdown", p + "<answer>2**3*4 - 2*3*4</answer>", gt) == 0.1  # 4 used twice
    assert fn("countdown", p + "<answer>(4 - 2) ** 3 * 3</answer>", {"target": 24, "numbers": [2, 3, 3, 4]}) == 1.0
    assert fn("countdown", p + "<answer>4 / (3 - 3) + 2</answer>", {"target": 1, "numbers": [2, 3, 3, 4]}) == 0.1


def test_verl_math_rules_on_hand_picked_answers():
    fn = get_reward("lighteval/MATH")
    assert fn("lighteval/MATH", r"so \boxed{\dfrac{1}{2}}", r"\frac12") == 1.0
    assert fn("lighteval/MATH", r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert fn("lighteval/MATH", r"\boxed{3/4}", r"\frac{3}{4}") == 1.0
    assert fn("lighteval/MATH", r"\boxed{x = 5}", "5") == 1.0
    assert fn("lighteval/MATH", r"\boxed{10\text{ cm}}", "10") == 1.0
    assert fn("lighteval/MATH", r"\boxed{10.0}", "10") == 0.0  # no numeric comparison (ours says 1.0)
    assert get_reward("agentloop/math")("agentloop/math", r"\boxed{10.0}", "10") == 1.0
    assert fn("lighteval/MATH", r"\fbox{5}", "5") == 0.0  # found, but only \boxed can be unboxed
    assert fn("lighteval/MATH", r"\boxed 5$ and more", "5") == 1.0
    assert fn("lighteval/MATH", r"\boxed{\sqrt3}", r"\sqrt{3}") == 1.0
    assert fn("lighteval/MATH", r"\boxed{5", "5") == 0.0
