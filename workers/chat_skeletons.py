"""Chat prompts rendered once per conversation shape, with each message's text put in its place.

Why: rendering the chat template (transformers' ``apply_chat_template``, jinja's context set-up)
costs about 30 us a line, as much as tokenizing it, and a batch file's lines usually differ only
in their texts: the same roles in the same order. For a template that only ever *emits* a
message's content, and never reads it otherwise, the rendering of a conversation is the rendering
of the same roles with marker texts, each marker replaced by its message's text. So the template
runs once per shape (the roles, and which contents are empty), and each line costs a join.

What "only emits" means is checked on the template's syntax tree (``verbatim_template``), never
guessed from a few renderings, and any doubt keeps the full path:
- a message's content may be written out (``{{ message['content'] }}``, ``'x' + content``,
  ``a if c else content``), tested for its type (``is string``) or truthiness (``{% if content %}``,
  the same for a marker as for the text, since the shape keeps which contents are empty);
- anything else that could see the text (a filter such as ``trim``, a method such as ``split``,
  ``in``, a comparison, ``set``, a macro or a filter block around the output, ``loop.previtem``,
  a message passed whole to a filter or a call) makes the template ineligible;
- messages can only be reached through ``messages``, its items, slices and loop variables.

`tests/workers/test_chat_skeletons.py` checks, with generated conversations, that this path and
``apply_chat_template`` give the same text for eligible templates, and which templates are refused.
The cache holds only renderings of marker texts (roles come from a fixed set): nothing of a
tenant's text, so one per process serves every file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_MESSAGES = 64  # longer conversations render in full: keeps each cached key small
MAX_SHAPES = 4096  # cached skeletons per template; later new shapes render in full
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a marker's message index
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

_COLLECTION, _MESSAGE, _CONTENT, _GET = "collection", "message", "content", "get"
# tests whose answer depends only on a value's type: the same for a marker as for the text
_TYPE_TESTS = frozenset({"string", "none", "defined", "undefined", "mapping", "iterable", "sequence"})
_SIZE_FILTERS = frozenset({"length", "count"})  # of the message list: the shape fixes it
# statements whose output can be captured and changed before it reaches the prompt, or escaped
_CAPTURING = ("FilterBlock", "CallBlock", "Macro", "AssignBlock", "Extends", "Include", "Import", "FromImport", "Block", "ScopedEvalContextModifier", "EvalContextModifier")  # fmt: skip
_DICT_METHODS = frozenset({"items", "values", "keys", "copy", "setdefault", "pop", "popitem", "update"})


class _Refused(Exception):
    """The template may read a message's text: it is rendered in full, line by line."""


def verbatim_template(source: str) -> bool:
    """True when the template can only write a message's content out as it is (see the module)."""
    try:
        tree = _environment(source).parse(source)
        _Check(tree).run()
    except Exception:  # _Refused, or a template jinja cannot parse (rendered in full, it fails there)
        return False
    return True


class _Check:
    """One pass over a parsed template: which names hold messages, then every use of them."""

    def __init__(self, tree: Any) -> None:
        from jinja2 import nodes

        self.nodes = nodes
        self.tree = tree
        self.targets: set[str] = set()

    def run(self) -> None:
        nodes = self.nodes
        for name in _CAPTURING:
            if any(True for _ in self.tree.find_all(getattr(nodes, name))):
                raise _Refused(name)
        for loop in self.tree.find_all(nodes.For):  # the names that hold one message
            if loop.recursive:
                raise _Refused("recursive loop")
            if self.kind(loop.iter) == _COLLECTION:
                if not isinstance(loop.target, nodes.Name):
                    raise _Refused("unpacked message")
                self.targets.add(loop.target.name)
        self.visit(self.tree, ())

    def kind(self, node: Any) -> str | None:
        """What a expression holds: the message list, one message, a content, ``message.get``."""
        nodes = self.nodes
        if isinstance(node, nodes.Name):
            if node.name == "messages":
                return _COLLECTION
            return _MESSAGE if node.name in self.targets else None
        if isinstance(node, nodes.Getitem):
            return self.item_kind(node)
        if isinstance(node, nodes.Getattr):
            return self.attribute_kind(node)
        if isinstance(node, nodes.Call) and self.kind(node.node) == _GET:
            if not node.args or not isinstance(node.args[0], nodes.Const):
                raise _Refused("message.get of a computed name")
            return _CONTENT if node.args[0].value == "content" else None
        return None

    def item_kind(self, node: Any) -> str | None:
        """``x[...]``: a slice of the message list, one message, or a message's content."""
        nodes = self.nodes
        base = self.kind(node.node)
        if base == _COLLECTION:
            return _COLLECTION if isinstance(node.arg, nodes.Slice) else _MESSAGE
        if base == _MESSAGE:
            if not (isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)):
                raise _Refused("a message field by a computed name")
            return _CONTENT if node.arg.value == "content" else None
        return None

    def attribute_kind(self, node: Any) -> str | None:
        """``x.attr``: a message's content or its ``get``; a method that could hand out a message
        or its text (and ``loop.previtem``/``nextitem``) is refused."""
        nodes = self.nodes
        base = self.kind(node.node)
        if base == _COLLECTION:  # a list method (pop, copy, ...) could hand out a message
            raise _Refused(f"messages.{node.attr}")
        if base == _MESSAGE:
            if node.attr == "content":
                return _CONTENT
            if node.attr == "get":
                return _GET
            if node.attr in _DICT_METHODS or node.attr.startswith("_"):
                raise _Refused(f"message.{node.attr}")
            return None
        loop = isinstance(node.node, nodes.Name) and node.node.name == "loop"
        if loop and node.attr in ("previtem", "nextitem"):
            raise _Refused("loop." + node.attr)
        return None

    def visit(self, node: Any, ancestors: tuple[tuple[Any, str], ...]) -> None:
        nodes = self.nodes
        kind = self.kind(node) if isinstance(node, nodes.Expr) else None
        if kind is not None:
            self.allowed(node, kind, ancestors)
        for field, value in node.iter_fields():
            children = value if isinstance(value, list) else [value]
            for child in children:
                if isinstance(child, nodes.Node):
                    self.visit(child, ((node, field), *ancestors))

    def allowed(self, node: Any, kind: str, ancestors: tuple[tuple[Any, str], ...]) -> None:
        nodes = self.nodes
        if not ancestors:
            raise _Refused("a bare message expression")
        parent, field = ancestors[0]
        if isinstance(parent, nodes.Test) and field == "node" and parent.name in _TYPE_TESTS:
            return
        if kind == _GET:
            if isinstance(parent, nodes.Call) and field == "node":
                return
        elif kind in (_COLLECTION, _MESSAGE):
            if isinstance(parent, (nodes.Getitem, nodes.Getattr)) and field == "node":
                return  # a field of it: classified (and checked) on its own
            if kind == _MESSAGE and isinstance(parent, nodes.For) and field == "target":
                return  # the loop variable itself
            if kind == _COLLECTION:
                if isinstance(parent, nodes.For) and field == "iter":
                    return
                if isinstance(parent, nodes.Filter) and field == "node" and parent.name in _SIZE_FILTERS:
                    return
        elif kind == _CONTENT and (_written_out(nodes, ancestors) or _truth_tested(nodes, ancestors)):
            return
        raise _Refused(f"{kind} used by {type(parent).__name__}.{field}")


def _written_out(nodes: Any, ancestors: tuple[tuple[Any, str], ...]) -> bool:
    """Reaches an ``{{ }}`` output through string concatenations and conditional values only."""
    for parent, field in ancestors:
        if isinstance(parent, nodes.Output):
            return True
        if isinstance(parent, (nodes.Add, nodes.Concat)):
            continue
        if isinstance(parent, nodes.CondExpr) and field in ("expr1", "expr2"):
            continue
        return False
    return False


def _truth_tested(nodes: Any, ancestors: tuple[tuple[Any, str], ...]) -> bool:
    """Decides an ``if`` (or a conditional value) through ``and``/``or``/``not`` only."""
    for parent, field in ancestors:
        if isinstance(parent, (nodes.If, nodes.CondExpr)) and field == "test":
            return True
        if isinstance(parent, (nodes.And, nodes.Or, nodes.Not)):
            continue
        return False
    return False


class ChatSkeletons:
    """One tokenizer's chat template, rendered once per conversation shape (thread-safe: the
    cache is a dict, written whole values at a time)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.enabled = isinstance(template, str) and verbatim_template(template)
        self._skeletons: dict[tuple[tuple[str, bool], ...], tuple[list[str], list[int]] | None] = {}

    def render(self, messages: list[dict[str, Any]]) -> str | None:
        """The template's text for messages of string content; None when this path cannot give it
        (then the caller renders in full, which also reports whatever the template raises)."""
        if not self.enabled or len(messages) > MAX_MESSAGES:
            return None
        shape = tuple((m["role"], bool(m["content"])) for m in messages)
        skeleton = self._skeletons.get(shape)
        if skeleton is None:
            if shape in self._skeletons:
                return None
            skeleton = self._build(shape)
            if len(self._skeletons) < MAX_SHAPES:
                self._skeletons[shape] = skeleton
            if skeleton is None:
                return None
        texts, order = skeleton
        return "".join(_interleave(texts, [messages[i]["content"] for i in order]))

    def _build(self, shape: tuple[tuple[str, bool], ...]) -> tuple[list[str], list[int]] | None:
        """The rendering of marker messages, split at the markers (texts between, message order)."""
        markers = [
            {"role": role, "content": f"{_OPEN}{i}{_CLOSE}" if filled else ""}
            for i, (role, filled) in enumerate(shape)
        ]
        try:
            text = self.tokenizer.apply_chat_template(markers, add_generation_prompt=True, tokenize=False)
        except Exception:
            return None
        if not isinstance(text, str):
            return None
        parts = _MARKER.split(text)
        texts, order = parts[0::2], [int(i) for i in parts[1::2]]
        if any(_OPEN in t or _CLOSE in t for t in texts) or any(
            i >= len(shape) or not shape[i][1] for i in order
        ):
            return None  # a marker the template changed: render these in full
        return texts, order


def _interleave(texts: list[str], contents: list[str]) -> Iterator[str]:
    yield texts[0]
    for content, text in zip(contents, texts[1:], strict=True):
        yield content
        yield text


def _environment(template: str) -> Any:
    """The jinja environment transformers renders chat templates with (for parsing the template)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).environment
