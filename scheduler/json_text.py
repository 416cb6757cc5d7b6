"""JSON a tenant wrote, read and written without an exception the caller does not expect.

Why: `json.loads` raises three kinds of error on hostile text, and two of them are not
`JSONDecodeError`: an integer of more digits than Python converts (4,300 by default) raises a
plain `ValueError`, and nesting deeper than the decoder recurses raises `RecursionError`. Code
that caught only `JSONDecodeError` let one such line crash validation, a console upload or a
drop-folder scan. Here every failure is a `ValueError` (a `JSONDecodeError` as it comes, the others
as `JSONTextError`) with a message a tenant can act on.
"""

from __future__ import annotations

import json
import sys
from typing import Any

DEPTH_MESSAGE = "nested too deeply"


class JSONTextError(ValueError):
    """JSON text Freight cannot read or write; ``msg`` is the reason (as JSONDecodeError's)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg


def _digits_message() -> str:
    return f"a number has more than {sys.get_int_max_str_digits()} digits"


def loads(text: str | bytes) -> Any:
    """`json.loads`, raising only ValueError (JSONDecodeError or JSONTextError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise JSONTextError(DEPTH_MESSAGE) from None
    except ValueError as exc:  # int <-> str conversion past the digit limit
        raise JSONTextError(_digits_message() if "digits" in str(exc) else str(exc)) from None


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps`, raising JSONTextError for depth and digit limits (TypeError and NaN's
    ValueError as json.dumps raises them)."""
    try:
        return json.dumps(value, **options)
    except RecursionError:
        raise JSONTextError(DEPTH_MESSAGE) from None
    except ValueError as exc:
        if "digits" in str(exc):
            raise JSONTextError(_digits_message()) from None
        raise
