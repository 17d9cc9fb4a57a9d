"""Every column that names a loop is classified by the loop retention
(loops/store/retention.py): deleted with the loop by a cascading foreign key,
left to its own rule, or a link between loops that must hold its loops back
(loops/sql/retention.py). A new table or column that names a loop (a child
agent's parent, a handoff) fails here until someone decides what a loop's
deletion does to it."""

from __future__ import annotations

from flask_solidloop.loops.store import retention
from flask_solidloop.models import metadata


def loop_columns() -> dict[str, set[str]]:
    """``{table: {column}}`` of every column named ``loop_id`` or ``*_loop_id``,
    or with a foreign key to solidloop_loops."""
    found: dict[str, set[str]] = {}
    for table in metadata.sorted_tables:
        for column in table.columns:
            names_a_loop = column.name == "loop_id" or column.name.endswith("_loop_id")
            references = any(fk.column.table.name == "solidloop_loops"
                             for fk in column.foreign_keys)
            if names_a_loop or references:
                found.setdefault(table.name, set()).add(column.name)
    return found


def test_every_column_that_names_a_loop_is_classified():
    # A table may have columns of more than one kind (a loop's own links).
    classified: dict[str, set[str]] = {}
    for kind in (retention.DELETED_WITH_THE_LOOP, retention.LEFT, retention.LINKS):
        for table, column in kind.items():
            classified.setdefault(table, set()).add(column)
    found = loop_columns()
    unclassified = {table: columns for table, columns in found.items()
                    if columns != classified.get(table)}
    assert not unclassified, (
        f"columns naming a loop that the loop retention does not classify: {unclassified}; "
        "add them to loops/store/retention.py (and a link to loops/sql/retention.py's _HELD)")
    # The classification names nothing that does not exist.
    assert set(classified) == set(found)


def test_what_goes_with_the_loop_goes_by_a_cascade():
    tables = {table.name: table for table in metadata.sorted_tables}
    for name, column in retention.DELETED_WITH_THE_LOOP.items():
        keys = [fk for fk in tables[name].columns[column].foreign_keys
                if fk.column.table.name == "solidloop_loops"]
        if name in retention.DELETED_BY_TRIGGER:
            # a statement trigger on the loops table deletes them (migration
            # 0024; tests/integration/test_stream_events.py and the retention
            # tests check the rows go): no foreign key to check them per row
            assert retention.DELETED_BY_TRIGGER[name] == column and not keys, name
            continue
        assert keys and keys[0].ondelete == "CASCADE", name
    for name, column in retention.LEFT.items():
        assert not tables[name].columns[column].foreign_keys, name
