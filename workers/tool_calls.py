"""Tool calls in chat batches: which `tool_choice` a line may use, the JSON schema that forces a
call, and the model's text turned back into OpenAI's `message.tool_calls`.

Why two paths, as in `vllm serve`:
- `tool_choice: "required"` and a named function need no parser, on any model: structured outputs
  constrain the generation to JSON that *is* the call. The schema is vLLM's own
  (`vllm.tool_parsers.utils.get_json_schema_from_tools`): for "required" an array of
  `{"name", "parameters"}` objects, one per call (`parallel_tool_calls: false` caps it at one);
  for a named function the function's parameter schema itself. The generated JSON is then read
  back exactly as vLLM's parser layer reads it (`DelegatingParser._extract_tool_calls`).
- `tool_choice: "auto"` (and `tools` without `tool_choice`) needs the model's own tool-call
  format read back, which only a parser for that model family can do: the registry names one per
  model (`freight models add --tool-call-parser hermes`), composed with the model's reasoning
  parser (its `reasoning_parser` engine argument) by vLLM's `ParserManager`, as `vllm serve
  --enable-auto-tool-choice --tool-call-parser` composes them. A model without one answers `auto`
  with the per-line error it always did.

Forced calls always take the structured-output path, parser or not, so every model gives
arguments that parse as JSON and match the schema (a parser that reads a native format for
"required" would give no such guarantee). `check_tools` and `forced_schema` run at validation,
with no engine; `ModelParsers` and `shape_choice` run on the engine worker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.request_errors import RequestError, clip_message

if TYPE_CHECKING:  # vLLM is imported lazily: importing it costs seconds.
    from vllm.parser.abstract_parser import Parser

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
FORCED = (REQUIRED, NAMED)

_FUNCTION_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'


def auto_tools_error() -> RequestError:
    """Today's answer to `auto` on a model whose registry entry names no tool-call parser."""
    return RequestError(
        "unsupported_parameter",
        'tool_choice "auto" needs a tool-call parser, and this model\'s registry entry names none '
        '(`freight models add --tool-call-parser`); use tool_choice "required" or a named '
        'function (they work on any model), omit `tools`, or set `tool_choice` to "none".',
        "tool_choice",
    )


def choice_kind(tool_choice: Any, has_tools: bool) -> str:
    """NONE, AUTO, REQUIRED or NAMED for a body's (raw or validated) `tool_choice`; `tools`
    without a `tool_choice` mean "auto", as in OpenAI's API and vLLM's request model."""
    if tool_choice is None:
        return AUTO if has_tools else NONE
    if isinstance(tool_choice, str):
        return {"none": NONE, "auto": AUTO, "required": REQUIRED}.get(tool_choice, tool_choice)
    return NAMED


def check_tools(data: dict) -> str:
    """Clear errors for `tools` / `tool_choice` shapes, before vLLM's validators (which index into
    them and would surface a KeyError); returns the body's choice kind."""
    tools = data.get("tools")
    tool_choice = data.get("tool_choice")
    kind = choice_kind(tool_choice, bool(tools))
    if kind == REQUIRED and not tools:
        raise RequestError(
            "invalid_request",
            'tool_choice "required" needs at least one function in `tools`.',
            "tools" if tools == [] else "tool_choice",
        )
    if tools is None:
        return kind
    if not isinstance(tools, list):
        raise RequestError("invalid_request", f"`tools` must be an array of {_FUNCTION_SHAPE}.", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise RequestError("invalid_request", f"`{where}` must be {_FUNCTION_SHAPE}.", where)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(
                "invalid_request",
                f"`{where}.function.name` must be a non-empty string.",
                f"{where}.function.name",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(
                "invalid_request",
                f"`{where}.function.parameters` must be a JSON schema object.",
                f"{where}.function.parameters",
            )
        if kind != NONE and name in names:  # which of the two would a call name?
            raise RequestError(
                "invalid_request",
                f"`{where}.function.name` {name[:100]!r} is given twice in `tools`.",
                f"{where}.function.name",
            )
        names.append(name)
    if kind == NAMED:
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if (
            not isinstance(tool_choice, dict)
            or tool_choice.get("type", "function") != "function"
            or not isinstance(name, str)
            or not name
        ):
            raise RequestError(
                "invalid_request",
                '`tool_choice` must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        if name not in names:
            listed = ", ".join(n[:64] for n in names[:20])
            raise RequestError(
                "invalid_request",
                f"`tool_choice.function.name` {name[:100]!r} is not a function in `tools` ({listed}).",
                "tool_choice.function.name",
            )
    return kind


def forced_schema(request: Any) -> dict | None:
    """The JSON schema the generation of a forced call must follow (vLLM's own construction);
    None unless `tool_choice` is "required" or a named function. Raises RequestError naming the
    tool whose schema cannot be used (nested past vLLM's structured-output limit, clashing
    `$defs`)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import check_json_nesting
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    if choice_kind(request.tool_choice, bool(request.tools)) not in FORCED:
        return None
    for i, tool in enumerate(request.tools):
        where = f"tools.{i}.function.parameters"
        try:
            check_json_nesting(tool.function.parameters)
        except VLLMValidationError as exc:
            raise RequestError("invalid_request", str(exc), where) from None
        if tool.function.parameters:
            _check_schema(tool.function.parameters, where)
    # vLLM's construction pops each tool's `$defs` into the wrapper: give it copies, so the tools
    # the chat template renders keep theirs
    tools = [tool.model_copy(deep=True) for tool in request.tools]
    try:
        schema = get_json_schema_from_tools(request.tool_choice, tools, request.parallel_tool_calls)
        check_json_nesting(schema)
    except VLLMValidationError as exc:
        raise RequestError("invalid_request", str(exc), exc.parameter or "tools") from None
    except (ValueError, TypeError) as exc:
        raise RequestError("invalid_request", f"The tools cannot be used: {exc}", "tools") from None
    return schema if isinstance(schema, dict) else None


def _check_schema(parameters: dict, where: str) -> None:
    """A forced call's `parameters` must be a JSON Schema (checked against its meta-schema, the
    draft its `$schema` names, else 2020-12): what is not can never compile to a grammar, and is
    better named here than as the engine's "Grammar error" when the unit runs."""
    import jsonschema

    validator = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        at = ".".join(str(p) for p in exc.absolute_path)
        detail = f" (at {at})" if at else ""
        raise RequestError(
            "invalid_request",
            clip_message(f"`{where}` is not a valid JSON Schema{detail}: {exc.message}"),
            where,
        ) from None
    except RecursionError:
        raise RequestError("invalid_request", f"`{where}` is nested too deeply.", where) from None


def constrain(request: Any) -> None:
    """Force the call through structured outputs, as vLLM's tool parsers do for these choices;
    refuses a body that also asks for another output format (only one constraint can hold)."""
    schema = forced_schema(request)
    if schema is None:
        return
    from vllm.sampling_params import StructuredOutputsParams

    if request.structured_outputs is not None:
        raise RequestError(
            "invalid_request",
            "`structured_outputs` cannot be combined with a forced tool call: the tool's schema constrains the output.",
            "structured_outputs",
        )
    if request.response_format is not None and request.response_format.type != "text":
        raise RequestError(
            "invalid_request",
            "`response_format` cannot be combined with a forced tool call: the tool's schema constrains the output.",
            "response_format",
        )
    request.structured_outputs = StructuredOutputsParams(json=schema)
    request.response_format = None


# --------------------------------------------------------------------------- registration


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None = None) -> None:
    """Refuse (ValueError, one line for the operator) a parser name vLLM has not registered, when
    the model is registered rather than when a worker on another machine starts."""
    import difflib

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for kind, name, manager, flag in (
        ("tool-call", tool_call_parser, ToolParserManager, "--tool-call-parser"),
        ("reasoning", reasoning_parser, ReasoningParserManager, "engine arg reasoning_parser"),
    ):
        if name is None:
            continue
        known = sorted(manager.list_registered())
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"{flag}: vLLM has no {kind} parser {name[:100]!r}{hint}; vLLM's: {', '.join(known)}"
            )


# --------------------------------------------------------------------------- engine side


class ModelParsers:
    """One model's tool-call parser and reasoning parser (either or both), composed by vLLM's
    ParserManager as `vllm serve` composes them; a fresh parser per choice (they are stateful)."""

    def __init__(self, parser_cls: type[Parser], tokenizer: Any, model_config: Any) -> None:
        self.parser_cls = parser_cls
        self.tokenizer = tokenizer
        self.model_config = model_config

    @classmethod
    def load(
        cls, tool_parser: str | None, reasoning_parser: str | None, tokenizer: Any, model_config: Any
    ) -> ModelParsers | None:
        """None without either parser; raises TypeError (vLLM's message) for a parser that is not
        registered or does not fit the model's tokenizer."""
        if not tool_parser and not reasoning_parser:
            return None
        from vllm.parser.parser_manager import ParserManager

        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser or None,
            reasoning_parser_name=reasoning_parser or None,
            enable_auto_tools=bool(tool_parser),
            model_name=model_config.model,
            is_harmony=getattr(model_config.hf_config, "model_type", None) == "gpt_oss",
            tokenizer=tokenizer,
        )
        return None if parser_cls is None else cls(parser_cls, tokenizer, model_config)

    @property
    def auto_tools(self) -> bool:
        """A tool-call parser reads calls out of free text: tool_choice "auto" is served."""
        return self.parser_cls.tool_parser_cls is not None

    @property
    def reasoning(self) -> bool:
        """A reasoning parser splits the answer's reasoning from its content."""
        return self.parser_cls.reasoning_parser_cls is not None

    def new(self, request: Any) -> Parser:
        kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
        return self.parser_cls(
            self.tokenizer, request.tools, chat_template_kwargs=kwargs, model_config=self.model_config
        )

    def adjust(self, request: Any) -> None:
        """The parser's own request changes (hermes keeps special tokens, whose `<tool_call>` tags
        it reads back), where vLLM's renderer applies them; a forced call keeps Freight's schema."""
        parser_cls = self.parser_cls
        kind = choice_kind(request.tool_choice, bool(request.tools))
        if not (
            parser_cls.always_adjust_request or parser_cls.reasoning_parser_cls is not None or kind != NONE
        ):
            return
        forced = (request.structured_outputs, request.response_format) if kind in FORCED else None
        tools = request.tools  # vLLM's adjust_request pops `$defs` out of the tools it is given
        request.tools = None if tools is None else [tool.model_copy(deep=True) for tool in tools]
        try:
            self.new(request).adjust_request(request)
        finally:
            request.tools = tools
        if forced is not None:
            request.structured_outputs, request.response_format = forced


@dataclass(frozen=True)
class ShapedChoice:
    """A choice's message fields and finish reason once tool calls are read out of its text."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    reasoning: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: "call_" and 24 characters


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    if not call_id or call_id.startswith("chatcmpl-tool-"):  # vLLM's random ids: OpenAI's shape
        call_id = new_call_id()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_calls(kind: str, text: str, function_name: str | None) -> list[dict[str, Any]] | None:
    """The calls in a forced generation, read as vLLM reads them; None when the text is not the
    complete JSON the schema describes (cut short by `max_tokens` or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if kind == NAMED:
        if not isinstance(value, dict) or function_name is None:
            return None
        return [_call(function_name, text.strip())]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        parameters = item.get("parameters")
        if not isinstance(parameters, dict):
            return None
        calls.append(_call(item["name"], json.dumps(parameters, ensure_ascii=False)))
    return calls


def shape_choice(
    request: Any, text: str, finish_reason: str | None, parser: Parser | None = None, token_ids: Any = ()
) -> ShapedChoice | None:
    """A chat choice with its tool calls read out, or None when the request involves no tool
    calling and no parser (the text is the content, as before).

    Finish reasons follow vLLM's server (and OpenAI's API): "tool_calls" when "required" or
    "auto" produced calls and the engine stopped; a named function keeps "stop". A forced
    generation that did not finish its JSON (finish_reason "length") carries no call: its text
    stays in `content`, so nothing that fails to parse is ever handed out as arguments."""
    kind = choice_kind(request.tool_choice, bool(request.tools))
    finish = finish_reason or "stop"
    if kind == NONE and parser is None:
        return None
    reasoning: str | None
    content: str | None
    if kind in FORCED:
        reasoning, content = None, text
        if parser is not None and parser.reasoning_parser is not None:
            reasoning, content = parser.reasoning_parser.extract_reasoning(text, request)
            content = content or ""
        name = request.tool_choice.function.name if kind == NAMED else None
        calls = forced_calls(kind, content, name)
        if calls is None:
            return ShapedChoice(content, [], finish, _reasoning(request, reasoning))
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        if kind == REQUIRED and finish == "stop":
            finish = "tool_calls"
        return ShapedChoice(None, calls, finish, _reasoning(request, reasoning))
    if parser is None:  # auto without a parser never reaches the engine
        return None
    reasoning, content, found = parser.parse(
        text, request, enable_auto_tools=kind == AUTO, model_output_token_ids=token_ids
    )
    calls = [_call(call.name, call.arguments, call.id) for call in (found or [])]
    if request.parallel_tool_calls is False:
        calls = calls[:1]
    if calls:
        finish = "tool_calls"
    return ShapedChoice(content, calls, finish, _reasoning(request, reasoning))


def _reasoning(request: Any, reasoning: str | None) -> str | None:
    return reasoning if request.include_reasoning else None
