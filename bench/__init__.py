"""`make bench`: raypipe's throughput and memory against the ceilings in DESIGN.md.

Modules: `corpus` (the generated paragraphs), `flops` (model FLOPs, the GEMM rate, the CPU),
`models` (random-weight BERTs of real shapes, cached), `lines` (one measured line each: the
in-process ceiling, the reference build's clients, raypipe end to end), `cluster` (a local Ray
cluster and process-tree sampling), `daily` (the delta-run section), `render` (JSON and
Markdown), `run` (the command line).
"""
