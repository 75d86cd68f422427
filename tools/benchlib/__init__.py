"""The benchmarks behind tools/bench.py (make bench). Standard library only; PyTorch is
optional (the throughput section compares with it when `import torch` works).

    measure.py       runs the training binaries and collects every section's figures
    traces.py        reads the runtime's traces: a step's figures on the modelled clock, the process groups
    memory_model.py  the model's sizes and the analytic memory model (tests/test_memory_model.py)
    caching_allocator.py  PyTorch's CUDA caching allocator's reserved bytes for a memory snapshot's events
                     (tools/simulate.py's reserved figure; tests/test_caching_allocator.py)
    report.py        results/bench.md and the targets, from the collected figures
    figures.py       statistics, number formatting and markdown sections that measure.py and report.py share

The stages come from grader/manifest.py; a stage the bench singles out is named by number.
"""
import repo_paths  # noqa: F401  (grader/ on sys.path: the modules here import the manifest and gradelib)
