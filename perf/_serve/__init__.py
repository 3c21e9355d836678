"""The parts of perf/serve_bench.py: the request trace (trace), the ranks' model, caches and layout
switches (engine), the continuous-batching loop per policy (loop) and its metrics, records and plot
(metrics). Benchmark harness code, not a serving engine."""
