"""agentgrpo's tool-call parsers against the serving engines' own parser tests (issue 38, item 4).

tests/data/parser_reference.json holds, as data, the test cases of SGLang's and vLLM's parsers for
the seven formats: each case's model output, the tools its test declares, and what the reference
test expects (the calls, a refusal, or only that nothing raises), with the repository, commit and
file it comes from. Streaming cases are given as the text their chunks join to. Each case runs
through agentgrpo's parser of the same format; it agrees, or it is listed below with the reason.

What "agrees" means (`disagreement`):
- calls: same number, order and names; arguments equal as JSON values (3 is not 3.0), or the keys
  and values the reference checks (`subset`), or the value types it checks (`types`).
- a refusal (the reference makes no call): no call that would run, i.e. none, or only calls to a
  tool the case does not declare (the env answers those `unknown_tool`). A malformed call is an
  error event here, which the reference reports as text: both run nothing.
- content: compared (stripped) where the reference states it and agentgrpo reports no malformed
  call; a reference that drops the text around calls (content None) is not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentgrpo.chat.parsers import PARSERS

DATA = json.loads(
    (Path(__file__).parent / "data" / "parser_reference.json").read_text(encoding="utf-8")
)
CASES = {c["id"]: c for c in DATA["cases"]}

# Reference tests that are not a parse of a finished turn, so there is nothing to compare.
SKIPPED = {
    "sglang/test_qwen3_coder_detector::"
    "test_long_whitespace_run_in_unclosed_value_parses_in_linear_time": "a timing test (100,000 "
    "spaces parsed in under 2 s); the parse it times is the drifted-marker cases'",
    "sglang/test_glm47_moe_detector::test_streamed_raw_length_buffer_only_partial_tag": "drives "
    "a private streaming method directly",
    **{
        f"vllm/{f}::test_regex_timeout_handling": "replaces the parser's regex by a mock that "
        "raises TimeoutError (no regex with a time limit here)"
        for f in (
            "test_llama3_json_tool_parser",
            "test_pythonic_tool_parser",
            "test_lfm2_tool_parser",
        )
    },
    "vllm/test_glm4_moe_tool_parser::test_delimiter_preserved_transformers_5x": "checks the "
    "request setting skip_special_tokens; the token ids here are decoded with special tokens",
    "vllm/test_glm4_moe_tool_parser::test_format_nonstring_value_preserves_json": "tests a private "
    "helper of vLLM's streaming path",
}

# Why agentgrpo deliberately differs from the reference in the cases below (docs/environments.md,
# "Where the parsers differ from the serving engines").
NOT_AN_OBJECT = (
    "arguments that are not a JSON object: vLLM passes the string on as the arguments, which no "
    "function can take as keyword arguments; here it is a bad_call event naming the problem"
)
NOT_JSON = (
    "a harmony call whose body is not JSON: vLLM passes the raw text on as the arguments; here it "
    "is a bad_json event (an empty body is a call without arguments, as there)"
)
POSITIONAL = (
    "a positional argument: SGLang drops it and runs the call without it, which is not the call "
    "the model wrote; here it is a bad_call event saying arguments go as key=value"
)
WRONG_TYPE = (
    "a value that is not of its parameter's type: vLLM and SGLang pass it on as they read it (the "
    "text as a string, `null` as null); here it is an invalid_arguments event naming the type the "
    "schema asks for"
)
GLM47_FORM = (
    "a call without arguments written as the name alone (`<tool_call>NAME</tool_call>`): SGLang's "
    "GLM-4.5 detector refuses it, its GLM-4.7 detector and vLLM's parsers run it; one parser "
    "reads GLM-4.5 to 4.7 here, so it runs"
)
UNTYPED_GUESS = (
    "values of a tool the request does not declare: vLLM's GLM parser reads '42' as a number "
    "without a schema; here an undeclared tool's values stay text (the env answers unknown_tool "
    "whatever they are), since only a schema can say whether '42' is a number"
)
CONTENT_BETWEEN = (
    "content: vLLM's GLM parser keeps only the text before the first call; here all the text "
    "outside the calls is the content"
)
NO_ARGUMENTS_KEY = (
    'a call without "parameters" or "arguments" opening the turn: vLLM treats it as text, '
    "SGLang runs it with no arguments; here it runs, as on SGLang"
)
_HERMES = "vllm/test_hermes_tool_parser::"
_QWEN3_XML = "vllm/test_qwen3xml_tool_parser::test_convert_param_value_invalid_emits_warning"
DIFFERENCES: dict[str, str] = {
    _HERMES + "test_hermes_parser_non_streaming_bare_string_arguments": NOT_AN_OBJECT,
    _HERMES + "test_hermes_streaming_bare_string_arguments_with_stream_interval": NOT_AN_OBJECT,
    **{
        _HERMES + f"test_hermes_streaming_string_arguments_match_non_streaming[{v}]": NOT_AN_OBJECT
        for v in ("hello", "{hello world}", "[oops", '{"a": 1} tail text')
    },
    "vllm/test_openai_tool_parser::test_extract_tool_calls_multiple_tools": NOT_JSON,
    "sglang/test_pythonic_detector::test_positional_arguments_ignored": POSITIONAL,
    **{
        f"{_QWEN3_XML}[{v}]": WRONG_TYPE
        for v in (
            *(f"not_a_number-{t}" for t in ("int", "integer", "uint", "long", "short", "unsigned")),
            "not_a_float-num",
            "not_a_float-float",
        )
    },
    **{
        "sglang/test_qwen3_coder_numeric_precision::"
        f"test_other_numeric_forms_are_unchanged[number-'{v}']": WRONG_TYPE
        for v in ("not-a-number", "null")
    },
    "sglang/test_glm4_moe_detector::test_missing_name_separator_yields_no_calls": GLM47_FORM,
    "vllm/test_glm4_moe_tool_parser::test_extract_tool_calls_numeric_deserialization": (
        UNTYPED_GUESS
    ),
    "vllm/test_glm4_moe_tool_parser::test_extract_tool_calls_mixed_content": CONTENT_BETWEEN,
    "vllm/test_llama3_json_tool_parser::"
    "test_extract_tool_calls_missing_parameters_and_arguments_key": NO_ARGUMENTS_KEY,
}


def _same(a: object, b: object) -> bool:
    """Equal as JSON values: 3 and 3.0, True and 1 differ."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _args_disagree(want: dict | None, got: dict) -> str | None:
    if want is None:
        return None
    if "equals" in want:
        return None if _same(want["equals"], got) else f"arguments {got!r}"
    if "subset" in want:
        bad = {k: got.get(k) for k, v in want["subset"].items() if not _same(got.get(k), v)}
        return f"arguments differ at {bad!r}" if bad else None
    if "types" in want:
        for key, kind in want["types"].items():
            if key not in got or (kind is not None and type(got[key]).__name__ != kind):
                return f"argument {key!r} is {got.get(key)!r}, want a {kind}"
        return None
    if "nonempty" in want:
        return None if got else "arguments are empty"
    if want["raw"] == "" and got == {}:  # "" is no arguments (vLLM's common tests take it so)
        return None
    return f"the reference passes the raw text {want['raw']!r} as the arguments"


def _tools(case: dict) -> list[dict] | None:
    tools = case["tools"]
    return DATA["tool_sets"][tools] if isinstance(tools, str) else tools


def _declared(tools: list[dict] | None) -> set[str] | None:
    if tools is None:
        return None
    return {t.get("function", t)["name"] for t in tools}


def disagreement(case: dict) -> str | None:
    """None where agentgrpo's parser agrees with the reference's expectation, else what differs."""
    tools = _tools(case)
    turn = PARSERS[case["parser"]](case["text"], tools)
    calls = turn.message.tool_calls or []
    want = case["expect"]
    if want.get("not_asserted"):
        return None
    if want.get("at_least_one_call"):
        return None if calls else f"no call ({turn.errors})"
    declared = _declared(tools)
    if not want["calls"]:
        running = [c for c in calls if declared is None or c.name in declared]
        return f"runs {[(c.name, c.arguments) for c in running]}" if running else None
    if len(calls) != len(want["calls"]):
        got = [(c.name, c.arguments) for c in calls]
        return f"{len(calls)} calls {got}, errors {[e.reason for e in turn.errors]}"
    for w, c in zip(want["calls"], calls, strict=True):
        if w["name"] is not None and w["name"] != c.name:
            return f"called {c.name!r}, not {w['name']!r}"
        if (why := _args_disagree(w["args"], c.arguments)) is not None:
            return f"{c.name}: {why}"
    content = case.get("content")
    if content is not None and not turn.errors:
        got = (turn.message.content or "").strip()
        if isinstance(content, dict):
            missing = [s for s in content["contains"] if s not in got]
            return f"content {got!r} lacks {missing}" if missing else None
        if got != content.strip():
            return f"content {got!r}, not {content.strip()!r}"
    return None


def test_the_data_names_its_sources_and_the_lists_name_real_cases():
    assert len(CASES) == len(DATA["cases"])
    for case in DATA["cases"]:
        source = DATA["sources"][case["source"]]
        assert len(source["commit"]) == 40 and source["path"].endswith(".py")
        assert case["parser"] in PARSERS
    assert not (set(SKIPPED) | set(DIFFERENCES)) - set(CASES)
    assert not set(SKIPPED) & set(DIFFERENCES)
    assert {i for i, c in CASES.items() if c["expect"].get("skip")} == set(SKIPPED)


@pytest.mark.parametrize("case_id", sorted(set(CASES) - set(SKIPPED)))
def test_each_reference_case_agrees_or_is_a_listed_difference(case_id):
    case = CASES[case_id]
    why = disagreement(case)
    if case_id in DIFFERENCES:
        assert why is not None, f"{case_id} now agrees: take it off DIFFERENCES"
    else:
        assert why is None, f"{case_id}: {why}"
