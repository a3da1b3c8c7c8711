"""The benchmarks, a package: each runs from the repository root as
`python -m bench.<folder>.<script>` (bench/README.md says which question each answers)."""
