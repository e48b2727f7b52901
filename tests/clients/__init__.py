"""Tests against real load-testing clients and real peer servers, run by `make clients`."""

import os

import pytest

PEERS = pytest.mark.skipif(os.environ.get("KVDECK_CLIENTS") != "1",
                           reason="real peer servers (vLLM, llama-server) run under "
                                  "`make clients`")
"""The one rule for tests that start a peer server: they run under `make clients` only
(the peers install into .venv-clients/ on first use, minutes on two cores)."""
