"""The size budgets of the files people copy and read, held as a test (as tinygrad's CI holds its line count).

A reference is read before it is run: ckpt.py's core (from the top of the file to its first "# ---- appendix" line)
must read in one sitting, and no file grows by packing lines. Lines saved by density do not count: a statement
joined to another with ";" fails here, and so does any line over 120 characters. Docstrings and comments count.

    python -m pytest -q -s tests/test_budget.py
"""

import ast
import io
import os
import tokenize

import pytest

from tests.harness import REPO

BUDGETS = {"ckpt.py": 1000, "train_fsdp.py": 350, "consolidate.py": 250, "test_resume.py": 200,
           "bench/bench.py": 400, "README.md": 350}
CORE = 650  # ckpt.py up to its first "# ---- appendix" line
# ckpt.py misses its budget with every guarantee the README states (the closing note of issue 44 lists each part's
# lines and what giving it up would save). Until the guarantees to give up are chosen, the file is held at its size
# when this test landed, so that it can only shrink: lower these as it does, and remove them once the budget holds.
# Raised once, from 1261 and 983, by the fixes of the defects this round's cold readings reproduced (test_defects.py).
HELD = {"ckpt.py": 1306, "core": 1019}
WIDTH = 120


def lines(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read().splitlines()


def core(text):
    starts = [i for i, line in enumerate(text) if line.startswith("# ---- appendix")]
    assert starts, "ckpt.py has no '# ---- appendix' line: its core is not marked"
    return text[: starts[0]]


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_file_within_its_budget(name):
    """Each file within its line budget, no line wider than 120 characters."""
    text = lines(name)
    wide = [i + 1 for i, line in enumerate(text) if len(line) > WIDTH]
    limit = HELD.get(name, BUDGETS[name])
    print(f"\n{name}: {len(text)} lines (budget {BUDGETS[name]}, held at {limit}); lines over {WIDTH} characters: "
          f"{wide[:10]}")
    assert len(text) <= limit, f"{name} has {len(text)} lines, over {limit} (its budget: {BUDGETS[name]})"
    assert not wide, f"{name}: lines {wide[:10]} are over {WIDTH} characters"


def test_ckpt_core_within_its_budget():
    """ckpt.py's core, up to its first appendix: what a reader trusts a synchronous save and load from."""
    text = lines("ckpt.py")
    heads = [line for line in text if line.startswith("# ---- appendix")]
    limit = HELD.get("core", CORE)
    print(f"\nckpt.py: core {len(core(text))} lines (budget {CORE}, held at {limit}) of {len(text)}; appendices: "
          f"{heads}")
    assert len(core(text)) <= limit, f"ckpt.py's core has {len(core(text))} lines, over {limit} (its budget: {CORE})"


@pytest.mark.parametrize("name", sorted(n for n in BUDGETS if n.endswith(".py")))
def test_no_statements_joined(name):
    """No two statements on one line (";" outside strings and comments), and no compound statement's body on its
    header's line ("if x: y"): lines saved by density do not count."""
    source = "\n".join(lines(name)) + "\n"
    semicolons = [tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.OP and tok.string == ";"]
    packed = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)) and \
                isinstance(body, list) and body and body[0].lineno == node.lineno:
            packed.append(node.lineno)
    print(f"\n{name}: statements joined by ';' on lines {semicolons[:10]}; bodies on their header's line {packed[:10]}")
    assert not semicolons and not packed, f"{name}: ';' on lines {semicolons[:10]}, packed bodies {packed[:10]}"
