"""The repository as a whole: package faces, examples/ and benchmarks/ scripts."""
