"""The compiled CPU backend (``--backend openvino``), one module per job, each importing only those listed
before it:

- ``cache.py``: the graph files' paths in the cache (keyed as ``engine/graph_cache.py`` keys them), their atomic
  writes; and how OpenVINO is imported (its usage telemetry declined).
- ``conversion.py``: the PyTorch module traced into an OpenVINO graph, and NNCF's int8 copy of it, in a child
  process (``python -m memfit.engine.openvino.conversion``).
- ``compiled.py``: :class:`~memfit.engine.openvino.compiled.CompiledGraph`, a cached graph compiled for the CPU
  in one precision and run; ``load_graph`` finds or converts it.
- ``backend.py``: the backend proper (``OpenVINOBackend``, its engine, the memory layer's ``Network``)
  and its registry entry ``OPENVINO``; why this backend exists.

Nothing is imported here, so the conversion child imports only what it runs.
"""
