"""Where the shared public traces live: `../shared/traces` beside the checkout (CI lays a copy
of shared/ beside its clone the same way)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
AZURE_CONV = TRACES / "azure-llm-2023" / "conv.csv"
AZURE_CODE = TRACES / "azure-llm-2023" / "code.csv"
MOONCAKE = TRACES / "mooncake-fast25" / "conversation_trace.jsonl"
