"""The FP4-KV engine: runs without Ray (plain Python objects, testable step by step).

Ray is imported only by the Ray executor (ray_executor.py and its worker actor, tp_worker.py), and
only when an engine runs with `distributed_executor_backend: ray`; tests/test_import_graph.py
checks that no other module here imports it. Nothing here imports app.router or app.deployments.
"""
