"""The reasoning parser (jaxserve/server/reasoning.py) on strings: whole outputs against the
expected (reasoning, content), and every way of cutting them into stream deltas agrees with the
whole (the tags split at every character)."""

import itertools

import pytest

from jaxserve.server import reasoning
from jaxserve.server.reasoning import ReasoningParser, split, starts_in_reasoning

CASES = [  # (id, output, starts inside thinking, reasoning, content)
    ("tags", "<think>abc</think>answer", False, "abc", "answer"),
    ("tags-default-reasoning", "<think>abc</think>answer", True, "abc", "answer"),
    ("qwen3-newlines", "<think>\nI think.\n</think>\n\nHi!", False, "\nI think.\n", "\n\nHi!"),
    ("space-before-open", "  \n<think>x</think>y", False, "x", "y"),
    ("no-open-tag-prompt-opened", "abc</think>answer", True, "abc", "answer"),
    ("no-open-tag-prompt-closed", "abc</think>answer", False, None, "abc</think>answer"),
    ("cut-inside-thinking", "<think>still thinking", False, "still thinking", None),
    ("cut-before-any-close", "still thinking", True, "still thinking", None),
    ("nothing-after-close", "<think>abc</think>", False, "abc", None),
    ("empty-thinking", "<think></think>answer", False, "", "answer"),
    ("plain-answer", "just an answer", False, None, "just an answer"),
    ("open-tag-later-is-content", "a <think>b</think>", False, None, "a <think>b</think>"),
    ("second-open-inside-thinking", "<think>a<think>b</think>c", False, "a<think>b", "c"),
    ("second-close-is-content", "<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("almost-a-tag", "<think>a</thin>b</think", False, "a</thin>b</think", None),
    ("almost-an-open-tag", "<thin>k", False, None, "<thin>k"),
    ("only-space", " \n ", False, None, " \n "),
    ("only-space-thinking", " \n ", True, " \n ", None),
    ("empty", "", False, None, None),
    ("prefix-of-open-at-end", "<thi", False, None, "<thi"),
    ("tool-call-after-thinking", '<think>plan</think><tool_call>\n{"name": "f"}\n</tool_call>',
     False, "plan", '<tool_call>\n{"name": "f"}\n</tool_call>'),
    ("unicode", "<think>é…</think>日本", False, "é…", "日本"),
]


@pytest.mark.parametrize("text,start,want_reasoning,want_content", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_whole_outputs(text, start, want_reasoning, want_content):
    assert split(text, start) == (want_reasoning, want_content)


def _streamed(pieces: list[str], start: bool) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ReasoningParser(start)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


def _cuts(text: str, k: int):
    for points in itertools.combinations(range(1, len(text)), k):
        bounds = (0,) + points + (len(text),)
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text,start", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_every_cut_agrees_with_the_whole(text, start):
    want_r, want_c = split(text, start)
    cuts = [[text]] + list(_cuts(text, 1)) + (list(_cuts(text, 2)) if len(text) <= 40 else [])
    cuts.append(list(text))  # one character per delta
    for pieces in cuts:
        got_r, got_c, deltas = _streamed(pieces, start)
        assert (got_r, got_c) == (want_r or "", want_c or ""), pieces
        # Reasoning never follows content: once the answer starts, thinking is over.
        seen_content = False
        for r, c in deltas:
            assert not (seen_content and r), (pieces, deltas)
            seen_content = seen_content or bool(c)


def test_a_tag_split_across_deltas_is_held_back_not_leaked():
    parser = ReasoningParser(False)
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>ab</") == ("ab", "")  # '</' may begin '</think>'
    assert parser.in_reasoning
    assert parser.feed("thi") == ("", "")
    assert parser.feed("nk>The") == ("", "The")
    assert not parser.in_reasoning and parser.saw_reasoning
    assert parser.feed(" end") == ("", " end")
    assert parser.finish() == ("", "")


def test_where_the_output_starts_follows_the_prompt():
    # Qwen3.5 / Qwen3-Thinking / DeepSeek-R1 templates open thinking in the prompt.
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n", False)
    # Qwen3 with enable_thinking=False closes it there: the output is the answer.
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", False)
    # No tag at all (the model writes <think> itself, or an R1 template without it).
    assert starts_in_reasoning("<|im_start|>assistant\n", False)
    # Earlier turns' thinking does not matter when this turn opens it again.
    assert starts_in_reasoning("<think>a</think>b<|im_start|>assistant\n<think>\n", False)
    # A constrained output holds from its first token: no free thinking before it.
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n", True)


def test_parser_names_are_checked():
    for name in reasoning.CHOICES:
        reasoning.check_parser_name(name)
    with pytest.raises(ValueError, match="none, qwen3, deepseek_r1.*'granite'"):
        reasoning.check_parser_name("granite")


def test_serve_refuses_an_unknown_parser_naming_the_choices(capsys):
    from jaxserve.cli import main
    assert main(["serve", "--reasoning-parser", "granite"]) == 2  # before any model loads
    assert "reasoning_parser must be one of none, qwen3, deepseek_r1" in capsys.readouterr().err
