"""App objects' ids and texts: the ledger item id of an app id (:func:`ledger_id`, the
same on every worker), and the default readers of an object's id and text."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping

from ledger.agent.effects import Obj
from ledger.errors import (
    InvalidArgument,
)
from ledger.protocol import ID_RE

DIGEST_PREFIX = "h."
_DIGEST_RE = re.compile(r"h\.[0-9a-f]{32}")
_PLAIN_MAX = 64


def ledger_id(app_id: object) -> str:
    """The ledger item id of an app id (a URL, a UUID, a long name, an int...): the app
    id itself when it is a short plain id, else ``h.`` and a 128-bit BLAKE2b digest of
    it. Every worker derives the same id from the same app id."""
    if (
        type(app_id) is str
        and len(app_id) <= _PLAIN_MAX
        and not app_id.startswith(DIGEST_PREFIX)
        and ID_RE.fullmatch(app_id)
    ):
        return app_id  # a short plain id, the common case (fast)
    if isinstance(app_id, bool) or not isinstance(app_id, (str, int, uuid.UUID)):
        raise InvalidArgument(f"an app id must be a str, int or UUID, got {app_id!r}")
    text = str(app_id)
    if not text:
        raise InvalidArgument("an app id must not be empty")
    plain = len(text) <= _PLAIN_MAX and ID_RE.fullmatch(text)
    if plain and (not text.startswith(DIGEST_PREFIX) or _DIGEST_RE.fullmatch(text)):
        return text  # a plain id, or a digest already (ledger_id is idempotent)
    return (
        DIGEST_PREFIX
        + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    )


def _text_part(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: the text parts
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, Mapping) and isinstance(p.get("text"), str):
                parts.append(p["text"])
        return "\n".join(parts)
    return json.dumps(content, sort_keys=True, default=str)


def default_id(obj: Obj) -> object:
    """An app object's own id: ``id``, ``tool_call_id`` or ``call_id`` (attribute or
    key), or a Document's ``metadata["id"]``. None when it has none."""
    if type(obj) is dict:  # a plain message or chunk dict, the common case (fast)
        for name in ("tool_call_id", "call_id", "id"):
            v = obj.get(name)
            if v is not None and v != "":
                return v
        return None
    for name in ("tool_call_id", "call_id", "id"):
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if v not in (None, ""):
            return v
    meta = getattr(obj, "metadata", None)
    if isinstance(meta, Mapping) and meta.get("id") not in (None, ""):
        return meta["id"]
    return None


def default_text(obj: Obj) -> str:
    """The text a model sees of an app object: a string itself, or its
    ``page_content`` / ``content`` / ``text`` / ``output`` (attribute or key), plus
    the tool calls a message carries."""
    if type(obj) is dict:  # a plain message or chunk dict, the common case (fast)
        text = obj.get("content")
        if type(text) is str and "page_content" not in obj and not obj.get("tool_calls"):
            return text
    elif isinstance(obj, str):
        return obj
    for name in ("page_content", "content", "text", "output"):
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if v is not None:
            text = _text_part(v)
            calls = (
                obj.get("tool_calls")
                if isinstance(obj, Mapping)
                else getattr(obj, "tool_calls", None)
            )
            if calls:
                text += json.dumps(calls, sort_keys=True, default=str)
            return text
    raise InvalidArgument(
        f"cannot tell the text of a {type(obj).__name__}: give it content / page_content / "
        "text, or pass text_of= to the agent"
    )
