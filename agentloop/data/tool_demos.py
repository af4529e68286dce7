"""Demo sets for `tool_agent_loop`: small problems written for this project, each row enabling one tool.

    code        16 Python functions to write; rows enable the `python` tool; data_source `agentloop/code`;
                scored by running the final ```python block against the tests in the same sandbox as the
                tool (agentloop.rewards.code)
    code_stdio  8 stdin/stdout programs to write (same tool and reward; ground truth {"tests": [{stdin, stdout}]},
                which needs the code grader's stdin/stdout support)
    search_qa   16 questions answerable from the bundled corpus (agentloop/data/corpus_demo.jsonl); rows
                enable the `search` tool; data_source `agentloop/search_qa`; scored by exact match of the
                last <answer>...</answer> (agentloop.rewards.qa)

Row shapes (verl):

    code       ground_truth = {"entry_point": "add_digits",
                               "tests": ["assert add_digits(493) == 16", ...]    (assert statements)
                                     or [[[493], 16], ...]}                     ([args, expected] pairs)
               extra_info.reference_solution = a correct solution (no fences), used by the tests
    search_qa  ground_truth = {"target": ["Canberra"]}   (any alias matches)
               extra_info.support_doc = id of the corpus passage holding the answer

Use them with `agentloop rollout --loop tool_agent_loop data.builtin=code` (or search_qa, calculator).
"""

from __future__ import annotations

from typing import Any

from agentloop.data.builtin import register_dataset

CODE_SOURCE = "agentloop/code"
SEARCH_QA_SOURCE = "agentloop/search_qa"

CODE_SYSTEM = (
    "You are a careful Python programmer. You can run code with the python tool to test your solution "
    "(each run starts fresh; print what you want to see). When you are done, give the final solution as "
    "one ```python code block that defines the function."
)

CODE_STDIO_SYSTEM = (
    "You are a careful Python programmer. You can run code with the python tool to test your solution "
    "(each run starts fresh; print what you want to see). When you are done, give the final solution as "
    "one ```python code block: a complete program that reads standard input and prints the answer."
)

SEARCH_QA_SYSTEM = (
    "Answer the question using the search tool to look facts up. Give the final answer, a few words at "
    "most, inside <answer> </answer>, for example <answer> Paris </answer>."
)


class CodeProblem:
    """One code problem: the function to write, its description, a reference solution and tests."""

    __slots__ = ("entry_point", "signature", "description", "solution", "tests")

    def __init__(self, entry_point: str, signature: str, description: str, solution: str, tests: list[Any]):
        self.entry_point = entry_point
        self.signature = signature
        self.description = description
        self.solution = solution
        self.tests = tests


# Tests are assert statements (evaluated by the grader in the parent, over the names the solution defines:
# agentloop/rewards/code_judge.py) or [args, expected] pairs
# (`entry_point(*args) == expected` after tuples become lists); both forms appear below.
CODE_PROBLEMS: list[CodeProblem] = [
    CodeProblem(
        "add_digits", "add_digits(n)", "returns the sum of the decimal digits of the non-negative integer n",
        "def add_digits(n):\n    return sum(int(c) for c in str(n))\n",
        ["assert add_digits(0) == 0", "assert add_digits(7) == 7", "assert add_digits(493) == 16",
         "assert add_digits(10**12) == 1"]),
    CodeProblem(
        "is_palindrome", "is_palindrome(s)",
        "returns True if the string s reads the same backwards, ignoring case and non-alphanumeric characters",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
        [[["A man, a plan, a canal: Panama"], True], [["racecar"], True], [["hello"], False], [[""], True],
         [["No lemon, no melon"], True]]),
    CodeProblem(
        "fizzbuzz", "fizzbuzz(n)",
        "returns a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
        "'FizzBuzz' for multiples of both, else the number",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '')"
        " + ('Buzz' if i % 5 == 0 else '')\n        out.append(s or str(i))\n    return out\n",
        ["assert fizzbuzz(1) == ['1']", "assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']",
         "assert fizzbuzz(15)[-1] == 'FizzBuzz'", "assert len(fizzbuzz(30)) == 30", "assert fizzbuzz(0) == []"]),
    CodeProblem(
        "count_vowels", "count_vowels(s)", "returns how many vowels (a, e, i, o, u, either case) the string s has",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        [[["hello"], 2], [["AEIOU xyz"], 5], [[""], 0], [["rhythm"], 0]]),
    CodeProblem(
        "reverse_words", "reverse_words(s)",
        "returns the words of s in reverse order, separated by single spaces (extra spaces dropped)",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        ["assert reverse_words('the sky is blue') == 'blue is sky the'",
         "assert reverse_words('  hello   world ') == 'world hello'", "assert reverse_words('') == ''",
         "assert reverse_words('one') == 'one'"]),
    CodeProblem(
        "second_largest", "second_largest(xs)",
        "returns the second largest distinct value in the list xs, or None if there is none",
        "def second_largest(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) >= 2 else None\n",
        [[[[3, 1, 4, 1, 5]], 4], [[[7, 7, 7]], None], [[[]], None], [[[-2, -5]], -5], [[[10, 9, 10]], 9]]),
    CodeProblem(
        "run_length", "run_length(s)",
        "returns the run-length encoding of s: each run of a character as the character followed by the "
        "run's length, e.g. 'aaabcc' -> 'a3b1c2'",
        "def run_length(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(s[i] + str(j - i))\n"
        "        i = j\n    return ''.join(out)\n",
        ["assert run_length('aaabcc') == 'a3b1c2'", "assert run_length('') == ''",
         "assert run_length('x') == 'x1'", "assert run_length('aaaaaaaaaaaa') == 'a12'",
         "assert run_length('abab') == 'a1b1a1b1'"]),
    CodeProblem(
        "is_prime", "is_prime(n)", "returns True if the integer n is a prime number",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
        "        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
        [[[2], True], [[1], False], [[0], False], [[97], True], [[91], False], [[7919], True], [[-7], False]]),
    CodeProblem(
        "fib", "fib(n)", "returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(90) == 2880067194370816120"]),
    CodeProblem(
        "flatten", "flatten(xs)", "returns the items of the arbitrarily nested list xs as one flat list, in order",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n"
        "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
        [[[[1, [2, [3, 4]], 5]], [1, 2, 3, 4, 5]], [[[]], []], [[[[[[]]]]], []], [[["a", ["b"]]], ["a", "b"]]]),
    CodeProblem(
        "gcd", "gcd(a, b)", "returns the greatest common divisor of the non-negative integers a and b "
        "(gcd(0, 0) == 0)",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        [[[12, 18], 6], [[17, 5], 1], [[0, 9], 9], [[0, 0], 0], [[1071, 462], 21]]),
    CodeProblem(
        "word_count", "word_count(s)",
        "returns a dict mapping each lower-cased word of s (split on whitespace) to how often it occurs",
        "def word_count(s):\n    out = {}\n    for w in s.lower().split():\n        out[w] = out.get(w, 0) + 1\n"
        "    return out\n",
        ["assert word_count('the cat and The hat') == {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}",
         "assert word_count('') == {}", "assert word_count('a a a') == {'a': 3}"]),
    CodeProblem(
        "rotate", "rotate(xs, k)", "returns the list xs rotated right by k positions (k may exceed len(xs))",
        "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k]\n",
        [[[[1, 2, 3, 4, 5], 2], [4, 5, 1, 2, 3]], [[[1, 2, 3], 0], [1, 2, 3]], [[[1, 2, 3], 4], [3, 1, 2]],
         [[[], 3], []]]),
    CodeProblem(
        "balanced", "balanced(s)",
        "returns True if the brackets (), [] and {} in s are balanced and properly nested (other characters "
        "are ignored)",
        "def balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n    for c in s:\n"
        "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
        "            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack\n",
        ["assert balanced('([]{})') is True", "assert balanced('([)]') is False", "assert balanced('') is True",
         "assert balanced('((') is False", "assert balanced('a(b)c') is True", "assert balanced(')(') is False"]),
    CodeProblem(
        "to_binary", "to_binary(n)", "returns the binary representation of the non-negative integer n as a "
        "string without a prefix ('0' for 0)",
        "def to_binary(n):\n    if n == 0:\n        return '0'\n    out = ''\n    while n:\n"
        "        out = str(n % 2) + out\n        n //= 2\n    return out\n",
        [[[0], "0"], [[5], "101"], [[8], "1000"], [[255], "11111111"]]),
    CodeProblem(
        "merge_sorted", "merge_sorted(a, b)", "returns one sorted list holding the items of the sorted lists a and b",
        "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
        ["assert merge_sorted([1, 3, 5], [2, 4]) == [1, 2, 3, 4, 5]", "assert merge_sorted([], [1]) == [1]",
         "assert merge_sorted([], []) == []", "assert merge_sorted([1, 1], [1]) == [1, 1, 1]"]),
]


def code_rows() -> list[dict[str, Any]]:
    """The 16 code problems as verl rows; each enables the `python` tool."""
    rows = []
    for i, p in enumerate(CODE_PROBLEMS):
        question = f"Write a Python function `{p.signature}` that {p.description}."
        rows.append({
            "data_source": CODE_SOURCE,
            "prompt": [{"role": "system", "content": CODE_SYSTEM}, {"role": "user", "content": question}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": {"entry_point": p.entry_point, "tests": p.tests}},
            "extra_info": {"split": "test", "index": i, "question": question,
                           "reference_solution": p.solution, "tools_kwargs": {"python": {}}},
        })
    return rows


# (task, reference solution, [(stdin, stdout)]): whole programs reading stdin, for the stdin/stdout grader.
STDIO_PROBLEMS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("The input is two integers a and b on one line. Print a + b.",
     "a, b = map(int, input().split())\nprint(a + b)\n",
     [("1 2\n", "3\n"), ("-5 5\n", "0\n"), ("1000000000 1000000000\n", "2000000000\n")]),
    ("The first line holds n, the second n integers. Print their maximum.",
     "input()\nprint(max(map(int, input().split())))\n",
     [("3\n1 9 4\n", "9\n"), ("1\n-7\n", "-7\n"), ("4\n2 2 2 2\n", "2\n")]),
    ("The input is one line of text. Print it reversed.",
     "print(input()[::-1])\n",
     [("abc\n", "cba\n"), ("racecar\n", "racecar\n"), ("a b\n", "b a\n")]),
    ("The input is an integer n (1 <= n <= 20). Print n! (n factorial).",
     "import math\nprint(math.factorial(int(input())))\n",
     [("1\n", "1\n"), ("5\n", "120\n"), ("20\n", "2432902008176640000\n")]),
    ("The input is an integer n. Print YES if it is even, NO otherwise.",
     "print('YES' if int(input()) % 2 == 0 else 'NO')\n",
     [("4\n", "YES\n"), ("7\n", "NO\n"), ("0\n", "YES\n")]),
    ("The input is a line of words. Print how many words it has.",
     "print(len(input().split()))\n",
     [("the quick brown fox\n", "4\n"), ("one\n", "1\n"), ("  spaced   out  \n", "2\n")]),
    ("The first line holds n; each of the next n lines holds one integer. Print their sum.",
     "n = int(input())\nprint(sum(int(input()) for _ in range(n)))\n",
     [("3\n1\n2\n3\n", "6\n"), ("1\n-4\n", "-4\n"), ("2\n10\n-10\n", "0\n")]),
    ("The input is an integer n >= 1. Print the numbers 1 to n, one per line.",
     "for i in range(1, int(input()) + 1):\n    print(i)\n",
     [("3\n", "1\n2\n3\n"), ("1\n", "1\n")]),
]


def code_stdio_rows() -> list[dict[str, Any]]:
    """The stdin/stdout problems as verl rows; each enables the `python` tool."""
    rows = []
    for i, (task, solution, tests) in enumerate(STDIO_PROBLEMS):
        question = f"Write a Python program. {task} Read the input from standard input and print the answer."
        rows.append({
            "data_source": CODE_SOURCE,
            "prompt": [{"role": "system", "content": CODE_STDIO_SYSTEM}, {"role": "user", "content": question}],
            "ability": "code",
            "reward_model": {"style": "rule",
                             "ground_truth": {"tests": [{"stdin": a, "stdout": b} for a, b in tests]}},
            "extra_info": {"split": "test", "index": i, "question": question,
                           "reference_solution": solution, "tools_kwargs": {"python": {}}},
        })
    return rows


# (question, answer aliases, id of the corpus passage that answers it)
SEARCH_QA: list[tuple[str, list[str], str]] = [
    ("What is the capital city of Australia?", ["Canberra"], "demo-003"),
    ("On which river does Paris lie?", ["Seine", "the Seine", "river Seine"], "demo-000"),
    ("Until which year did the Berlin Wall divide the city?", ["1989"], "demo-001"),
    ("Who was the first person to walk on the Moon?", ["Neil Armstrong", "Armstrong"], "demo-017"),
    ("How many moons does Mars have?", ["two", "2"], "demo-015"),
    ("Who created the Python programming language?", ["Guido van Rossum", "van Rossum"], "demo-024"),
    ("In which museum does the Mona Lisa hang?", ["Louvre", "the Louvre", "Louvre museum"], "demo-030"),
    ("Which city did Mount Vesuvius bury in 79 AD?", ["Pompeii"], "demo-039"),
    ("What is the chemical formula of water?", ["H2O"], "demo-010"),
    ("In which city did the modern Olympic Games begin?", ["Athens"], "demo-034"),
    ("In which town was William Shakespeare born?", ["Stratford-upon-Avon", "Stratford upon Avon"], "demo-029"),
    ("What is the name of the famous storm on Jupiter?", ["Great Red Spot", "the Great Red Spot"], "demo-016"),
    ("Who first released the Linux kernel?", ["Linus Torvalds", "Torvalds"], "demo-025"),
    ("In which city did Johannes Gutenberg introduce movable-type printing to Europe?", ["Mainz"], "demo-032"),
    ("Which 2017 paper introduced the Transformer architecture?", ["Attention Is All You Need"], "demo-026"),
    ("In which country is the coffee plant thought to have first been used?", ["Ethiopia"], "demo-035"),
]


def search_qa_rows() -> list[dict[str, Any]]:
    """The 16 corpus questions as verl rows; each enables the `search` tool."""
    rows = []
    for i, (question, aliases, doc) in enumerate(SEARCH_QA):
        rows.append({
            "data_source": SEARCH_QA_SOURCE,
            "prompt": [{"role": "system", "content": SEARCH_QA_SYSTEM}, {"role": "user", "content": question}],
            "ability": "qa",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(aliases)}},
            "extra_info": {"split": "test", "index": i, "question": question, "support_doc": doc,
                           "tools_kwargs": {"search": {}}},
        })
    return rows


register_dataset("code", code_rows)
register_dataset("code_stdio", code_stdio_rows)
register_dataset("search_qa", search_qa_rows)
