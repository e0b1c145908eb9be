"""The reasoning parser (jaxserve/server/reasoning.py) on strings: whole outputs against the
expected (reasoning, content), and every way of cutting them into stream deltas agrees with the
whole (the tags split at every character)."""

import itertools

import pytest

from jaxserve.server import reasoning
from jaxserve.server.reasoning import ReasoningParser, output_start, split

CASES = [  # (id, output, where it starts (output_start), reasoning, content)
    ("tags", "<think>abc</think>answer", "content", "abc", "answer"),
    ("tags-default-reasoning", "<think>abc</think>answer", "reasoning", "abc", "answer"),
    ("qwen3-newlines", "<think>\nI think.\n</think>\n\nHi!", "content", "\nI think.\n", "\n\nHi!"),
    ("space-before-open", "  \n<think>x</think>y", "content", "x", "y"),
    ("no-open-tag-prompt-opened", "abc</think>answer", "reasoning", "abc", "answer"),
    ("no-open-tag-prompt-closed", "abc</think>answer", "content", None, "abc</think>answer"),
    ("cut-inside-thinking", "<think>still thinking", "content", "still thinking", None),
    ("cut-before-any-close", "still thinking", "reasoning", "still thinking", None),
    ("nothing-after-close", "<think>abc</think>", "content", "abc", None),
    ("empty-thinking", "<think></think>answer", "content", "", "answer"),
    ("plain-answer", "just an answer", "content", None, "just an answer"),
    ("open-tag-later-is-content", "a <think>b</think>", "content", None, "a <think>b</think>"),
    ("second-open-inside-thinking", "<think>a<think>b</think>c", "content", "a<think>b", "c"),
    ("second-close-is-content", "<think>a</think>b</think>c", "content", "a", "b</think>c"),
    ("almost-a-tag", "<think>a</thin>b</think", "content", "a</thin>b</think", None),
    ("almost-an-open-tag", "<thin>k", "content", None, "<thin>k"),
    ("only-space", " \n ", "content", None, " \n "),
    ("only-space-thinking", " \n ", "reasoning", " \n ", None),
    ("empty", "", "content", None, None),
    ("prefix-of-open-at-end", "<thi", "content", None, "<thi"),
    ("tool-call-after-thinking", '<think>plan</think><tool_call>\n{"name": "f"}\n</tool_call>',
     "content", "plan", '<tool_call>\n{"name": "f"}\n</tool_call>'),
    ("unicode", "<think>é…</think>日本", "content", "é…", "日本"),
    # A regex after a prompt that opened thinking: thinking only if it writes </think>.
    ("either-closes", "Red is warm.</think>\n\nRed.", "either", "Red is warm.", "\n\nRed."),
    ("either-no-close", "yes", "either", None, "yes"),
    ("either-opens", " <think>a</think>b", "either", "a", "b"),
    ("either-close-first", "</think>b", "either", "", "b"),
    ("either-almost-a-close", "a</thin", "either", None, "a</thin"),
    ("either-empty", "", "either", None, None),
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
    parser = ReasoningParser("content")
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>ab</") == ("ab", "")  # '</' may begin '</think>'
    assert parser.in_reasoning
    assert parser.feed("thi") == ("", "")
    assert parser.feed("nk>The") == ("", "The")
    assert not parser.in_reasoning and parser.saw_reasoning
    assert parser.feed(" end") == ("", " end")
    assert parser.finish() == ("", "")


def test_where_the_output_starts_follows_the_prompt():
    opened = "<|im_start|>assistant\n<think>\n"
    # Qwen3.5 / Qwen3-Thinking / DeepSeek-R1 templates open thinking in the prompt.
    assert output_start(opened, None) == "reasoning"
    # Qwen3 with enable_thinking=False closes it there: the output is the answer.
    assert output_start("<|im_start|>assistant\n<think>\n\n</think>\n\n", None) == "content"
    # No tag at all (the model writes <think> itself, or an R1 template without it).
    assert output_start("<|im_start|>assistant\n", None) == "reasoning"
    # Earlier turns' thinking does not matter when this turn opens it again.
    assert output_start("<think>a</think>b" + opened, None) == "reasoning"
    # A constrained output holds from its first token: no free thinking before it. A JSON
    # one is the answer; a regex / choice / grammar may write the thinking out itself.
    assert output_start(opened, "json") == "content"
    assert output_start(opened, "text") == "either"
    # ... but only where the prompt opened thinking.
    assert output_start("<|im_start|>assistant\n", "text") == "content"
    assert output_start(opened + "\n</think>\n\n", "text") == "content"


def test_the_parser_refuses_an_unknown_start():
    with pytest.raises(ValueError, match="reasoning, content or either, got True"):
        ReasoningParser(True)


def test_parser_names_are_checked():
    for name in reasoning.CHOICES:
        reasoning.check_parser_name(name)
    with pytest.raises(ValueError, match="none, qwen3, deepseek_r1.*'granite'"):
        reasoning.check_parser_name("granite")


def test_serve_refuses_an_unknown_parser_naming_the_choices(capsys):
    from jaxserve.cli import main
    assert main(["serve", "--reasoning-parser", "granite"]) == 2  # before any model loads
    assert "reasoning_parser must be one of none, qwen3, deepseek_r1" in capsys.readouterr().err
