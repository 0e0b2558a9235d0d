"""What the ledger stores, defined once: every field of every hash and record.

Each :class:`Field` is a ``str`` equal to its wire name (the short name the Lua scripts
read and write: ``EPOCH == "ep"``), so Python reads a hash or a reply with it directly
(``n[schema.EPOCH]``) and carries its long name, unit, owner and meaning with it. The wire
names are the protocol (docs/protocol.md): renaming one is a protocol change, so this
module gives them long names and never changes them.

A wire name with ``<...>`` in it is a pattern: ``u_<c>`` is ``u_w``, ``u_r``, ``u_m`` and
``u_s`` (:data:`CONSUMERS`), ``x:<name>`` any telemetry counter. Letters have one meaning
each: a consumer letter ``<c>`` (:data:`CONSUMERS`) means that consumer wherever it
appears, in the per-consumer fields (``u_``, ``n_``, ``v_``, ``i:``, ``r:``'s record) and in
the fields of the three claim groups, spelled with the letters of the consumers each holds:
``a_w``/``F_w`` working memory, ``a_rm``/``F_rm`` the memory group (retrieval ``r`` and
recall ``m``), ``a_s`` scratchpad; named here ``..._working``, ``..._memory_group``,
``..._scratchpad``.

The Lua side gets the same definitions as the legend of ``_common.lua``, generated from
this module: ``python tools/legend.py`` writes it, ``--check`` exits 1 when it is
stale (run by ``.ci/run`` and tests/test_schema.py, which also fails on a field a script
or a Python module uses that is not defined here).

Four records have a type of their own here: :class:`JobEntry` (an entry of a
partition's job stream), :class:`DeadLetterEntry` (an entry of its dead-letter stream),
:class:`SummaryRecord` (the JSON the ``compact`` script stores per summary) and the
content store's field name (:func:`content_field`).

The worker's own records (the dead letters and the errors hash: :data:`WORKER_OWNERS`) are
defined here too, but no script reads or writes them, so the Lua legend leaves them out.

One module a part: ``base`` (:class:`Field`, the units and owners, the registry
:data:`FIELDS`), ``session_hash`` (the session hash's fields), ``stores`` (every other
store's), ``records`` (the typed records), ``lua_legend`` (the legend of ``_common.lua``).
Every name is here: ``schema.EPOCH``, ``from ledger.schema import JobEntry``.
"""

from __future__ import annotations

# In this order: FIELDS (and so the legend, and lookup's preference) is the order in
# which the fields are defined, the session hash's first.
# isort: off
from ledger.schema.base import *  # noqa: F403
from ledger.schema.session_hash import *  # noqa: F403
from ledger.schema.stores import *  # noqa: F403
from ledger.schema.records import *  # noqa: F403
from ledger.schema.lua_legend import *  # noqa: F403
# isort: on
