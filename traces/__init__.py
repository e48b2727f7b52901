"""Sample arrival traces shipped with kvdeck: excerpts of public traces, each with its source
and license in this folder's README.md. `kvdeck run-trace NAME` and `kvdeck bench NAME`
accept their names (`azure-conv`, `azure-code`, `mooncake-conversation`)."""
