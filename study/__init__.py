"""The study around the engine: the judge, the cost model and report, leakage, the corpus and analysis.

It sits above storage and the engine (it reads storage's views and runs the engine's models), and only the
command line, the flows and the benchmarks use it.
"""
