"""The README is checked: what it names exists, and its quick start does what it shows.

Guards against a teaching document that drifts from the code: a `ckpt.` function that was renamed, a link to a
file that is not in the repository (or outside it), a test that no longer exists, quick-start commands that fail
or print other losses than the README shows.

    python -m pytest -v -s tests/test_readme.py
"""

import os
import re
import shlex

import ckpt
from tests.harness import REPO, run

README = open(os.path.join(REPO, "README.md")).read()


def test_names_links_and_tests_exist():
    """Every `ckpt.<name>`, every relative link and every quoted test file in the README exists."""
    names = sorted(set(re.findall(r"\bckpt\.(?!py\b)([A-Za-z_]\w*)", README)))  # ckpt.py is the file
    missing = [n for n in names if not hasattr(ckpt, n)]
    links = sorted({t for t in re.findall(r"\]\(([^)#\s]+)\)", README) if "://" not in t})
    broken = [t for t in links if not os.path.exists(os.path.join(REPO, t))]
    quoted = sorted(set(re.findall(r"\b((?:tests/)?test_\w+\.py)(?:::(\w+\*?))?", README)))  # file[::test]
    absent = [f"{q}::{test}" if test else q for q, test in quoted if not _defines(q, test)]
    outside = re.findall(r"\.\./\w+", README)
    print(f"\n{len(names)} ckpt names, {len(links)} links, {len(quoted)} test files quoted; missing: {missing}, "
          f"broken: {broken}, absent: {absent}, outside the repository: {outside}")
    assert not missing and not broken and not absent and not outside


def _defines(quoted, test):
    """quoted (test_resume.py at the top, the others under tests/) exists and defines test (a prefix if it ends
    in *)."""
    top = quoted.startswith("tests/") or quoted == "test_resume.py"
    path = os.path.join(REPO, quoted if top else "tests/" + quoted)
    if not os.path.exists(path):
        return False
    defined = re.findall(r"^def (test_\w+)", open(path).read(), re.M)
    return not test or any(d == test or test.endswith("*") and d.startswith(test[:-1]) for d in defined)


def test_quick_start_runs_as_shown(tmp_path):
    """The quick start's commands, as written, run in a fresh directory; every output line the README shows after
    them (steps, losses, learning rates, the resume) is printed by those commands."""
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)  # [(language, text)]: commands, then output
    commands = [line.split("#")[0].strip() for lang, text in blocks if lang == "bash" for line in text.splitlines()]
    commands = [c for c in commands if c.startswith(("torchrun", "python consolidate.py"))]
    shown = "\n".join(text for lang, text in blocks if lang == "")
    for name in ("train_fsdp.py", "ckpt.py", "consolidate.py"):
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    output = ""
    for command in commands:
        _, out = run(shlex.split(command), timeout=300, cwd=str(tmp_path))
        output += out
    expected = [line.strip() for line in shown.splitlines() if line.strip().startswith(("step ", "resumed"))]
    printed = {re.sub(r"\|[^|]*tok/s", "", line).strip() for line in output.splitlines()}
    absent = [line for line in expected if re.sub(r"\|[^|]*tok/s", "", line).strip() not in printed]
    print(f"\nran {len(commands)} commands; {len(expected)} lines shown in the README, not printed: {absent}")
    assert len(commands) == 3 and expected and not absent
    assert os.path.isfile(tmp_path / "model_out" / "model.safetensors")
