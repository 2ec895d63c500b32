"""The API's JSON body parser: DRF's, and two refusals it does not make.

- A body nested too deeply for the parser's recursion is a 400 like any other bad JSON (DRF
  turns only ValueError into its ParseError: a RecursionError from ``[[[[…`` was a 500).
- A string or object key holding NUL (``\\u0000``) or an unpaired surrogate (``\\ud800``) is a
  400: no field of this API means one, PostgreSQL cannot store NUL in text or jsonb (a 500 at
  the insert), and a surrogate cannot be encoded as UTF-8 for the node, envd or the logs. DRF's
  CharField refuses them in a field's value, but not in a dict's keys (``metadata``,
  ``envVars``) nor inside JSON fields (``network``, ``volumeMounts``, webhook bodies)."""
import re

from rest_framework import parsers
from rest_framework.exceptions import ParseError

_BAD = re.compile("[\x00\ud800-\udfff]")


def bad_string(data) -> str | None:
    """The first string (value or key) of parsed JSON ``data`` that has NUL or a surrogate."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _BAD.search(item):
                return item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
        if bad_string(data) is not None:  # never quoted: it may be a secret's value
            raise ParseError("JSON strings may not contain NUL or unpaired surrogates "
                             "(control characters and invalid unicode)")
        return data
