"""Probe renders that find what a chat template does (its end-of-turn tokens, whether it wants
tool-call arguments as a JSON string, whether a turn ends at the next role token), never by
the template's name."""

from __future__ import annotations

# The tool the end-of-turn probe calls (`ChatFormat._detected_end_of_turns`).
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"value": {"type": "string"}}},
    },
}
