"""TOML profiles (data only): hardware/, models/, workloads/. Found via runtime.resources."""
