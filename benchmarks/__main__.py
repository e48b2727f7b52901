"""`python -m benchmarks`: run every benchmark in turn."""

from benchmarks import engine_overhead

if __name__ == "__main__":
    engine_overhead.main()
