"""Backends: one module per library whose kernels ``exactref audit`` can judge.

Each module is a kernel module (it defines ``EXACTREF_KERNELS``, as a kernel
repository's own module does): the library's kernels, the error model that
fits each one, and its known failures with their evidence.  ``torch`` is the
default.  The judge's core never imports a backend.
"""

__all__: list[str] = []
