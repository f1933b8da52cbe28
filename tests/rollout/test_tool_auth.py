"""rollout_service.tools.auth: signed requests and answers, no secret on the wire, no replay, and
a bounded memory of nonces."""

from __future__ import annotations

from rollout_service.tools.auth import (
    RequestVerifier,
    response_is_genuine,
    sign_request,
    sign_response,
)

TOKEN = "a-token-of-sixteen-or-more"


def test_a_signed_request_passes_once_and_carries_no_token() -> None:
    v = RequestVerifier(TOKEN)
    signed = sign_request(TOKEN, "POST", "/call/python", b"{}", now=1000.0)
    assert TOKEN not in str(signed.headers)
    assert v.check("POST", "/call/python", signed.headers, now=1001.0) == (signed.nonce, "")
    assert v.body_matches(signed.headers, b"{}") and not v.body_matches(signed.headers, b"[]")
    nonce, problem = v.check("POST", "/call/python", signed.headers, now=1001.0)
    assert nonce is None and "replayed" in problem


def test_what_is_refused_says_why() -> None:
    v = RequestVerifier(TOKEN, window_s=60)
    signed = sign_request(TOKEN, "POST", "/call/python", now=1000.0)
    cases = {
        "no x-tool-auth": ({}, "/call/python", 1000.0),
        "malformed": ({"x-tool-auth": "v0 1 2"}, "/call/python", 1000.0),
        "wrong MAC": (sign_request("another-token-0000000", "POST", "/x").headers, "/x", 1000.0),
        "wrong MAC ": (signed.headers, "/call/search", 1000.0),  # signed for another path
        "from this server's clock": (signed.headers, "/call/python", 1100.0),
    }
    for want, (headers, path, now) in cases.items():
        nonce, problem = v.check("POST", path, headers, now=now)
        assert nonce is None and want.strip() in problem, (want, problem)


def test_nonces_are_bounded_and_what_was_forgotten_cannot_come_back() -> None:
    v = RequestVerifier(TOKEN, window_s=1e9, max_nonces=4)
    requests = [sign_request(TOKEN, "GET", "/tools", now=float(t)) for t in range(10)]
    for r in requests:
        assert v.check("GET", "/tools", r.headers, now=10.0)[0] == r.nonce
    assert len(v._nonces) <= 4
    for r in requests:  # the forgotten ones are below the floor, the rest remembered: none passes
        assert v.check("GET", "/tools", r.headers, now=10.0)[0] is None


def test_an_answer_is_genuine_only_under_the_token_for_that_request() -> None:
    header = {"x-tool-server-auth": sign_response(TOKEN, "n1", 200, b"ok")}
    assert response_is_genuine(TOKEN, "n1", 200, b"ok", header)
    assert not response_is_genuine(TOKEN, "n2", 200, b"ok", header)  # another request's
    assert not response_is_genuine(TOKEN, "n1", 200, b"changed", header)
    assert not response_is_genuine("another-token-0000000", "n1", 200, b"ok", header)
    assert not response_is_genuine(TOKEN, "n1", 200, b"ok", {})
