"""The sample traces the tests read: excerpts of public traces shipped in `traces/` (see its
README.md for their sources and licenses). Nothing outside the repository is read."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"
AZURE_CONV = TRACES / "azure-conv.csv"
AZURE_CODE = TRACES / "azure-code.csv"
MOONCAKE = TRACES / "mooncake-conversation.jsonl"
