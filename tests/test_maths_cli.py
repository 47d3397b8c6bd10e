"""`check-verifier` and `grade-math`: results, exit codes, one-line errors, and the full GSM8K files.
Run: pytest tests/test_maths_cli.py"""

from __future__ import annotations

import json

import pytest

from projected_grpo.cli import main
from projected_grpo.envs.maths.cli import check_verifier, grade_math

ROWS = [{"question": "Janet has 16 eggs and eats 3. How many are left?",
         "answer": "16 - 3 = <<16-3=13>>13\n#### 13"},
        {"question": "A house costs $80,000 and repairs $50,000. Total?",
         "answer": "80,000+50,000=$<<80000+50000=130000>>130,000\n#### 130,000"},
        {"question": "It is 5 degrees and drops 15. What is it now?", "answer": "5 - 15 = -10\n#### -10"}]


def _write(tmp_path, lines, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_check_verifier_passes_on_good_rows(tmp_path, capsys):
    assert check_verifier(["--dataset", str(_write(tmp_path, ROWS))]) == 0
    out = capsys.readouterr().out.splitlines()
    # every perturbed copy still shows the gold in its working: the loophole accepts all 3
    assert out[0] == "loophole (contains) verifier, for information: gold_pass=3/3 perturbed_pass=3/3"
    assert out[-1] == "RESULT gold_pass=3/3 perturbed_pass=0/3"


@pytest.mark.parametrize("line, where", [('{"question": "q", "answer": "no final line"}', "rows.jsonl:2"),
                                         ('{"question": "q"}', "rows.jsonl:2: field 'answer' is missing")])
def test_check_verifier_bad_row_is_one_line_exit_2(tmp_path, capsys, line, where):
    assert main(["check-verifier", "--dataset", str(_write(tmp_path, [ROWS[0], line]))]) == 2
    err = capsys.readouterr().err
    assert where in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_check_verifier_missing_file(tmp_path, capsys):
    assert check_verifier(["--dataset", str(tmp_path / "absent.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"{tmp_path / 'absent.jsonl'}: no such file"


def _full_file(shared_data, name, capsys):
    path = shared_data / "gsm8k" / name
    rc = check_verifier(["--dataset", str(path)])
    return rc, capsys.readouterr().out.splitlines()


def test_check_verifier_gsm8k_test(shared_data, capsys):
    rc, out = _full_file(shared_data, "test.jsonl", capsys)
    assert out[-1] == "RESULT gold_pass=1319/1319 perturbed_pass=0/1319" and rc == 0
    assert not [ln for ln in out if ln.startswith("FAIL")]


@pytest.mark.slow
def test_check_verifier_gsm8k_train(shared_data, capsys):
    rc, out = _full_file(shared_data, "train.jsonl", capsys)
    assert out[-1] == "RESULT gold_pass=7473/7473 perturbed_pass=0/7473" and rc == 0


@pytest.mark.parametrize("text, gold, want", [
    ("9 * 2 = 18\n#### 18", "18", {"strict": True, "loophole": True, "answer": "18", "source": "hash"}),
    ("#### 17, 18, 19", "#### 18", {"strict": False, "loophole": True, "answer": None,
                                    "candidates": ["17", "18", "19"]}),
    ("The answer is $1,234.50.", "1234.5", {"strict": True, "answer": "1234.5", "source": "answer_is"}),
    ("\\boxed{\\frac{3}{4}}", "3/4", {"strict": True, "gold": "0.75"}),  # canonical text: a decimal
])
def test_grade_math_json(tmp_path, capsys, text, gold, want):
    path = tmp_path / "r.txt"
    path.write_text(text)
    assert main(["grade-math", "--gold", gold, "--text-file", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"gold", "strict", "loophole", "answer", "candidates", "source"}
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("gold, message", [("many", "expected one number"), ("12 or 13", "found 2"),
                                           ("x #### y", "the text after '####'")])
def test_grade_math_bad_gold(tmp_path, capsys, gold, message):
    path = tmp_path / "r.txt"
    path.write_text("#### 1")
    assert grade_math(["--gold", gold, "--text-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_grade_math_missing_text_file(tmp_path, capsys):
    assert grade_math(["--gold", "1", "--text-file", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.startswith(f"{tmp_path / 'none.txt'}: cannot read it (FileNotFoundError")
