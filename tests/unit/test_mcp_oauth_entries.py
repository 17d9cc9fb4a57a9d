"""The shape of an mcps entry's auth= (one-line errors naming the fix), its settings,
and the failure class of a loop that needs a sign-in."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet

from flask_solidloop.config import Config
from flask_solidloop.errors import AgentDefinitionError, ConfigurationError
from flask_solidloop.loops.queries import classify_failure
from flask_solidloop.mcp.oauth import OAuthEntry
from flask_solidloop.mcp.registry import validate_entry

URL = "https://crm.example.com/mcp"


def entry(**auth):
    return {"name": "crm", "url": URL, "auth": {"type": "oauth", **auth}}


def test_valid_entries_pass_and_read_their_defaults():
    assert validate_entry(entry(client_id="app"), "a") == "url"
    assert validate_entry(entry(grant="client_credentials", client_id="m2m",
                                client_secret_env="CRM_SECRET"), "a") == "url"
    parsed = OAuthEntry.from_entry(entry(client_id="app"))
    assert (parsed.grant, parsed.subject, parsed.resource) == (
        "authorization_code", "default", URL)


@pytest.mark.parametrize(("bad", "fragment"), [
    ({"name": "crm", "toolset": None, "command": ["x"], "auth": {"type": "oauth"}},
     "auth= is for url= servers only"),
    ({"name": "crm", "url": URL, "auth": "oauth"}, "must be a dict with type 'oauth'"),
    (entry(client_id="app", client_secret="s"), "unknown key(s) client_secret"),
    (entry(grant="password", client_id="app"), "'authorization_code' or 'client_credentials'"),
    (entry(grant="client_credentials", client_id="m2m"), "needs client_id and client_secret_env"),
    (entry(), "needs client_id (pre-registered), client_metadata_url"),
    (entry(dynamic_registration="yes"), "dynamic_registration must be True or False"),
    ({**entry(client_id="app"), "api_token": "t"}, "auth= replaces api_token"),
    (entry(client_id="app", subject=""), "auth subject must be a non-empty str"),
    (entry(client_metadata_url="ftp://x"), "client_metadata_url must be an https URL"),
])
def test_bad_auth_is_one_line_naming_the_fix(bad, fragment):
    with pytest.raises(AgentDefinitionError) as info:
        validate_entry(bad, "helper")
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert message.startswith("agent 'helper': mcps entry 'crm'")


def test_the_oauth_key_is_a_fernet_key_never_echoed():
    key = Fernet.generate_key().decode()
    other = Fernet.generate_key().decode()
    assert Config.from_mapping({}).oauth_key == ()
    assert Config.from_mapping({"SOLIDLOOP_OAUTH_KEY": f"{key},{other}"}).oauth_key == (
        key, other)
    with pytest.raises(ConfigurationError, match=r"Fernet\.generate_key") as info:
        Config.from_mapping({"SOLIDLOOP_OAUTH_KEY": "not-a-key-but-a-secret"})
    assert "not-a-key-but-a-secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match=r"\{server\}"):
        Config.from_mapping({"SOLIDLOOP_OAUTH_SIGN_IN_URL": "https://app.example/sign-in"})


def test_a_loop_that_needs_a_sign_in_is_classed_auth_oauth():
    turn = "McpAuthError: crm: no OAuth token for subject 'default' yet; sign in at /x"
    assert classify_failure(turn) == "auth:oauth"
    assert classify_failure("tool call 7: " + turn) == "auth:oauth"
    # An HTTP status in the message does not make it an infra failure.
    assert classify_failure("McpAuthError: crm: refused (HTTP 400); sign in at /x") \
        == "auth:oauth"
