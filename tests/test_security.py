"""Trust boundaries, round 2 (issue 42): the policy endpoint under hostile clients, tool schemas as
data, checkpoints that stay in their directory, short keys masked. Each test names the finding it
covers; docs/security.md lists them."""

from __future__ import annotations


# --- finding 8: short API keys in innocent fields ---------------------------------------------


def test_a_short_key_in_an_innocent_field_is_masked():
    """Finding 8: `sk-` and 8 key characters under a key named `note` went to config.yaml in
    clear (the rule wanted 12). Every key prefix is now masked from 8 characters on; shorter
    values and look-alikes inside words stay."""
    from agentgrpo.run.log import mask_secrets

    assert mask_secrets(
        {
            "note": "sk-abcd1234",
            "env": {"kwargs": {"x": "use hf_abcdefgh here", "y": "ghp_12345678"}},
            "short": "sk-1234567",
            "word": "task-abcdefghij",
        }
    ) == {
        "note": "***",
        "env": {"kwargs": {"x": "use *** here", "y": "***"}},
        "short": "sk-1234567",
        "word": "task-abcdefghij",
    }
