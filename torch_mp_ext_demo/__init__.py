"""The demo (``python -m torch_mp_ext demo``) and the tensor hand-off measurement it shares
with ``benchmarks/bench_tensor_transfer.py``. Not part of the runtime: nothing in
:mod:`torch_mp_ext` imports it except the command line's ``demo``."""
