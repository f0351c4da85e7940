"""mtpflow's native CPU backend and everything it owns: the C kernel (``gemm.c``, ``rows_float.c``, ``rows_int8.c``)
and its one Python mirror (``kernel``), the products over torch tensors (``products``), the pure-torch references
the kernel is tested against (``reference``, ``int8_reference``: the int8 model's numerics), the certified LM head,
the OpenMP worker release, and the two backends: ``cpu.NativeCPUBackend`` (float32) and
``int8.NativeInt8Backend`` (the int8 model). Only ``mtpflow.backends`` imports this package
(tests/unit/test_layout.py)."""
