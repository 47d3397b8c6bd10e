"""The maths verifiers: number tokens, final-answer extraction, strict vs contains, GSM8K gold parsing.
Hand-checked cases for every answer format, then hypothesis properties.
Run: pytest tests/test_maths_verify.py"""

from __future__ import annotations

import time
from fractions import Fraction as F

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.envs.maths.cli import perturb
from projected_grpo.envs.maths.verify import (
    contains_verify,
    extract_answer,
    format_number,
    normalize,
    number_tokens,
    parse_gold,
    parse_number,
    strict_verify,
)

# (response, gold, strict verdict, contains verdict)
CASES = [
    ("#### 18", 18, True, True),
    ("She sells 9 eggs.\n#### 18", 18, True, True),
    ("####18", 18, True, True),
    ("#### 1,234", 1234, True, True),
    ("#### $1,234.00", 1234, True, True),          # 1,234.00 = 1234 exactly
    ("#### -5", -5, True, True),
    ("#### 18.0", 18, True, True),
    ("#### 18 dollars", 18, True, True),
    ("#### 5 cm", 5, True, True),
    ("#### 25%", 25, True, True),
    ("#### 3/4", F(3, 4), True, True),
    ("#### 0.75", F(3, 4), True, True),             # 0.75 = 75/100 = 3/4
    ("#### 9*2=18", 18, True, True),                # a computation: its result after the last '='
    ("\\boxed{18}", 18, True, True),
    ("so \\boxed{\\$18}.", 18, True, True),
    ("\\boxed{\\frac{3}{4}}", F(3, 4), True, True),
    ("\\boxed{1{,}000}", 1000, True, True),
    ("\\boxed{18\\text{ dollars}}", 18, True, True),
    ("The answer is 18.", 18, True, True),
    ("Answer: $18.00", 18, True, True),
    ("**Final answer:** 18 dollars", 18, True, True),
    ("the answer is 3.5 kg.", F(7, 2), True, True),  # the decimal point is not the sentence's end
    ("9 * 2 = 18", 18, True, True),                  # no marker: the last number
    ("She makes $18 every day.", 18, True, True),
    ("18 dollars", 18, True, True),
    ("1,000 apples", 1000, True, True),
    ("1,000 apples", 1, False, False),              # "1,000" is one token: there is no 1
    ("it is -5", -5, True, True),
    ("x = \u22125", -5, True, True),                # unicode minus
    ("10-5", 5, True, True),                         # binary minus: tokens 10 and 5
    ("10-5", -5, False, False),
    ("the 18th", 18, True, True),                    # letters may follow a number (units, ordinals)
    ("x18 abc18def A18", 18, False, False),          # a number inside a word is no number
    ("5 cm^2", 5, True, True),
    ("5 cm^2", 2, False, False),                     # an exponent is no number
    ("3/0", 0, False, False),                        # no zero denominator: only the token 3
    ("<<16-3-4=9>>9 eggs\n#### 9", 9, True, True),
    # several candidates: strict rejects, the loophole accepts
    ("the answer is 12 or 13", 12, False, True),
    ("12, 13, 14", 13, False, True),
    ("He has 12 cm and 13 cm", 13, False, True),
    ("12\n13\n14", 14, False, True),
    ("#### 12, 13, 14", 13, False, True),
    ("#### 12 or 13", 12, False, True),
    ("\\boxed{12, 13}", 12, False, True),
    ("#### 18\n#### 19", 18, False, True),           # two different final answers
    ("#### 18\n#### 18.00", 18, True, True),         # the same one twice
    # a wrong final answer with the gold elsewhere: the echo hack
    ("9 * 2 = 18\n#### 19", 18, False, True),
    ("The answer is 18.\n#### 19", 18, False, True),  # #### comes first among the markers
    ("Janet has 16 eggs.\n#### 7", 16, False, True),
    ("", 0, False, False),
    ("no numbers here", 0, False, False),
    ("#### ", 0, False, False),
]


@pytest.mark.parametrize("response, gold, strict, contains", CASES)
def test_hand_cases(response, gold, strict, contains):
    assert strict_verify(response, F(gold)) is strict
    assert contains_verify(response, F(gold)) is contains


@pytest.mark.parametrize("response, source, value, candidates", [
    ("The answer is 7.\n#### 8", "hash", 8, (8,)),
    ("\\boxed{7} and the answer is 8", "boxed", 7, (7,)),
    ("First 3. The answer is 8.", "answer_is", 8, (8,)),
    ("3 + 5 = 8", "last_number", 8, (8,)),
    ("12, 13 or 12", "last_number", None, (12, 13)),  # distinct values, in order
    ("3 + 5 = 8; so 8 or 9", "last_number", None, (8, 9)),
    ("nothing", "none", None, ()),
])
def test_extract_answer_rules(response, source, value, candidates):
    a = extract_answer(response)
    assert (a.source, a.value, a.candidates) == (source, None if value is None else F(value),
                                                 tuple(F(c) for c in candidates))


def test_tokens_spans_and_values():
    text = normalize("Pay $1,234.50 or -3/4, not x2; 7.")
    assert [(t.value, text[t.start:t.end]) for t in number_tokens(text)] == [
        (F(246900, 200), "$1,234.50"), (F(-3, 4), "-3/4"), (F(7), "7")]  # 1234.50 = 2469/2


@pytest.mark.parametrize("value, text", [(F(18), "18"), (F(-3), "-3"), (F(5, 2), "2.5"), (F(-1, 8), "-0.125"),
                                         (F(1, 1000), "0.001"), (F(3, 7), "3/7"), (F(0), "0")])
def test_format_number(value, text):
    assert format_number(value) == text and parse_number(text) == value


@pytest.mark.parametrize("text", ["1" + " \n" * 20000 + "cm cm x 2", "\\boxed{" * 20000, "1, " * 20000,
                                  "1 " + "cm " * 20000 + "or 2", "answer is " * 20000, "9" * 20000 + "/7",
                                  "#### 1\n" * 20000, "\\boxed{1}" * 20000])
def test_pathological_texts_take_linear_time(text):
    # a whitespace gap of 3000 took minutes when the list-gap pattern could backtrack over two runs. CPU
    # time, not wall: each case takes <= 0.15 s of CPU here, and a loaded machine (a niced run beside two
    # busy jobs) stretched the wall clock past 2 s
    t0 = time.process_time()
    extract_answer(text), contains_verify(text, F(1))
    assert time.process_time() - t0 < 2.0


def test_huge_numbers_are_read_and_written():
    big = "9" * 5000  # past Python's 4300-digit int <-> str limit
    assert strict_verify(f"#### {big}", F(10**5000 - 1)) and format_number(F(10**5000 - 1)) == big
    assert format_number(F(10**5000 - 1, 10**5000)) == "0." + big


@pytest.mark.parametrize("answer, gold", [("He runs 540 meters\n#### 540", 540), ("#### 1,234", 1234),
                                          ("x\n#### -10", -10), ("a #### b\n#### 7", 7)])
def test_parse_gold(answer, gold):
    assert parse_gold(answer) == gold


@pytest.mark.parametrize("answer, message", [("The answer is 5", "no '#### <number>'"),
                                             ("#### 12 or 13", "should be one number"),
                                             ("#### many", "should be one number")])
def test_parse_gold_rejects(answer, message):
    with pytest.raises(ValueError, match=message):
        parse_gold(answer)


# --- properties ---------------------------------------------------------------------------------------

FRAGMENTS = ["####", " ", "\n", ", ", " or ", " and ", "The answer is ", "\\boxed{", "}", "=", "/", "-", "+",
             "$", "%", ".", "x", "cm", "\\frac{1}{2}", "\u2212", "1,000", "0", "3", "12", "18.00", "^"]
texts = st.one_of(st.text(max_size=40),
                  st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join))
values = st.one_of(st.integers(-10**7, 10**7).map(F),
                   st.builds(lambda n, k: F(n, 10**k), st.integers(-10**6, 10**6), st.integers(0, 3)))


@settings(max_examples=400, deadline=None)
@given(texts, values)
def test_strict_accept_implies_loophole_accept(text, gold):
    value = extract_answer(text).value
    if value is not None:  # the text's own final answer as the gold
        assert strict_verify(text, value) and contains_verify(text, value)
    assert not strict_verify(text, gold) or contains_verify(text, gold)


def _spellings(v: F) -> list[str]:
    plain = format_number(v)
    out = [plain, f"${plain}", f"{plain} dollars", f"\\boxed{{{plain}}}"]
    if v.denominator == 1:
        out += [f"{v.numerator:,}", f"{plain}.00", f"${v.numerator:,}.0"]
    return out


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_gold_text_verifies_against_itself(v, data):
    spelled = data.draw(st.sampled_from(_spellings(v)))
    response = f"Some working: 3 + 4 = 7.\n#### {spelled}"
    assert parse_gold(response) == v
    assert strict_verify(response, v) and contains_verify(response, v)


@settings(max_examples=200, deadline=None)
@given(values, values, st.data())
def test_a_perturbed_gold_never_strict_verifies(v, w, data):
    if v == w:
        return
    spelled = data.draw(st.sampled_from(_spellings(w)))
    assert not strict_verify(f"#### {spelled}", v)
    assert not strict_verify(f"I think {format_number(v)}.\n#### {spelled}", v)  # gold in the working
    assert not strict_verify(perturb(f"{format_number(v)} apples\n#### {format_number(v)}", v), v)
