"""docs/guide/troubleshooting.md quotes carve's messages: each one must still be what carve
prints. Every fragment of a quoted message (the text between ``...``) must occur in a string
literal of the shipped packages, as the Python parser joins it (implicit concatenation), so a
reworded message fails here until the guide is updated too."""

from __future__ import annotations

import re

from tests.support.sourcetext import REPO, string_literals

PAGE = REPO / "docs" / "guide" / "troubleshooting.md"
# Fragments shorter than this say nothing (e.g. "0/"), and are not checked.
_MIN_FRAGMENT = 6


def _quoted_messages() -> list[str]:
    """The backticked text of the table's message column."""
    messages = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) >= 4 and line.startswith("| ") and "---" not in line:
            messages += re.findall(r"`([^`]+)`", cells[1])
    return messages


def test_the_table_quotes_messages() -> None:
    assert len(_quoted_messages()) >= 15


def test_every_quoted_message_is_carves_wording() -> None:
    literals = string_literals()
    stale = []
    for message in _quoted_messages():
        for part in message.split("..."):
            fragment = part.strip(" :;,.()")
            if len(fragment) >= _MIN_FRAGMENT and fragment not in literals:
                stale.append(f"{fragment!r} (from {message!r})")
    assert not stale, "troubleshooting.md quotes text carve no longer prints:\n" + "\n".join(stale)
